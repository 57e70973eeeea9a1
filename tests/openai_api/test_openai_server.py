"""The OpenAI-compatible server (eagle_serve.openai_api) in front of the real tritonserver,
driven by the official `openai` client.

The tiny float64 Llama (with a tiny byte-level tokenizer and a ChatML template) makes greedy
text exact, so answers are compared with the ensemble's for the same prompt.
"""
from __future__ import annotations

import concurrent.futures as futures
import json
import urllib.error
import urllib.request

import openai
import pytest
from openai_front import PROMPT, chat, launch_openai, streamed_chat, user, wait_until
from triton_pool import get, post_json, tight_server

from eagle_serve.client import grpc_generate, metrics
from eagle_serve.core.tokenization import decode, encode_prompt, render_chat

pytestmark = pytest.mark.server


def test_greedy_chat_text_equals_the_ensembles_streamed_or_not(api, tiny):
    for prompt in (PROMPT, "What is the capital of France?"):
        ensemble = grpc_generate(tiny.grpc_url, prompt, max_tokens=24)
        assert ensemble.error is None and ensemble.text
        whole = chat(api, user(prompt), max_tokens=24)
        assert whole.choices[0].message.content == ensemble.text
        assert whole.choices[0].message.role == "assistant"
        assert whole.choices[0].finish_reason == ensemble.finish_reason
        text, chunks = streamed_chat(api, user(prompt), max_tokens=24)
        assert text == ensemble.text
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks][-1] == ensemble.finish_reason
        assert len(chunks) > 3 and all(c.id == chunks[0].id for c in chunks)


def test_usage_equals_the_prompt_and_output_token_counts(api, tokenizer):
    whole = chat(api, user(PROMPT), max_tokens=12, extra_body={"ignore_eos": True})
    usage = whole.usage
    assert usage.prompt_tokens == len(encode_prompt(tokenizer, PROMPT))
    assert usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    assert usage.total_tokens == usage.prompt_tokens + 12
    spec = usage.model_extra["speculative"]
    assert spec["rounds"] > 0 and spec["draft_tokens"] > 0  # the tiny server drafts k = 3
    assert spec["acceptance_length"] == (spec["accepted_tokens"] + spec["rounds"]) / spec["rounds"]
    _, chunks = streamed_chat(api, user(PROMPT), max_tokens=12, extra_body={"ignore_eos": True},
                              stream_options={"include_usage": True})
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    streamed = chunks[-1].usage
    assert (streamed.prompt_tokens, streamed.completion_tokens) == (usage.prompt_tokens, 12)
    _, plain = streamed_chat(api, user(PROMPT), max_tokens=4)
    assert all(c.usage is None for c in plain)  # no usage unless asked for


def test_a_system_message_and_several_turns_go_through_the_targets_chat_template(api, tiny, tokenizer):
    messages = [{"role": "system", "content": "You answer in rhymes."},
                {"role": "user", "content": "Name a fruit."},
                {"role": "assistant", "content": "An apple a day."},
                {"role": "user", "content": [{"type": "text", "text": "And a "},
                                             {"type": "text", "text": "vegetable?"}]}]
    rendered = render_chat(tokenizer, [{**m, "content": m["content"] if isinstance(m["content"], str)
                                        else "And a vegetable?"} for m in messages])
    assert rendered.count("<|im_start|>") == 5 and "You answer in rhymes." in rendered
    ensemble = grpc_generate(tiny.grpc_url, rendered, max_tokens=20, apply_chat_template=False)
    got = chat(api, messages, max_tokens=20)
    assert ensemble.error is None and got.choices[0].message.content == ensemble.text
    assert got.usage.prompt_tokens == len(encode_prompt(tokenizer, rendered, apply_chat_template=False))


