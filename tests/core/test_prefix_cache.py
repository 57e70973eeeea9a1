"""Automatic prefix caching and chunked prefill: output with cache hits, evictions, preemption,
cancellation and prompts computed in chunks is exactly the output without them; pages are
shared, counted and given back; salts keep tenants apart."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle_serve import paths
from eagle_serve.core.kv_pages import PagePool
from eagle_serve.core.requests import SamplingParams
from eagle_serve.engine import Engine
from eagle_serve.local import build_local_engine
from eagle_serve.testing import TINY_VOCAB, tiny_engine

MAX_TOKENS = 12
PAGE = 16


@pytest.fixture(scope="module")
def shared_prompts():
    """Prompts that share a 40-token prefix (2 full pages and a half), then differ."""
    rng = random.Random(7)
    prefix = [rng.randrange(3, TINY_VOCAB) for _ in range(40)]
    return [prefix + [rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in (9, 3, 20, 1, 33, 14)]


def greedy(k: int, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_TOKENS, "num_speculative_tokens": k, **kw})


def one_by_one(engine, prompts, params):
    """Each prompt run alone, in turn: every one after the first can hit the cache."""
    return [engine.generate([p], params)[0] for p in prompts]


@pytest.mark.parametrize("shape", [dict(k=0), dict(k=3), dict(k=8, draft_topk=4, draft_depth=3)])
def test_greedy_output_with_cache_hits_equals_hf_generate(tiny_target, eagle3_head, shared_prompts,
                                                          hf_greedy, shape):
    engine = tiny_engine(tiny_target, eagle3_head)
    k = shape.pop("k")
    results = one_by_one(engine, shared_prompts, greedy(k, **shape))
    assert [r.token_ids for r in results] == [hf_greedy(p, MAX_TOKENS) for p in shared_prompts]
    cached = [r.last.num_cached_tokens for r in results]
    assert cached[0] == 0 and all(c == 2 * PAGE for c in cached[1:]), cached
    assert engine.stats.prefix_cache_hits == 2 * PAGE * (len(shared_prompts) - 1)
    assert engine.stats.prefix_cache_queries >= sum(map(len, shared_prompts))
    assert engine.idle_counts() == {"target_pages_free": 256, "drafter_pages_free": 256,
                                    "draft_slots_free": 128}


def test_a_hit_drafts_from_its_first_round_as_without_the_cache(tiny_target, eagle3_head, shared_prompts):
    """The drafter's pages are cached with the target's: the rounds, drafts and acceptances of
    a request that hit the cache are those of the same request on an engine without it."""
    params = greedy(3)
    with_cache = one_by_one(tiny_engine(tiny_target, eagle3_head), shared_prompts, params)
    without = one_by_one(tiny_engine(tiny_target, eagle3_head, enable_prefix_caching=False),
                         shared_prompts, params)
    for a, b in zip(with_cache, without):
        assert a.token_ids == b.token_ids
        assert (a.last.num_rounds, a.last.num_draft_tokens, a.last.num_accepted_tokens) == \
            (b.last.num_rounds, b.last.num_draft_tokens, b.last.num_accepted_tokens)
    assert all(r.last.num_cached_tokens == 0 for r in without)


@pytest.mark.parametrize("verify", ["rejection", "coupled"])
def test_seeded_sampled_output_is_the_same_with_and_without_the_cache(tiny_target, eagle3_head,
                                                                      shared_prompts, verify):
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=s, num_speculative_tokens=3)
              for s in range(len(shared_prompts))]
    outputs = []
    for caching in (True, False):
        engine = tiny_engine(tiny_target, eagle3_head, sampled_verify=verify, enable_prefix_caching=caching)
        outputs.append([engine.generate([p], sp)[0].token_ids for p, sp in zip(shared_prompts, params)])
    assert outputs[0] == outputs[1]


def test_hits_inside_a_batch_and_across_evictions_and_preemption_stay_exact(
        tiny_target, eagle3_head, shared_prompts, hf_greedy):
    """A pool of 24 pages: cached pages are evicted for new ones, and a batch of 6 preempts."""
    engine = tiny_engine(tiny_target, eagle3_head, num_target_pages=24, num_drafter_pages=24)
    rng = random.Random(3)
    others = [[rng.randrange(3, TINY_VOCAB) for _ in range(50)] for _ in range(3)]
    prompts = shared_prompts + others + shared_prompts[:3]
    params = [greedy(k) for k in (0, 3, 1, 4, 2, 0, 3, 1, 2, 4, 0, 3)]
    expected = [hf_greedy(p, MAX_TOKENS) for p in prompts]
    assert [r.token_ids for r in engine.generate(prompts, params)] == expected
    assert engine.stats.preemptions > 0
    assert [r.token_ids for r in one_by_one(engine, prompts, greedy(3))] == expected
    assert engine.stats.prefix_cache_hits > 0
    assert engine.idle_counts()["target_pages_free"] == 24
    assert engine.idle_counts()["drafter_pages_free"] == 24


def test_cancelling_a_request_keeps_the_pages_another_request_shares(tiny_target, eagle3_head,
                                                                     shared_prompts, hf_greedy):
    engine = tiny_engine(tiny_target, eagle3_head)
    engine.generate([shared_prompts[0]], greedy(3))  # its pages are cached now
    keep = engine.add_request(shared_prompts[1], greedy(3))
    drop = engine.add_request(shared_prompts[2], greedy(3))
    tokens = {keep: [], drop: []}
    for out in engine.step():
        tokens[out.request_id] += out.new_token_ids
    engine.abort(drop)
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert tokens[keep] == hf_greedy(shared_prompts[1], MAX_TOKENS)
    assert engine.idle_counts()["target_pages_free"] == 256


def test_salts_keep_caches_apart_and_the_setting_turns_caching_off(tiny_target, shared_prompts):
    engine = tiny_engine(tiny_target)
    prompt = shared_prompts[0]
    runs = [engine.generate([prompt], greedy(0, cache_salt=salt))[0] for salt in ("a", "b", "a", "")]
    assert [r.last.num_cached_tokens for r in runs] == [0, 0, 3 * PAGE, 0]
    assert len({tuple(r.token_ids) for r in runs}) == 1
    off = tiny_engine(tiny_target, enable_prefix_caching=False)
    assert [off.generate([prompt], greedy(0))[0].last.num_cached_tokens for _ in range(2)] == [0, 0]
    assert off.target_pool.num_cached == 0
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request(prompt, greedy(0, cache_salt="x" * 300))


@pytest.mark.parametrize("budget", [1, 7, 40])
def test_chunked_prefill_gives_the_output_of_whole_prompts(tiny_target, eagle3_head, shared_prompts,
                                                           hf_greedy, budget):
    engine = tiny_engine(tiny_target, eagle3_head, max_num_batched_tokens=budget, enable_prefix_caching=False)
    params = [greedy(k) for k in (0, 3, 1, 4, 2, 8)]
    results = engine.generate(shared_prompts, params)
    assert [r.token_ids for r in results] == [hf_greedy(p, MAX_TOKENS) for p in shared_prompts]
    assert engine.idle_counts()["target_pages_free"] == 256


def test_a_long_prompt_is_computed_over_several_rounds_while_others_decode(tiny_target, eagle3_head,
                                                                          hf_greedy):
    rng = random.Random(11)
    long_prompt, short_prompt = [rng.randrange(3, TINY_VOCAB) for _ in range(120)], [5, 6, 7]
    engine = tiny_engine(tiny_target, eagle3_head, max_num_batched_tokens=16, enable_prefix_caching=False)
    short = engine.add_request(short_prompt, greedy(0, max_tokens=20))
    first = engine.step()  # the short request is decoding
    long = engine.add_request(long_prompt, greedy(3))
    tokens, rounds_before_long, short_meanwhile = {short: first[0].new_token_ids, long: []}, 0, 0
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if not tokens[long]:
            rounds_before_long += 1
            short_meanwhile = len(tokens[short])
    assert rounds_before_long >= 120 // 16 - 1  # the prompt took ~8 rounds of 16 rows,
    assert short_meanwhile >= 120 // 16 - 1     # and the short stream went on meanwhile
    assert tokens[short] == hf_greedy(short_prompt, 20) and tokens[long] == hf_greedy(long_prompt, MAX_TOKENS)


# ---- the default model: the CPU kernels are row-invariant, so shared pages are bitwise ----

@pytest.fixture(scope="module")
def default_engine_kv():
    """-> kv_after(prompt, **overrides): every layer's K/V in the first 4 pages after an engine
    of its own prefilled `prompt`, on the default target loaded once here: its cache zeroed,
    as a new one is, and a fresh pool, which hands out pages 0, 1, 2, ... in order."""
    loaded = build_local_engine(paths.default_target_dir(), None, dtype="float32",
                                num_target_pages=16, enable_prefix_caching=False)
    cache = loaded.target.cache

    def kv_after(prompt: list[int], **overrides) -> list[torch.Tensor]:
        for tensor in cache.keys + cache.values:
            tensor.zero_()
        engine = Engine(loaded.target, None, loaded.config.with_values(**overrides), loaded.tokenizer)
        engine.generate([prompt], SamplingParams(max_tokens=1, num_speculative_tokens=0))
        return [torch.stack([k[:4], v[:4]]) for k, v in zip(cache.keys, cache.values)]
    return kv_after


@pytest.mark.slow
def test_a_page_computed_in_a_long_prefill_equals_it_computed_alone_bitwise(default_engine_kv):
    rng = random.Random(5)
    prompt = [rng.randrange(3, 49152) for _ in range(64)]
    alone = default_engine_kv(prompt[:2 * PAGE + 1])
    inside = default_engine_kv(prompt)
    for a, b in zip(alone, inside):
        assert torch.equal(a[:, :2], b[:, :2])  # the 2 full pages


@pytest.mark.slow
def test_a_prompt_computed_in_chunks_gives_bitwise_the_kv_of_one_prefill(default_engine_kv):
    rng = random.Random(6)
    prompt = [rng.randrange(3, 49152) for _ in range(4 * PAGE)]
    whole = default_engine_kv(prompt, max_num_batched_tokens=0)
    chunked = default_engine_kv(prompt, max_num_batched_tokens=11)
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)


# ---- the pool's bookkeeping under random request streams ----

@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(1, 70)), min_size=1, max_size=60))
def test_pages_are_never_freed_while_mapped_and_none_leak(ops):
    """ops: (kind, table, tokens). Tables grow, map the cached pages of a shared 'prefix',
    name their pages, shrink and release in random order; afterwards every page is free."""
    pool = PagePool(12, 4)
    tables: list[list[int]] = [[] for _ in range(4)]
    keys = [bytes([i]) * 4 for i in range(20)]  # page i of the one shared prefix
    for kind, t, n in ops:
        table = tables[t]
        if kind == 0:
            pool.grow(table, len(table) * 4 + n)
        elif kind == 1 and not table:
            pool.map(table, pool.cached(keys[:n // 4]))
        elif kind == 2 and table:
            pool.name_page(table[-1], keys[len(table) - 1])
        elif kind == 3:
            pool.shrink(table, n)
        elif kind == 4:
            pool.release(table)
        mapped = [p for tb in tables for p in tb]
        for page in set(mapped):
            assert pool._refs[page] == mapped.count(page)
            assert page not in pool._free and page not in pool._idle
        assert len(set(mapped)) + pool.num_free == pool.num_pages
        for key, page in pool._page_of.items():
            assert pool._key_of[page] == key
    for table in tables:
        pool.release(table)
    assert pool.num_free == pool.num_pages and sorted(pool._free + list(pool._idle)) == list(range(12))


@pytest.mark.parametrize("first_k", [0, 3])
def test_a_speculative_hit_on_pages_the_drafter_never_saw_catches_up_from_their_features(
        tiny_target, eagle3_head, shared_prompts, first_k):
    """The first request runs plain (the drafter sees nothing) or drafts: either way the second
    maps the whole cached prefix and drafts exactly as without the cache."""
    runs = []
    for caching in (True, False):
        engine = tiny_engine(tiny_target, eagle3_head, enable_prefix_caching=caching)
        engine.generate([shared_prompts[0]], greedy(first_k))
        runs.append(engine.generate([shared_prompts[1]], greedy(3))[0])
    hit, cold = runs
    assert hit.last.num_cached_tokens == 2 * PAGE and cold.last.num_cached_tokens == 0
    assert hit.token_ids == cold.token_ids
    assert (hit.last.num_rounds, hit.last.num_draft_tokens, hit.last.num_accepted_tokens) == \
        (cold.last.num_rounds, cold.last.num_draft_tokens, cold.last.num_accepted_tokens)


def test_page_names_depend_on_the_whole_prefix_and_the_salt_only():
    from eagle_serve.core.prefix_cache import PrefixCache
    from eagle_serve.core.requests import Request
    from eagle_serve.spec.verify import EngineStats

    cache = PrefixCache(PagePool(8, 4), PagePool(8, 4), EngineStats())

    def names(tokens, salt=""):
        req = Request("r", len(tokens), SamplingParams(cache_salt=salt), 0, 0, None, list(tokens))
        return cache.keys(req, len(tokens) // 4)

    base = names(range(12))
    assert names(range(12)) == base and len(set(base)) == 3
    assert names([*range(8), 9, 9, 9, 9])[:2] == base[:2] != names([*range(8), 9, 9, 9, 9])[2:]
    changed_first = names([99, *range(1, 12)])
    assert all(a != b for a, b in zip(changed_first, base))  # a change reaches every later page
    assert all(a != b for a, b in zip(names(range(12), "tenant"), base))


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 30), st.sampled_from([0, 2, 4]),
                          st.booleans()), min_size=1, max_size=8))
def test_random_request_streams_give_plain_output_and_leak_no_page(tiny_target, eagle3_head, hf_greedy,
                                                                    stream):
    """stream: (prefix choice, suffix length, k, aborted) per request, sent in two waves over a
    20-page pool: shared prefixes hit, pages are evicted and requests preempted or cancelled;
    every request that finishes gives plain greedy decoding's tokens, and every page comes back."""
    rng = random.Random(len(stream))
    prefixes = [[rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in (0, 16, 20, 33, 40, 47)]
    engine = tiny_engine(tiny_target, eagle3_head, num_target_pages=20, num_drafter_pages=20,
                         max_num_batched_tokens=24)
    for wave in (stream[::2], stream[1::2]):
        ids = {}
        for choice, n, k, aborted in wave:
            prompt = prefixes[choice] + [rng.randrange(3, TINY_VOCAB) for _ in range(n)]
            ids[engine.add_request(prompt, greedy(k, max_tokens=8))] = (prompt, aborted)
        tokens = {i: [] for i in ids}
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        for i, (_, aborted) in ids.items():
            if aborted:
                engine.abort(i)
        while engine.has_work():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        for i, (prompt, aborted) in ids.items():
            if not aborted:
                assert tokens[i] == hf_greedy(prompt, 8)
    assert engine.idle_counts() == {"target_pages_free": 20, "drafter_pages_free": 20,
                                    "draft_slots_free": 128}


def test_pages_past_a_stop_string_cut_are_not_named():
    """A stop string cuts tokens whose KV was computed: pages are named only below the tokens
    the request keeps (a name over fewer tokens would serve another prompt wrong KV)."""
    from eagle_serve.core.prefix_cache import PrefixCache
    from eagle_serve.core.requests import Request
    from eagle_serve.spec.verify import EngineStats

    target, drafter = PagePool(8, 4), PagePool(8, 4)
    cache = PrefixCache(target, drafter, EngineStats())
    req = Request("r", 6, SamplingParams(), 2, 0, None, list(range(3, 17)))  # 14 tokens
    assert target.grow(req.target_pages, 16) and drafter.grow(req.drafter_pages, 16)
    req.num_computed = req.draft_computed = 16
    del req.tokens[9:]  # the cut: 9 tokens kept, KV computed for 16
    cache.publish(req)
    assert req.published_target == 2 and req.published_drafter == 2  # positions 0-7 only
    assert target.num_cached == 2 and drafter.num_cached == 2
