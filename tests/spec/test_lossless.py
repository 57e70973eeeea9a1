"""Greedy speculative decoding is token-for-token the target's own greedy decoding."""
from __future__ import annotations

import pytest

from eagle_serve.core.requests import SamplingParams
from eagle_serve.testing import OracleDrafter, tiny_engine

MAX_TOKENS = 24


engine_for = tiny_engine


def greedy(k):
    return SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=k)


def test_plain_greedy_equals_hf_generate(tiny_target, prompts, hf_greedy):
    engine = engine_for(tiny_target)
    results = engine.generate(prompts, greedy(0))
    assert [r.token_ids for r in results] == [hf_greedy(p, MAX_TOKENS) for p in prompts]
    assert all(r.finish_reason == "length" for r in results)


@pytest.mark.parametrize("head_name", ["eagle1_head", "eagle3_head"])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_speculative_greedy_equals_hf_generate(request, tiny_target, prompts, hf_greedy, head_name, k):
    engine = engine_for(tiny_target, request.getfixturevalue(head_name))
    results = engine.generate(prompts, greedy(k))
    assert [r.token_ids for r in results] == [hf_greedy(p, MAX_TOKENS) for p in prompts]
    assert engine.stats.draft_tokens > 0
    assert engine.idle_counts() == {"target_pages_free": 256, "drafter_pages_free": 256,
                                    "draft_slots_free": 128}


@pytest.mark.parametrize("max_running", [1, 3, 8])
def test_batch_size_does_not_change_greedy_output(tiny_target, eagle3_head, prompts, hf_greedy,
                                                  max_running):
    engine = engine_for(tiny_target, eagle3_head, max_running=max_running)
    params = [greedy(k) for k in (0, 3, 1, 4, 2, 0, 7, 5)]  # mixed k in one batch
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == [hf_greedy(p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_oracle_drafts_are_mostly_accepted_and_output_stays_exact(tiny_target, prompts, hf_greedy, k):
    expected = [hf_greedy(p, MAX_TOKENS) for p in prompts]
    engine = engine_for(tiny_target)
    oracle = OracleDrafter([p + e for p, e in zip(prompts, expected)], engine.target.vocab_size)
    engine.drafter = oracle
    results = engine.generate(prompts, greedy(k))
    assert [r.token_ids for r in results] == expected
    s = engine.stats
    assert s.accepted_tokens / s.draft_tokens >= 0.5
    assert max(r.acceptance_length for r in results) > 1.5  # multi-token rounds really ran
    assert engine.idle_counts()["target_pages_free"] == 256


@pytest.fixture(scope="module")
def bf16_plain(tiny_target, prompts) -> list[list[int]]:
    """bf16 plain decoding, one request at a time."""
    engine = tiny_engine(tiny_target, None, dtype="bfloat16", max_running=1)
    params = SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=0)
    return [r.token_ids for r in engine.generate(prompts, params)]


@pytest.mark.parametrize("shape", [dict(num_speculative_tokens=2), dict(num_speculative_tokens=5),
                                   dict(num_speculative_tokens=6, draft_topk=2, draft_depth=3)])
@pytest.mark.parametrize("max_running", [1, 3])
def test_bf16_verify_passes_reproduce_one_token_decoding_bitwise(tiny_target, eagle3_head, prompts,
                                                                 bf16_plain, shape, max_running):
    """bf16 CPU linears (padded single rows) and attention (one query at a time) are
    row-invariant, so bf16 speculative decoding is exactly bf16 plain decoding (one request at a
    time), in any batch, for chains and trees."""
    plain = bf16_plain
    engine = tiny_engine(tiny_target, eagle3_head, dtype="bfloat16", max_running=max_running)
    spec = [r.token_ids for r in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, **shape))]
    assert spec == plain
    oracle_engine = tiny_engine(tiny_target, None, dtype="bfloat16", max_running=max_running)
    oracle_engine.drafter = OracleDrafter([p + e for p, e in zip(prompts, plain)], oracle_engine.target.vocab_size)
    results = oracle_engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, **shape))
    assert [r.token_ids for r in results] == plain
    assert max(r.acceptance_length for r in results) > 1.5  # multi-token verify passes ran
