"""End to end through the real tritonserver: ensemble -> spec_decode -> eagle_target/drafter.

Exact-equality checks run a tiny random Llama in float64 (with the real tokenizer) behind
synthetic heads in the published EAGLE-1 / EAGLE-3 layouts; the fp32 SmolLM2 runs are smoke
tests.
"""
from __future__ import annotations

import concurrent.futures as futures
import time

import pytest
from triton_pool import default_server, tiny_server  # tiny_models: a conftest.py fixture

from eagle_serve.client import grpc_generate, http_generate, http_generate_stream, metrics
from eagle_serve.core.requests import SamplingParams
from eagle_serve.core.tokenization import encode_prompt
from eagle_serve.local import build_local_engine
from eagle_serve.settings import ServingSettings
from eagle_serve.spec.lookup import SOURCES

pytestmark = pytest.mark.server

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers.", "Explain speculative decoding in one sentence, please.",
           "Hi", "Name a color.", "Tell me a very short story about a robot who learns to paint.",
           "2+2="]


@pytest.fixture(scope="session")
def local_expected(tiny_models):
    """The in-process engine's greedy output for the same prompts (the reference)."""
    engine = build_local_engine(tiny_models["target"], None, dtype="float64", num_target_pages=256)
    cache = {}

    def expected(prompt: str, max_tokens: int) -> list[int]:
        if (prompt, max_tokens) not in cache:
            ids = encode_prompt(engine.tokenizer, prompt)
            out = engine.generate([ids], SamplingParams(max_tokens=max_tokens, num_speculative_tokens=0))
            cache[prompt, max_tokens] = out[0].token_ids
        return cache[prompt, max_tokens]
    return expected


def wait_for(predicate, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    return predicate()


def test_default_model_answers_over_grpc_stream_http_generate_and_generate_stream(triton_server):
    server = default_server(triton_server)
    streamed = grpc_generate(server.grpc_url, "What is the capital of France?", max_tokens=24,
                             stream=True, num_speculative_tokens=2)
    assert streamed.error is None and "Paris" in streamed.text
    assert streamed.num_responses > 2 and streamed.finish_reason == "stop"
    whole = http_generate(server.http_url, "What is the capital of France?", max_tokens=24)
    assert whole.error is None and whole.text == streamed.text
    assert whole.output_ids == streamed.output_ids
    sse = http_generate_stream(server.http_url, "What is the capital of France?", max_tokens=24,
                               stream=True, num_speculative_tokens=4)
    assert sse.error is None and sse.text == streamed.text and sse.num_responses > 2


def test_the_default_server_drafts_from_the_head_its_context_and_its_corpus_and_counts_each(
        triton_server):
    server = default_server(triton_server)
    prompt = "Write 'red, green, blue' four times, one per line."
    plain = grpc_generate(server.grpc_url, prompt, max_tokens=48, num_speculative_tokens=0)
    hybrid = grpc_generate(server.grpc_url, prompt, max_tokens=48)
    head_only = grpc_generate(server.grpc_url, prompt, max_tokens=48, context_lookup=False,
                              corpus_lookup=False)
    assert plain.error is None and hybrid.output_ids == head_only.output_ids == plain.output_ids

    def counted():
        m = metrics(server.metrics_url)
        by = {stat: {s: m.get(f'eagle_spec_decode_{stat}_by_source_total{{source="{s}"}}', 0)
                     for s in SOURCES} for stat in ("draft_tokens", "accepted_tokens")}
        return (sum(by["accepted_tokens"].values()) == m["eagle_spec_decode_accepted_tokens_total"]
                and sum(by["draft_tokens"].values()) == m["eagle_spec_decode_draft_tokens_total"]
                and all(by["draft_tokens"][s] > 0 for s in ("eagle", "context", "corpus"))
                and by["accepted_tokens"]["context"] + by["accepted_tokens"]["corpus"] > 0)
    assert wait_for(counted)
    # The counters above show lookup drafts accepted; on a short answer the two configs can tie
    # (2.0 and 2.0 in float32 on an AVX2 CPU, where the head drafts otherwise than in bf16).
    assert hybrid.acceptance_length >= head_only.acceptance_length


@pytest.mark.parametrize("head", ["eagle3", "eagle1"])
@pytest.mark.parametrize("k", [0, 3, 5])
def test_server_greedy_output_equals_the_in_process_engine(triton_server, tiny_models,
                                                           local_expected, head, k):
    server = tiny_server(triton_server, tiny_models, head)
    for prompt in PROMPTS[:3]:
        got = grpc_generate(server.grpc_url, prompt, max_tokens=20, stream=True,
                            num_speculative_tokens=k, ignore_eos=True)
        assert got.error is None
        assert got.output_ids == local_expected(prompt, 20)
        assert got.counters["num_output_tokens"] == 20
        if k:
            assert got.counters["num_draft_tokens"] > 0


def test_eight_concurrent_streams_match_their_solo_runs_and_are_batched(triton_server, tiny_models):
    server = tiny_server(triton_server, tiny_models, "eagle3")
    params = [dict(max_tokens=12 + 3 * i, num_speculative_tokens=i % 5, stream=True, ignore_eos=True,
                   **({"temperature": 0.8, "top_p": 0.9, "seed": 7 + i} if i % 3 == 2 else {}))
              for i in range(8)]
    solo = [grpc_generate(server.grpc_url, p, **kw) for p, kw in zip(PROMPTS, params)]
    before = metrics(server.metrics_url)
    with futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda a: grpc_generate(server.grpc_url, a[0], **a[1]),
                                 zip(PROMPTS, params)))
    after = metrics(server.metrics_url)
    for s, t in zip(solo, together):
        assert s.error is None and t.error is None
        assert t.output_ids == s.output_ids  # greedy and seeded sampling alike
    rounds = sum(t.counters["num_rounds"] for t in together)
    steps = after["eagle_engine_steps_total"] - before["eagle_engine_steps_total"]
    assert after["eagle_spec_decode_rounds_total"] - before["eagle_spec_decode_rounds_total"] == rounds
    assert steps < rounds  # several requests shared each batched round


