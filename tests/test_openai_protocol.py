"""The OpenAI server's translation rules, without a server: request fields -> spec_decode
inputs, spec_decode errors -> HTTP status, counters -> usage."""
from __future__ import annotations

import pytest

from eagle_serve.openai_api.backend import error_from_message
from eagle_serve.openai_api.protocol import (ChatCompletionRequest, CompletionRequest, Counters,
                                             OpenAIError)


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


@pytest.mark.parametrize("field, value", [("n", 2), ("logprobs", True), ("presence_penalty", 0.5),
                                          ("tools", [{"type": "function"}]), ("best_of", 3),
                                          ("response_format", {"type": "json_object"}),
                                          ("min_p", 0.1), ("stop_token_ids", [2]),
                                          ("reasoning_effort", "low"), ("prediction", {"type": "content"}),
                                          ("guided_json", {"type": "object"}), ("skip_special_tokens", False)])
def test_unsupported_fields_are_refused_by_name(field, value):
    with pytest.raises(OpenAIError) as caught:
        chat_request(**{field: value}).check_supported()
    assert caught.value.status == 400 and caught.value.param == field


def test_unsupported_fields_at_their_defaults_and_unknown_fields_pass():
    chat_request(n=1, logprobs=False, presence_penalty=0, tools=[], user="me", store=False,
                 response_format={"type": "text"}, min_p=0.0, stop_token_ids=[]).check_supported()


def test_what_vllm_router_adds_to_a_forwarded_request_passes():
    routed = {"stream": False, "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
              "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
              "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True}
    chat_request(**routed).check_supported()


def test_a_completion_takes_one_prompt():
    assert CompletionRequest(prompt=["only"]).text() == "only"
    with pytest.raises(OpenAIError):
        CompletionRequest(prompt=["a", "b"]).text()


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
