"""Structured output end to end through the real tritonserver with the official `openai` client:
`response_format` (json_schema, json_object), vLLM's guided fields, TensorRT-LLM's guide inputs
on the ensemble; speculative answers equal plain decoding's, and bad guides get a 400."""
from __future__ import annotations

import json

import openai
import pytest
from openai_front import chat, user

pytestmark = pytest.mark.server

PROMPT = "Describe a person as JSON."
PLAIN = {"num_speculative_tokens": 0}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


def test_a_json_schema_answer_parses_to_the_schema_and_equals_plain_decodings(api):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    spec = chat(api, user(PROMPT), max_tokens=60, response_format=fmt)
    plain = chat(api, user(PROMPT), max_tokens=60, response_format=fmt, extra_body=PLAIN)
    text = spec.choices[0].message.content
    assert text == plain.choices[0].message.content
    assert spec.choices[0].finish_reason == "stop"
    value = json.loads(text)
    assert set(value) == {"name", "age"} and 0 <= value["age"] <= 99 and len(value["name"]) <= 8


def test_json_object_and_vllms_guided_fields(api):
    obj = chat(api, user(PROMPT), max_tokens=40, response_format={"type": "json_object"})
    assert obj.choices[0].message.content.lstrip()[:1] in "{[\"-0123456789tfn"
    choice = chat(api, user("Pick a colour"), max_tokens=8, extra_body={"guided_choice": ["red", "green", "blue"]})
    assert choice.choices[0].message.content in ("red", "green", "blue")
    regex = chat(api, user("Answer"), max_tokens=12, extra_body={"structured_outputs": {"regex": "(yes|no)-[0-9]{3}"}})
    assert regex.choices[0].message.content[:3] in ("yes", "no-")
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(
        api, user("Pick a colour"), max_tokens=8, stream=True, extra_body={"guided_choice": ["red", "green", "blue"]})
        if c.choices)
    assert streamed == choice.choices[0].message.content


@pytest.mark.parametrize("kw, message", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "json_schema.schema"),
    (dict(extra_body={"guided_regex": "(unclosed"}), "does not compile"),
    (dict(extra_body={"guided_json": "{not json"}), "not valid JSON"),
    (dict(extra_body={"guided_regex": "a", "guided_choice": ["b"]}), "set one structured-output guide"),
    (dict(extra_body={"guided_json": {"type": "object", "x": "y" * 70000}}), "more than the limit of 65536")])
def test_bad_guides_get_a_400_naming_the_problem_and_the_next_request_works(api, kw, message):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(api, user(PROMPT), max_tokens=8, **kw)
    assert message in caught.value.body["message"]
    assert chat(api, user(PROMPT), max_tokens=4).choices[0].message.content


def test_tritonclient_users_send_tensorrt_llms_guide_inputs_to_the_ensemble(tiny):
    from eagle_serve.client import grpc_generate

    def run(k: int) -> str:
        return grpc_generate(tiny.grpc_url, "Pick one", max_tokens=8, num_speculative_tokens=k,
                             guided_decoding_guide_type="choice", guided_decoding_guide='["alpha", "beta"]').text
    assert run(3) == run(0) and run(3) in ("alpha", "beta")


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                   "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def test_a_named_tool_choice_returns_that_call_with_arguments_in_its_schema(api):
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = chat(api, user("Weather in Oslo?"), max_tokens=40, tools=WEATHER, tool_choice=named)
    plain = chat(api, user("Weather in Oslo?"), max_tokens=40, tools=WEATHER, tool_choice=named, extra_body=PLAIN)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call, = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"city"}
    assert call.function.arguments == plain.choices[0].message.tool_calls[0].function.arguments


def test_required_tool_choice_gives_at_least_one_call_and_streams_name_then_arguments(api):
    kw = dict(max_tokens=120, tools=WEATHER, tool_choice="required", parallel_tool_calls=False)
    reply = chat(api, user("Weather in Oslo?"), **kw)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert all(c.function.name in ("get_weather", "get_time") for c in calls)
    chunks = list(chat(api, user("Weather in Oslo?"), stream=True, **kw))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == calls[0].function.name and deltas[0].id
    first = [d.function.arguments for d in deltas if d.index == 0]
    assert "".join(first) == calls[0].function.arguments  # name first, then argument fragments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_and_a_full_tool_round_trip_are_accepted(api):
    reply = chat(api, user("Weather in Oslo?"), max_tokens=16, tools=WEATHER, tool_choice="auto")
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    history = user("Weather in Oslo?") + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C and rain"}]
    after = chat(api, history, max_tokens=12, tools=WEATHER)
    assert after.choices[0].message.content is not None and after.usage.prompt_tokens > 40