def test_completions_send_the_raw_prompt_streamed_or_not(api, tiny):
    prompt = "Once upon a time"
    ensemble = grpc_generate(tiny.grpc_url, prompt, max_tokens=16, apply_chat_template=False)
    client = api.client()
    whole = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=16)
    assert ensemble.error is None and whole.choices[0].text == ensemble.text
    assert whole.object == "text_completion" and whole.usage.completion_tokens == len(ensemble.output_ids)
    chunks = list(client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=16, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ensemble.text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stop_strings_end_the_text_before_them_but_not_before_min_tokens(api, tiny, tokenizer):
    full = grpc_generate(tiny.grpc_url, PROMPT, max_tokens=30, ignore_eos=True)
    # two tokens of the answer, before the 10th, whose text first appears where they start
    at = next(i for i in range(2, 9) if full.text.index(decode(tokenizer, full.output_ids[i:i + 2]))
              == len(decode(tokenizer, full.output_ids[:i])))
    stop, expected = decode(tokenizer, full.output_ids[at:at + 2]), decode(tokenizer, full.output_ids[:at])
    for value in (stop, [stop, "never appears 123"]):
        got = chat(api, user(PROMPT), max_tokens=30, stop=value, extra_body={"ignore_eos": True})
        assert got.choices[0].message.content == expected and got.choices[0].finish_reason == "stop"
        text, chunks = streamed_chat(api, user(PROMPT), max_tokens=30, stop=value,
                                     extra_body={"ignore_eos": True})
        assert text == expected and chunks[-1].choices[0].finish_reason == "stop"
    # min_tokens (an extension, as vLLM's): no stop string ends the output before it
    held = chat(api, user(PROMPT), max_tokens=30, stop=stop, extra_body={"ignore_eos": True, "min_tokens": 10})
    assert held.usage.completion_tokens >= 10 and held.choices[0].message.content.startswith(expected + stop)


def test_the_same_seed_gives_the_same_text_at_temperature_above_zero(api):
    kw = dict(max_tokens=16, temperature=0.9, top_p=0.95)
    first = chat(api, user(PROMPT), seed=1234, **kw).choices[0].message.content
    again = chat(api, user(PROMPT), seed=1234, **kw).choices[0].message.content
    streamed, _ = streamed_chat(api, user(PROMPT), seed=1234, **kw)
    other = chat(api, user(PROMPT), seed=4321, **kw).choices[0].message.content
    assert first == again == streamed
    assert other != first


def test_speculative_knobs_are_accepted_as_extra_body_fields(api):
    plain = chat(api, user(PROMPT), max_tokens=12, extra_body={"num_speculative_tokens": 0})
    assert plain.usage.model_extra["speculative"]["draft_tokens"] == 0
    tree = chat(api, user(PROMPT), max_tokens=12,
                extra_body={"num_speculative_tokens": 6, "draft_topk": 2, "draft_depth": 3})
    assert tree.usage.model_extra["speculative"]["draft_tokens"] > 0
    assert tree.choices[0].message.content == plain.choices[0].message.content  # greedy: exact


def error_of(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    body = caught.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return caught.value.status_code, body["error"]


def test_bad_requests_get_openai_format_errors_and_the_next_request_works(api):
    client = api.client()
    status, error = error_of(lambda: client.chat.completions.create(model="gpt-4o", messages=user("Hi")))
    assert status == 404 and error["code"] == "model_not_found" and "gpt-4o" in error["message"]
    cases = [(dict(n=20), "n"), (dict(max_tokens=-5), "max_tokens"), (dict(messages=[]), "messages"),
             (dict(top_p=1.5), "top_p"), (dict(extra_body={"echo": True}), "echo"),
             (dict(extra_body={"num_speculative_tokens": 99}), "num_speculative_tokens"),
             (dict(messages=[{"role": "robot", "content": "x"}]), "messages")]
    for kw, param in cases:
        args = {"model": "tiny-llama", "messages": user("Hi"), "max_tokens": 8, **kw}
        status, error = error_of(lambda: client.chat.completions.create(**args))
        assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error", (kw, error)
    assert "num_speculative_tokens must be in [0, 8]" in error_of(lambda: client.chat.completions.create(
        model="tiny-llama", messages=user("Hi"), extra_body={"num_speculative_tokens": 99}))[1]["message"]
    status, error = error_of(lambda: client.completions.create(model="tiny-llama", prompt=[]))
    assert status == 400 and error["param"] == "prompt"
    request = urllib.request.Request(f"{api.base_url}/v1/chat/completions", data=b'{"messages": [',
                                     headers={"Content-Type": "application/json"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 400 and "not valid JSON" in json.loads(caught.value.read())["error"]["message"]
    assert chat(api, user("Hi"), max_tokens=4).usage.completion_tokens >= 1


def test_models_health_and_metrics_endpoints(api, tiny):
    assert [m.id for m in api.client().models.list()] == ["tiny-llama"]
    assert api.client().models.retrieve("tiny-llama").id == "tiny-llama"
    assert get(f"{api.base_url}/health")[0] == 200
    status, text = get(f"{api.base_url}/metrics")
    assert status == 200 and 'eagle_kv_pages_free{pool="target"}' in text


def idle(metrics_url: str) -> bool:
    m = metrics(metrics_url)
    return (m["eagle_requests_running"] == 0 and m["eagle_requests_waiting"] == 0
            and m['eagle_kv_pages_free{pool="target"}'] == m['eagle_kv_pages_total{pool="target"}']
            and m['eagle_kv_pages_free{pool="drafter"}'] == m['eagle_kv_pages_total{pool="drafter"}']
            and m["eagle_draft_slots_free"] == 256)


def test_a_client_that_disconnects_frees_its_pages_and_slots(api, tiny):
    """A streamed client that closes after a few chunks, and one that gives up waiting for a
    whole answer: both requests end long before their 1800 tokens."""
    rounds = lambda: metrics(tiny.metrics_url)["eagle_spec_decode_rounds_total"]  # noqa: E731
    long = dict(max_tokens=1800, extra_body={"ignore_eos": True, "num_speculative_tokens": 1})
    before = rounds()
    stream = chat(api, user(PROMPT), stream=True, **long)
    for _, _chunk in zip(range(4), stream):
        pass
    stream.close()
    assert wait_until(lambda: idle(tiny.metrics_url), 30), metrics(tiny.metrics_url)
    assert rounds() - before < 300  # cancelled, not run to the end (~900 rounds)
    before = rounds()
    with pytest.raises(openai.APITimeoutError):
        api.client(timeout=1.5).chat.completions.create(model="tiny-llama", messages=user(PROMPT), **long)
    assert wait_until(lambda: idle(tiny.metrics_url), 30), metrics(tiny.metrics_url)
    assert rounds() - before < 300


def test_a_full_engine_answers_503_server_busy(triton_server, tiny_models, tmp_path):
    """One running request and one waiting (as in test_reliability's tight server): a burst
    gets 503 for the rest, and every served answer is the solo one."""
    tight = tight_server(triton_server, tiny_models)
    api = launch_openai(tight, tmp_path / "openai.log")
    try:
        kw = dict(max_tokens=16, extra_body={"ignore_eos": True})
        solo = chat(api, user(PROMPT), **kw).choices[0].message.content

        def one(_):
            try:
                return streamed_chat(api, user(PROMPT), **kw)[0]
            except openai.APIStatusError as error:
                return error
        with futures.ThreadPoolExecutor(10) as pool:
            burst = list(pool.map(one, range(10)))
        busy = [r for r in burst if isinstance(r, openai.APIStatusError)]
        assert busy and all(e.status_code == 503 and "server busy" in e.message for e in busy), burst
        assert all(r == solo for r in burst if isinstance(r, str))
    finally:
        api.stop()


def test_with_api_keys_set_the_api_answers_401_without_a_key_and_probes_stay_open(tiny, tmp_path):
    keyed = launch_openai(tiny, tmp_path / "keyed.log", env={"EAGLE_API_KEY": "key-one, key-two"})
    try:
        for key in ("unused", "key-one-and-more", "key-one,key-two"):
            with pytest.raises(openai.AuthenticationError) as refused:
                openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=key, max_retries=0).models.list()
            assert refused.value.code == "invalid_api_key"
        status, _ = get(f"{keyed.base_url}/v1/models")  # no Authorization header at all
        assert status == 401
        for key in ("key-one", "key-two"):
            client = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=key, max_retries=0)
            reply = client.chat.completions.create(model="tiny-llama", messages=user("Hi"), max_tokens=4)
            assert reply.choices[0].message.content is not None
        assert get(f"{keyed.base_url}/health")[0] == 200
        assert get(f"{keyed.base_url}/metrics")[0] == 200
    finally:
        keyed.stop()


def test_render_and_tokenize_give_the_prompt_ids_a_request_runs_on(api, tokenizer):
    """vLLM's endpoints that a cache-aware router (vllm-router) routes by."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    expected = encode_prompt(tokenizer, render_chat(tokenizer, messages), apply_chat_template=False)
    status, body = post_json(f"{api.base_url}/v1/chat/completions/render",
                             {"model": "tiny-llama", "messages": messages, "max_tokens": 4})
    assert status == 200 and body["token_ids"] == expected
    assert chat(api, messages, max_tokens=2).usage.prompt_tokens == len(expected)
    status, body = post_json(f"{api.base_url}/v1/completions/render", {"prompt": "Once upon a time"})
    assert status == 200 and body[0]["token_ids"] == encode_prompt(tokenizer, "Once upon a time", False)
    status, body = post_json(f"{api.base_url}/tokenize", {"messages": messages})
    assert status == 200 and body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] > 0
    status, body = post_json(f"{api.base_url}/detokenize", {"tokens": expected})
    assert status == 200 and body["prompt"] == decode(tokenizer, expected, skip_special_tokens=False)
    for path, bad in (("/tokenize", {}), ("/tokenize", {"prompt": "a", "messages": messages}),
                      ("/detokenize", {"tokens": [len(tokenizer)]}), ("/v1/chat/completions/render", {"messages": []})):
        status, body = post_json(f"{api.base_url}{path}", bad)
        assert status == 400 and body["error"]["message"], (path, bad, body)


def test_a_repeated_prefix_is_served_from_the_cache_with_the_same_answer_and_counted(api, tiny):
    # no other test's prompt starts as this one: its first request finds nothing cached
    system = {"role": "system", "content": "Sea questions get sea answers. " * 12}
    first = chat(api, [system, *user(PROMPT)], max_tokens=12)
    again = chat(api, [system, *user("What lives in the deep sea?")], max_tokens=12)
    same = chat(api, [system, *user(PROMPT)], max_tokens=12)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 32
    assert same.usage.prompt_tokens_details.cached_tokens > again.usage.prompt_tokens_details.cached_tokens
    assert same.choices[0].message.content == first.choices[0].message.content
    salted = chat(api, [system, *user(PROMPT)], max_tokens=12, extra_body={"cache_salt": "tenant-b"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert salted.choices[0].message.content == first.choices[0].message.content
    long_prompt = "Tell me about the tides and the moon. " * 10
    cold, warm = (grpc_generate(tiny.grpc_url, long_prompt, max_tokens=4, cache_salt="ensemble")
                  for _ in range(2))
    assert cold.error is None and cold.counters["num_cached_tokens"] == 0
    assert warm.counters["num_cached_tokens"] > 32 and warm.text == cold.text
    counted = metrics(tiny.metrics_url)
    hits = counted['vllm:prefix_cache_hits_total{model_name="tiny-llama"}']
    assert hits >= same.usage.prompt_tokens_details.cached_tokens
    assert counted['vllm:prefix_cache_queries_total{model_name="tiny-llama"}'] > hits
    assert 0 <= counted['vllm:kv_cache_usage_perc{model_name="tiny-llama"}'] <= 1