def test_metrics_move_and_pages_and_slots_return_to_idle(triton_server, tiny_models):
    server = tiny_server(triton_server, tiny_models, "eagle3")
    got = grpc_generate(server.grpc_url, PROMPTS[1], max_tokens=16, num_speculative_tokens=4)
    assert got.error is None
    m = metrics(server.metrics_url)
    assert m["eagle_spec_decode_draft_tokens_total"] > 0
    assert m['eagle_spec_decode_accepted_tokens_per_position_total{position="1"}'] >= 0
    assert m["eagle_spec_decode_rounds_total"] >= got.counters["num_rounds"]
    assert 'eagle_time_to_first_token_seconds_count' in m and m['eagle_time_to_first_token_seconds_count'] > 0

    def idle():
        m = metrics(server.metrics_url)
        return (m['eagle_kv_pages_free{pool="target"}'] == m['eagle_kv_pages_total{pool="target"}'] == 256
                and m['eagle_kv_pages_free{pool="drafter"}'] == 256
                and m["eagle_draft_slots_free"] == 256 and m["eagle_requests_running"] == 0)
    assert wait_for(idle)


def test_a_bad_request_gets_a_clear_error_and_the_next_one_works(triton_server, tiny_models,
                                                                 local_expected):
    server = tiny_server(triton_server, tiny_models, "eagle3")
    bad = grpc_generate(server.grpc_url, PROMPTS[0], max_tokens=20, top_p=1.5)
    assert bad.error is not None and "top_p" in bad.error
    bad_http = http_generate(server.http_url, PROMPTS[0], max_tokens=20, num_speculative_tokens=99)
    assert bad_http.error is not None and "num_speculative_tokens" in bad_http.error
    good = grpc_generate(server.grpc_url, PROMPTS[0], max_tokens=20, ignore_eos=True)
    assert good.error is None and good.output_ids == local_expected(PROMPTS[0], 20)


def test_calling_spec_decode_directly_gives_the_ensembles_text(triton_server, tiny_models):
    server = tiny_server(triton_server, tiny_models, "eagle3")
    for stream in (True, False):
        via_ensemble = grpc_generate(server.grpc_url, PROMPTS[3], max_tokens=24, stream=stream)
        direct = grpc_generate(server.grpc_url, PROMPTS[3], model="spec_decode", max_tokens=24,
                               stream=stream)
        assert direct.error is None and via_ensemble.error is None
        assert direct.text == via_ensemble.text and direct.output_ids == via_ensemble.output_ids


