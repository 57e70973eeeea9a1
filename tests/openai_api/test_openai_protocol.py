"""The OpenAI server's translation rules, without a server: request fields -> spec_decode
inputs, spec_decode errors -> HTTP status, counters -> usage."""
from __future__ import annotations

import pytest

from eagle_serve.openai_api.backend import error_from_message
from eagle_serve.openai_api.protocol import ChatCompletionRequest, CompletionRequest, Counters, OpenAIError


def chat_request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], **kw)


def test_request_fields_become_spec_decode_inputs():
    params = chat_request(max_tokens=5, max_completion_tokens=7, stop="END", seed=-1,
                          temperature=0.5, draft_topk=2).params()
    assert params.max_tokens == 7  # max_completion_tokens wins over the older max_tokens
    assert params.stop == ["END"] and params.seed == 2 ** 64 - 1
    assert (params.temperature, params.draft_topk, params.top_p) == (0.5, 2, None)
    assert chat_request(stop=["a", "b"]).params().stop == ["a", "b"]
    assert chat_request(min_tokens=3).params().min_tokens == 3 and chat_request().params().min_tokens is None
    assert chat_request().params().max_tokens == -1  # unset: to the end of the context (vLLM's)


@pytest.mark.parametrize("field, value", [("functions", [{"name": "f"}]), ("prompt_logprobs", 2),
                                          ("echo", True),
                                          ("allowed_token_ids", [1, 2]), ("suffix", "end"),
                                          ("reasoning_effort", "low"), ("prediction", {"type": "content"}),
                                          ("skip_special_tokens", False)])
def test_unsupported_fields_are_refused_by_name(field, value):
    with pytest.raises(OpenAIError) as caught:
        chat_request(**{field: value}).check_supported()
    assert caught.value.status == 400 and caught.value.param == field


def test_unsupported_fields_at_their_defaults_and_unknown_fields_pass():
    chat_request(n=1, logprobs=False, presence_penalty=0, tools=[], user="me", store=False,
                 response_format={"type": "text"}, min_p=0.0, stop_token_ids=[]).check_supported()


def test_processor_fields_become_spec_decode_inputs():
    params = chat_request(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, min_p=0.1,
                          logit_bias={"5": 300, "7": -2.5}, bad_words=["no"], stop_token_ids=[2],
                          logprobs=True, top_logprobs=4).params()
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_p) == (
        0.5, -1, 1.2, 0.1)
    assert params.logit_bias_ids == [5, 7] and params.logit_bias_values == [100.0, -2.5]  # clamped as OpenAI
    assert (params.bad_words, params.stop_token_ids, params.logprobs) == (["no"], [2], 4)
    assert chat_request(logprobs=True).params().logprobs == 0 and chat_request().params().logprobs is None
    completion = CompletionRequest(prompt="x", logprobs=2, echo=True).params()
    assert (completion.logprobs, completion.prompt_logprobs) == (2, 2)
    assert CompletionRequest(prompt="x", logprobs=False).params().logprobs is None  # vllm-router's value


def test_a_seeded_requests_choices_take_consecutive_seeds():
    request = chat_request(n=3, seed=7, temperature=1.0)
    assert [request.choice_params(i).seed for i in range(3)] == [7, 8, 9]
    assert chat_request(n=2, temperature=1.0).choice_params(1).seed is None


@pytest.mark.parametrize("body, param", [
    (dict(n=17), "n"), (dict(top_logprobs=21, logprobs=True), "top_logprobs"),
    (dict(logit_bias={str(i): 1 for i in range(2000)}), "logit_bias"),
    (dict(stop_token_ids=list(range(100))), "stop_token_ids"), (dict(presence_penalty=2.5), "presence_penalty")])
def test_out_of_range_fields_are_refused_by_pydantic(body, param):
    from pydantic import ValidationError
    with pytest.raises(ValidationError, match=param):
        chat_request(**body)


def test_top_logprobs_without_logprobs_is_refused():
    with pytest.raises(OpenAIError, match="top_logprobs needs logprobs"):
        chat_request(top_logprobs=2).params()


