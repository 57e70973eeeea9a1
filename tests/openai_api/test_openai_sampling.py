"""What clients send beyond a prompt, end to end through the real tritonserver with the official
`openai` client: logprobs, penalties and the other logits processors, n choices, echo, token-id
prompts and lists of prompts; and the same logprobs from spec_decode and the ensemble for
tritonclient users. The tiny float64 Llama makes greedy text exact: speculative answers are
compared with plain decoding's (num_speculative_tokens 0)."""
from __future__ import annotations

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
from openai_front import PROMPT, chat, streamed_chat, user

pytestmark = pytest.mark.server

PLAIN = {"num_speculative_tokens": 0}


def completion(api, **kw):
    return api.client().completions.create(model="tiny-llama", **kw)


def test_chat_logprobs_are_plain_decodings_and_spell_the_text(api):
    spec = chat(api, user(PROMPT), max_tokens=12, logprobs=True, top_logprobs=3)
    plain = chat(api, user(PROMPT), max_tokens=12, logprobs=True, top_logprobs=3, extra_body=PLAIN)
    assert spec.usage.speculative["rounds"] < 12 or spec.usage.speculative["draft_tokens"] > 0
    a, b = spec.choices[0], plain.choices[0]
    assert a.message.content == b.message.content
    assert "".join(t.token for t in a.logprobs.content) == a.message.content
    assert len(a.logprobs.content) == spec.usage.completion_tokens
    for x, y in zip(a.logprobs.content, b.logprobs.content):
        assert x.token == y.token and x.logprob == pytest.approx(y.logprob, abs=1e-5)
        assert len(x.top_logprobs) == 3 and x.top_logprobs[0].token == x.token  # greedy: the top one
        assert x.logprob == pytest.approx(x.top_logprobs[0].logprob) and x.logprob <= 0
        assert bytes(x.bytes).decode() == x.token


def test_streamed_logprobs_equal_the_whole_answers(api):
    whole = chat(api, user(PROMPT), max_tokens=10, logprobs=True, top_logprobs=2)
    text, chunks = streamed_chat(api, user(PROMPT), max_tokens=10, logprobs=True, top_logprobs=2)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert text == whole.choices[0].message.content
    assert [(t.token, round(t.logprob, 5)) for t in streamed] == [
        (t.token, round(t.logprob, 5)) for t in whole.choices[0].logprobs.content]


@pytest.mark.parametrize("fields", [dict(frequency_penalty=1.5, presence_penalty=0.5),
                                    dict(repetition_penalty=1.8), dict(bad_words=None)],
                         ids=["frequency+presence", "repetition", "bad_words"])
def test_penalties_change_the_answer_and_speculation_keeps_it(api, tokenizer, fields):
    answer = chat(api, user(PROMPT), max_tokens=24, logprobs=True, extra_body=PLAIN).choices[0]
    base = answer.message.content
    if "bad_words" in fields:  # two words the answer has, each one of its tokens (as encoded alone)
        fields = {"bad_words": [t.token for t in answer.logprobs.content if t.token.strip() == t.token
                                and len(tokenizer.encode(t.token, add_special_tokens=False)) == 1][:2]}
    plain = chat(api, user(PROMPT), max_tokens=24, extra_body={**PLAIN, **fields})
    spec = chat(api, user(PROMPT), max_tokens=24, extra_body=fields)
    assert spec.choices[0].message.content == plain.choices[0].message.content != base


def test_logit_bias_and_stop_token_ids_act_on_token_ids(api, tokenizer):
    forced = tokenizer.encode(" wave", add_special_tokens=False)[0]
    biased = chat(api, user(PROMPT), max_tokens=6, logit_bias={str(forced): 100})
    assert biased.choices[0].message.content == tokenizer.decode([forced]) * 6
    plain = chat(api, user(PROMPT), max_tokens=12, logprobs=True)
    ids = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(t.token))[0] for t in plain.choices[0].logprobs.content]
    cut = chat(api, user(PROMPT), max_tokens=12, extra_body={"stop_token_ids": [ids[4]]})
    first = ids.index(ids[4])
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == first


def test_sampled_choices_with_min_p_and_a_seed_are_reproducible(api):
    kw = dict(max_tokens=12, temperature=1.5, seed=5, n=3, extra_body={"min_p": 0.2})
    first, second = chat(api, user(PROMPT), **kw), chat(api, user(PROMPT), **kw)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in second.choices] and len(set(texts)) > 1
    alone = chat(api, user(PROMPT), **{**kw, "n": 1, "seed": 6})
    assert alone.choices[0].message.content == texts[1]  # choice i runs with seed + i
    lengths = [chat(api, user(PROMPT), **{**kw, "n": 1, "seed": 5 + i}).usage.completion_tokens for i in range(3)]
    assert first.usage.completion_tokens == sum(lengths)  # summed over the choices
    assert first.usage.prompt_tokens == alone.usage.prompt_tokens  # the prompt counted once


