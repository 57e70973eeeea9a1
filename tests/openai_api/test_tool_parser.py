"""Tool calls read out of an answer as it grows: a stream, cut anywhere, gives what the whole
answer gives, and sends each call's name before its arguments."""
import json
import random

import pytest

from eagle_serve.openai_api.tool_parser import ToolCallParser, parse
from eagle_serve.openai_api.tools import FunctionDef

HERMES = ('Let me look.  \n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os\\"lo}", "days": [1, 2]}}\n'
          '</tool_call>\nignored <tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
ANSWERS = [
    (HERMES, "auto"),
    ("no call here, only <tool text and trailing space  ", "auto"),
    ("  <tool_call>not json</tool_call> after", "auto"),
    ('<tool_call>{"arguments": {"x": 1}, "name": "swap"}</tool_call>', "auto"),  # keys in another order
    ('<tool_call>{"name": "n", "arguments": 12}</tool_call>', "auto"),
    ('[{"name": "a", "parameters": {}}, {"name": "b\\u00e9", "parameters": {"x": [1, {"y": "}"}]}}]', "required"),
    ('[{"name": "a", "parameters": {"x": "cut', "required"),
    ('[{"na', "required"),
    ('{"city": "Oslo", "n": -1.5e3}', FunctionDef(name="weather")),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "t", "parameters": {}}', "auto"),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "auto"),
    ('{"answer": "a JSON answer, no call"}', "auto"),
    ("Hi", "auto"),
]


def streamed(text: str, mode, rng: random.Random) -> tuple[str, list[dict], list]:
    """Feed `text` in random pieces -> (content, calls rebuilt from the deltas, the deltas)."""
    parser, deltas, at = ToolCallParser(mode), [], 0
    while at < len(text):
        step = rng.randint(1, 6)
        deltas += parser.feed(text[at:at + step])
        at += step
    deltas += parser.finish()
    calls: list[dict] = []
    for d in deltas:
        if d.call is not None:
            assert d.call["index"] == len(calls) and d.call["function"]["arguments"] == ""
            calls.append({"name": d.call["function"]["name"], "arguments": ""})
        elif not d.content:
            calls[d.index]["arguments"] += d.arguments  # a fragment after its call's name
    return "".join(d.content for d in deltas), calls, deltas


@pytest.mark.parametrize("text,mode", ANSWERS)
def test_a_stream_cut_anywhere_reads_as_the_whole_answer(text, mode):
    content, calls = parse(text, mode)
    whole = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
    for seed in range(20):
        got_content, got_calls, _ = streamed(text, mode, random.Random(seed))
        assert got_calls == whole
        assert got_content == (content or "")


def test_hermes_calls_keep_the_arguments_as_written_and_drop_text_after_a_call():
    content, calls = parse(HERMES, "auto")
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Os"lo}', "days": [1, 2]}
    assert calls[1]["function"]["arguments"] == "{}"
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


def test_text_without_a_call_is_the_content_unchanged():
    text = "  no call here, only <tool text  "
    assert parse(text, "auto") == (text, [])
    assert parse("<tool_call>not json</tool_call> after", "auto") == ("<tool_call>not json</tool_call> after", [])
    content, calls = parse('<tool_call>{"arguments": {"x": 1}, "name": "swap"}</tool_call>', "auto")
    assert content is None and calls[0]["function"] == {"name": "swap", "arguments": '{"x": 1}'}


def test_the_name_comes_before_any_argument_and_as_soon_as_it_is_written():
    parser = ToolCallParser("required")
    assert parser.feed('[{"name": "get_wea') == []
    head, = parser.feed('ther", "parameters": ')
    assert head.call["function"]["name"] == "get_weather"
    frag, = parser.feed('{"city": "Os')
    assert frag.arguments == '{"city": "Os' and frag.index == 0


def test_a_call_cut_by_max_tokens_finishes_with_length_and_a_whole_one_with_tool_calls():
    cut = ToolCallParser("required")
    cut.feed('[{"name": "a", "parameters": {"x": "cu')
    cut.finish()
    assert cut.finish_reason("length") == "length"
    whole = ToolCallParser("required")
    whole.feed('[{"name": "a", "parameters": {}}]')
    whole.finish()
    assert whole.finish_reason("stop") == "tool_calls"
    plain = ToolCallParser("auto")
    plain.feed("hello")
    plain.finish()
    assert plain.finish_reason("length") == "length"
    assert parse('[{"na', "required") == ('[{"na', [])


def test_an_answer_opening_with_a_bare_call_is_read_as_calls_as_models_own_templates_write_them():
    content, calls = parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                           '{"name": "t", "parameters": {}}', "auto")
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Oslo"}'), ("t", "{}")]
    _, mistral = parse('[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]', "auto")
    assert mistral[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert parse('{"answer": "no call"}', "auto") == ('{"answer": "no call"}', [])