def test_twenty_direct_streams_cancelled_at_random_points_leave_nothing_behind(triton_server, tiny_models):
    import random
    server = tiny_server(triton_server, tiny_models, "eagle3")
    rng = random.Random(20)

    def cancelled_stream(i):
        return grpc_generate(server.grpc_url, PROMPTS[i % 8], model="spec_decode", max_tokens=1500,
                             ignore_eos=True, stream=True, num_speculative_tokens=i % 4,
                             cancel_after_responses=rng.randint(1, 6))
    with futures.ThreadPoolExecutor(5) as pool:
        results = list(pool.map(cancelled_stream, range(20)))
    assert all(r.error is None and r.finish_reason == "cancelled-by-client" for r in results)

    def idle():
        m = metrics(server.metrics_url)
        return (m["eagle_requests_running"] == 0 and m["eagle_requests_waiting"] == 0
                and m['eagle_kv_pages_free{pool="target"}'] == 256
                and m['eagle_kv_pages_free{pool="drafter"}'] == 256 and m["eagle_draft_slots_free"] == 256)
    assert wait_for(idle, timeout_s=30)


@pytest.mark.parametrize("head", ["eagle3", "eagle1"])
def test_tree_requests_through_the_server_equal_plain_greedy(triton_server, tiny_models,
                                                            local_expected, head):
    """EAGLE-2 trees (draft_topk > 1) over the ensemble, alone and batched with chains; a bad
    shape is refused by name (which also shows the model processes run this checkout)."""
    server = tiny_server(triton_server, tiny_models, head)
    slots_free = metrics(server.metrics_url)["eagle_draft_slots_free"]  # all: no request runs
    shapes = [dict(draft_topk=2, draft_depth=3, num_speculative_tokens=4),
              dict(draft_topk=4, draft_depth=4, num_speculative_tokens=8),
              dict(draft_topk=3, draft_depth=2, num_speculative_tokens=6),
              dict(draft_topk=1, num_speculative_tokens=3), dict(num_speculative_tokens=0)]
    bad = grpc_generate(server.grpc_url, PROMPTS[0], max_tokens=8, draft_topk=99)
    assert bad.error is not None and "draft_topk must be in [1, 8]" in bad.error
    alone = grpc_generate(server.grpc_url, PROMPTS[0], max_tokens=20, ignore_eos=True,
                          stream=True, **shapes[1])
    assert alone.error is None and alone.output_ids == local_expected(PROMPTS[0], 20)
    assert alone.counters["num_draft_tokens"] > 0
    jobs = [(PROMPTS[i], 12 + 2 * i, shapes[i % len(shapes)]) for i in range(6)]
    with futures.ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda j: grpc_generate(server.grpc_url, j[0], max_tokens=j[1],
                                                         ignore_eos=True, stream=True, **j[2]),
                                 jobs))
    for (prompt, n, _), got in zip(jobs, together):
        assert got.error is None and got.output_ids == local_expected(prompt, n)
    http = http_generate(server.http_url, PROMPTS[2], max_tokens=16, ignore_eos=True, **shapes[2])
    assert http.error is None and http.output_ids == local_expected(PROMPTS[2], 16)

    def idle():  # every page and slot free again (behind eagle1 the cache is small: preemption)
        m = metrics(server.metrics_url)
        return (m['eagle_kv_pages_free{pool="target"}'] == m['eagle_kv_pages_total{pool="target"}']
                and m['eagle_kv_pages_free{pool="drafter"}'] == m['eagle_kv_pages_total{pool="drafter"}']
                and m["eagle_draft_slots_free"] == slots_free and m["eagle_requests_running"] == 0)
    assert wait_for(idle)


def test_a_coupled_server_gives_seeded_sampled_requests_plain_samplings_tokens(triton_server,
                                                                              tiny_models):
    """sampled_verify=coupled (the shipped default): seeded requests drafting chains
    (draft_topk 1) and the default coupled trees (coupled_draft_topk x sampled_draft_depth),
    alone and batched, give the tokens the same request gets with k = 0 (the drafter is told
    which rows are coupled over BLS, and sends no probabilities for them)."""
    assert ServingSettings().drafting.sampled_verify == "coupled"
    server = tiny_server(triton_server, tiny_models, "eagle3")
    shapes = [dict(num_speculative_tokens=3, draft_topk=1), dict(num_speculative_tokens=4)]
    jobs = [(PROMPTS[i], dict(max_tokens=14, temperature=0.9, top_p=0.95, seed=40 + i,
                              ignore_eos=True, stream=True)) for i in range(4)]
    plain = [grpc_generate(server.grpc_url, p, num_speculative_tokens=0, **kw) for p, kw in jobs]
    assert all(g.error is None for g in plain)
    with futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda j: grpc_generate(server.grpc_url, j[1][0], **j[1][1],
                                                         **shapes[j[0] % 2]), enumerate(jobs)))
    for p, got in zip(plain, together):
        assert got.error is None and got.output_ids == p.output_ids
        assert got.counters["num_draft_tokens"] > 0