def test_streamed_choices_each_end_with_their_finish_reason(api):
    stream = chat(api, user(PROMPT), max_tokens=8, n=2, stream=True, temperature=1.0, seed=3,
                  stream_options={"include_usage": True})
    chunks = list(stream)
    texts, reasons = {0: "", 1: ""}, {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert set(reasons) == {0, 1} and all(texts.values())
    whole = chat(api, user(PROMPT), max_tokens=8, n=2, temperature=1.0, seed=3)
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_token_id_prompts_lists_of_prompts_and_echo_on_completions(api, tokenizer):
    text = "The sea is"
    ids = tokenizer(text)["input_ids"]  # with the tokenizer's own special tokens, as vLLM encodes
    by_text = completion(api, prompt=text, max_tokens=8)
    by_ids = completion(api, prompt=ids, max_tokens=8)
    assert by_ids.choices[0].text == by_text.choices[0].text
    both = completion(api, prompt=[text, "A wave"], max_tokens=8, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert both.choices[0].text == both.choices[1].text == by_text.choices[0].text  # greedy
    single = completion(api, prompt="A wave", max_tokens=8)
    assert both.usage.prompt_tokens == by_text.usage.prompt_tokens + single.usage.prompt_tokens
    echoed = completion(api, prompt=text, max_tokens=8, echo=True, logprobs=2)
    lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text == text + by_text.choices[0].text
    assert len(lp.tokens) == len(ids) + echoed.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and len(lp.top_logprobs[1]) >= 2
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


@pytest.mark.parametrize("kw, param", [
    (dict(top_logprobs=21, logprobs=True), "top_logprobs"), (dict(n=1000), "n"),
    (dict(logit_bias={str(i): 1 for i in range(100_000)}), "logit_bias"),
    (dict(extra_body={"stop_token_ids": [10 ** 7]}), None),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty")])
def test_out_of_range_values_get_a_400_and_the_next_request_works(api, kw, param):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(api, user(PROMPT), max_tokens=4, **kw)
    assert caught.value.status_code == 400
    if param:
        assert caught.value.body["param"] == param
    with pytest.raises(openai.BadRequestError):
        completion(api, prompt=[5, 10 ** 7], max_tokens=4)
    assert chat(api, user(PROMPT), max_tokens=4).choices[0].message.content


@pytest.mark.parametrize("model", ["spec_decode", "ensemble"])
def test_tritonclient_users_get_logprobs_from_spec_decode_and_the_ensemble(tiny, model):
    def run(k: int):
        inputs = []
        for name, array, dtype in (("text_input", np.array([[PROMPT.encode()]], dtype=np.object_), "BYTES"),
                                   ("max_tokens", np.array([[8]], np.int32), "INT32"),
                                   ("logprobs", np.array([[2]], np.int32), "INT32"),
                                   ("num_speculative_tokens", np.array([[k]], np.int32), "INT32")):
            t = grpcclient.InferInput(name, list(array.shape), dtype)
            t.set_data_from_numpy(array)
            inputs.append(t)
        with grpcclient.InferenceServerClient(tiny.grpc_url) as client:
            got = []
            client.start_stream(callback=lambda result, error: got.append((result, error)))
            client.async_stream_infer(model, inputs, enable_empty_final_response=False)
            client.stop_stream()
        (result, error), = [g for g in got if g[0] is not None or g[1] is not None]
        assert error is None
        return [result.as_numpy(n) for n in ("output_ids", "output_log_probs", "top_logprob_ids", "top_logprobs")]
    ids, chosen, top_ids, top = run(3)
    _, plain, _, _ = run(0)
    assert chosen.shape == ids.shape == (1, 8) and top_ids.shape == top.shape == (1, 8, 2)
    np.testing.assert_allclose(chosen, plain, atol=1e-5)
    assert (top_ids[0, :, 0] == ids[0]).all()  # greedy: the most likely token
    np.testing.assert_allclose(top[0, :, 0], chosen[0], atol=1e-6)


# What vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json) reads
VLLM_DASHBOARD = ("vllm:e2e_request_latency_seconds_bucket", "vllm:prompt_tokens_total",
                  "vllm:generation_tokens_total", "vllm:time_per_output_token_seconds_bucket",
                  "vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:time_to_first_token_seconds_bucket", "vllm:gpu_cache_usage_perc",
                  "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
                  "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
                  "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
                  "vllm:request_max_num_generation_tokens_sum", "vllm:inter_token_latency_seconds_bucket",
                  "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total")


def test_every_metric_vllms_dashboard_reads_is_exported_with_a_model_name(api, tiny):
    from eagle_serve.client import metrics
    before = metrics(tiny.metrics_url)
    reply = chat(api, user(PROMPT), max_tokens=6, stream=False)
    after = metrics(tiny.metrics_url)
    for name in VLLM_DASHBOARD:
        assert any(k.startswith(name + "{") and "model_name=" in k for k in after), name

    def total(prefix):
        return sum(v for k, v in after.items() if k.startswith(prefix)) - sum(
            v for k, v in before.items() if k.startswith(prefix))
    assert total("vllm:request_generation_tokens_sum") == reply.usage.completion_tokens
    assert total("vllm:request_prompt_tokens_sum") == reply.usage.prompt_tokens
    assert total("vllm:request_decode_time_seconds_count") == 1