def test_what_vllm_router_adds_to_a_forwarded_request_passes():
    routed = {"stream": False, "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
              "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
              "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True}
    chat_request(**routed).check_supported()


def test_a_completion_takes_text_token_ids_or_lists_of_either():
    assert CompletionRequest(prompt="only").prompts() == ["only"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    with pytest.raises(OpenAIError, match="at most 16"):
        CompletionRequest(prompt=["a"] * 9, n=2).check_supported()
    with pytest.raises(OpenAIError, match="best_of must equal n"):
        CompletionRequest(prompt="a", best_of=3).check_supported()
    CompletionRequest(prompt="a", best_of=2, n=2).check_supported()


@pytest.mark.parametrize("message, status, param", [
    ("server busy: 64 requests are already waiting", 503, None),
    ("the server is shutting down", 503, None),
    ("Stub process 'spec_decode_0_0' is not healthy.", 503, None),
    ("engine error: boom", 500, None),
    ("top_p must be in (0, 1], got 1.5", 400, "top_p"),
    ("min_tokens must be in [0, max_tokens = 8], got 9", 400, "min_tokens"),
    ("prompt (30 tokens) + max_tokens (3000) exceeds max_model_len (2048)", 400, None),
])
def test_spec_decode_errors_map_to_http_statuses(message, status, param):
    error = error_from_message(message)
    assert (error.status, error.param, error.message) == (status, param, message)
    assert error.body()["error"]["type"] == ("server_error" if status >= 500 else "invalid_request_error")


def test_usage_carries_the_speculative_counters():
    usage = Counters(input_tokens=10, output_tokens=9, draft_tokens=12, accepted_tokens=6,
                     rounds=3).usage()
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (10, 9, 19)
    assert usage["speculative"] == {"draft_tokens": 12, "accepted_tokens": 6, "rounds": 3,
                                    "acceptance_length": 3.0}
    assert Counters().usage()["speculative"]["acceptance_length"] is None


def test_structured_output_fields_become_one_guide():
    schema = {"type": "object"}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    params = chat_request(response_format=fmt).params()
    assert (params.guided_decoding_guide_type, params.guided_decoding_guide) == ("json_schema", '{"type": "object"}')
    assert chat_request(response_format={"type": "json_object"}).params().guided_decoding_guide_type == "json"
    assert chat_request(guided_choice=["a", "b"]).params().guided_decoding_guide == '["a", "b"]'
    assert chat_request(structured_outputs={"grammar": "root ::= \"a\""}).params().guided_decoding_guide_type == "ebnf_grammar"
    assert chat_request(response_format={"type": "text"}).params().guided_decoding_guide_type is None
    assert chat_request(guided_grammar='start: "a"').params().guided_decoding_guide_type == "lark"
    with pytest.raises(OpenAIError, match="set one structured-output guide"):
        chat_request(guided_regex="a", response_format={"type": "json_object"}).params()


def test_hermes_tool_calls_are_parsed_out_of_an_answer():
    from eagle_serve.openai_api.tool_parser import parse
    from eagle_serve.openai_api.tools import FunctionDef
    text = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parse(text, "auto")
    assert content == "Let me look." and calls[0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    assert parse("no call here", "auto") == ("no call here", [])
    assert parse("<tool_call>not json</tool_call>", "auto")[1] == []
    _, named = parse('{"city": "Oslo"}', FunctionDef(name="weather"))
    assert named[0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    _, required = parse('[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"x": 1}}]', "required")
    assert [c["function"]["name"] for c in required] == ["a", "b"] and required[1]["function"]["arguments"] == '{"x": 1}'


def test_a_tool_round_trip_is_written_into_the_conversation_as_hermes_turns():
    from eagle_serve.openai_api.tools import Tool, hermes_messages
    tools = [Tool(type="function", function={"name": "weather", "parameters": {"type": "object"}})]
    request = chat_request(tools=[t.model_dump() for t in tools])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "12 C"}]
    out = hermes_messages(messages, request.tools)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.") and "<tools>" in out[0]["content"]
    assert out[2] == {"role": "assistant",
                      "content": '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n12 C\n</tool_response>"}
    assert request.tool_mode() == "auto" and request.params().guided_decoding_guide is None
    assert chat_request(tools=[t.model_dump() for t in tools], tool_choice="none").tool_mode() is None


def test_required_and_named_tool_choices_constrain_the_output():
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    named = chat_request(tools=tools, tool_choice={"type": "function", "function": {"name": "weather"}}).params()
    assert named.guided_decoding_guide_type == "json_schema" and '"city"' in named.guided_decoding_guide
    required = chat_request(tools=tools, tool_choice="required").params()
    assert '"minItems": 1' in required.guided_decoding_guide and '"const": "weather"' in required.guided_decoding_guide
    with pytest.raises(OpenAIError, match="not among the tools"):
        chat_request(tools=tools, tool_choice={"type": "function", "function": {"name": "other"}}).params()
    with pytest.raises(OpenAIError, match="set one structured-output guide"):
        chat_request(tools=tools, tool_choice="required", response_format={"type": "json_object"}).params()
