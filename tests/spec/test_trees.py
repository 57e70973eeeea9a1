"""EAGLE-2 dynamic draft trees: greedy output stays the target's own, the accepted path's KV
moves into place, the drafter's tree attention is exact, sampled requests fall back to chains."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from eagle_serve.core.interfaces import DraftShapes, RaggedBatch, RowSampling
from eagle_serve.core.kv_pages import PagePool
from eagle_serve.core.requests import SamplingParams
from eagle_serve.kernels.sampling import compute_probs_ref
from eagle_serve.models.checkpoints import load_drafter
from eagle_serve.testing import ALPHA, TreeOracleDrafter, chi2_pvalue, make_random_head, make_tiny_llama, tiny_engine

MAX_TOKENS = 24
SHAPES = [(2, 3, 4), (4, 4, 8), (3, 2, 6)]  # (draft_topk, draft_depth, k = nodes verified)


engine_for = tiny_engine


def tree(topk, depth, k, max_tokens=MAX_TOKENS):
    return SamplingParams(max_tokens=max_tokens, num_speculative_tokens=k, draft_topk=topk,
                          draft_depth=depth)


def record_tree_calls(engine) -> list[dict]:
    """Wrap the drafter's propose: -> the tree shapes of each call ({} when all rows draft
    chains)."""
    calls, propose = [], engine.drafter.propose

    def wrapped(batch, features, shapes, sampling):
        trees = bool((shapes.topk > 1).any())
        calls.append({"topk": shapes.topk.tolist(), "depth": shapes.depth.tolist()} if trees else {})
        return propose(batch, features, shapes, sampling)
    engine.drafter.propose = wrapped
    return calls


@pytest.mark.parametrize("head_name", ["eagle1_head", "eagle3_head"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "topk=%d-depth=%d-k=%d" % s)
def test_tree_greedy_of_one_request_equals_hf_generate(request, tiny_target, prompts, hf_greedy,
                                                       head_name, shape):
    engine = engine_for(tiny_target, request.getfixturevalue(head_name))
    calls = record_tree_calls(engine)
    result = engine.generate([prompts[1]], tree(*shape))
    assert result[0].token_ids == hf_greedy(prompts[1], MAX_TOKENS)
    assert any(calls) and all(c["topk"] == [shape[0]] for c in calls if c)  # trees drafted
    assert engine.stats.draft_tokens > 0
    assert engine.idle_counts() == {"target_pages_free": 256, "drafter_pages_free": 256,
                                    "draft_slots_free": 128}


@pytest.mark.parametrize("head_name", ["eagle1_head", "eagle3_head"])
def test_a_batch_of_mixed_chains_and_trees_of_mixed_lengths_equals_hf_generate(
        request, tiny_target, prompts, hf_greedy, head_name):
    engine = engine_for(tiny_target, request.getfixturevalue(head_name), max_running=4)
    params = [tree(1, None, 3), tree(*SHAPES[0]), tree(*SHAPES[1]), tree(*SHAPES[2]),
              SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=0),
              tree(2, 1, 2), tree(4, 2, 5, max_tokens=9), tree(3, 3, 7, max_tokens=13)]
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == [hf_greedy(p, sp.max_tokens)
                                              for p, sp in zip(prompts, params)]
    assert engine.idle_counts()["target_pages_free"] == 256


def oracle_engine(tiny_target, prompts, hf_greedy, **overrides):
    expected = [hf_greedy(p, MAX_TOKENS) for p in prompts]
    engine = engine_for(tiny_target, **overrides)
    engine.drafter = TreeOracleDrafter([p + e for p, e in zip(prompts, expected)],
                                       engine.target.vocab_size)
    return engine, expected


def test_trees_accepted_off_their_first_path_move_kv_and_stay_exact(tiny_target, prompts, hf_greedy):
    engine, expected = oracle_engine(tiny_target, prompts, hf_greedy)
    params = [tree(3, 4, 8), tree(1, None, 4), tree(2, 3, 6), tree(4, 2, 8)] * 2
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == expected
    s = engine.stats
    assert s.kv_moves > 0  # the true branch is never the first: accepted paths moved
    assert max(r.acceptance_length for r in results) > 1.5
    # per-position counters count along the accepted path, by depth
    assert s.accepted_per_position[0] >= s.accepted_per_position[1] > 0
    assert sum(s.accepted_per_position) == s.accepted_tokens
    assert engine.idle_counts()["target_pages_free"] == 256


def test_without_the_kv_moves_the_output_would_differ(tiny_target, prompts, hf_greedy):
    """The move is what keeps the output exact (this guards the test above)."""
    engine, expected = oracle_engine(tiny_target, prompts[:2], hf_greedy)
    engine.target.cache.move = lambda src, dst: None
    with pytest.raises(AssertionError, match="oracle does not know"):
        engine.generate(prompts[:2], [tree(3, 4, 8)] * 2)


def test_preemption_with_pending_kv_moves_recomputes_and_stays_exact(tiny_target, prompts,
                                                                      hf_greedy):
    engine, expected = oracle_engine(tiny_target, prompts, hf_greedy, page_size=8,
                                     num_target_pages=12, num_drafter_pages=12)
    params = [tree(3, 4, 8), tree(1, None, 3), tree(2, 3, 6), tree(4, 2, 8)] * 2
    results = engine.generate(prompts, params)
    assert engine.stats.preemptions > 0 and engine.stats.kv_moves > 0
    assert [r.token_ids for r in results] == expected
    assert engine.idle_counts() == {"target_pages_free": 12, "drafter_pages_free": 12,
                                    "draft_slots_free": 128}


@pytest.mark.parametrize("params, message", [
    (SamplingParams(draft_topk=0), "draft_topk must be in \\[1, 8\\]"),
    (SamplingParams(draft_topk=9), "draft_topk"),
    (SamplingParams(draft_depth=0), "draft_depth must be in \\[1, 8\\]"),
    (SamplingParams(draft_depth=99), "draft_depth"),
])
def test_bad_tree_shapes_are_refused_with_a_clear_message(tiny_target, eagle3_head, params, message):
    engine = engine_for(tiny_target, eagle3_head)
    with pytest.raises(ValueError, match=message):
        engine.add_request([5, 6, 7], params)


def test_the_engine_default_tree_shape_applies_to_requests_that_do_not_ask(tiny_target, eagle1_head,
                                                                          prompts, hf_greedy):
    engine = engine_for(tiny_target, eagle1_head, draft_topk=3, draft_depth=2,
                        num_speculative_tokens=5)
    calls = record_tree_calls(engine)
    result = engine.generate([prompts[2]], SamplingParams(max_tokens=12))
    assert result[0].token_ids == hf_greedy(prompts[2], 12)
    assert calls[0] == {"topk": [3], "depth": [2]}
    with pytest.raises(ValueError, match="draft_topk"):
        engine_for(tiny_target, eagle1_head, draft_topk=20)


def test_with_max_tree_batch_a_full_round_drafts_chains_of_the_tree_depth_and_a_lone_request_a_tree(
        tiny_target, eagle3_head, prompts, hf_greedy):
    engine = engine_for(tiny_target, eagle3_head, max_running=4, max_tree_batch=1)
    calls = record_tree_calls(engine)
    params = [tree(4, 1, 4, max_tokens=6), tree(4, 1, 4, max_tokens=20)]
    results = engine.generate(prompts[:2], params)
    assert [r.token_ids for r in results] == [hf_greedy(p, sp.max_tokens) for p, sp in zip(prompts, params)]
    assert calls[0] == {} and not any(len(c.get("topk", [])) == 2 for c in calls)  # two: chains
    assert {"topk": [4], "depth": [1]} in calls  # the long one alone: its tree
    with pytest.raises(ValueError, match="max_tree_batch"):
        engine_for(tiny_target, eagle3_head, max_tree_batch=-1)


# ---- the drafter's tree against a brute-force recomputation of every path ----

@pytest.mark.parametrize("head_name", ["eagle1_head", "eagle3_head"])
@torch.inference_mode()
def test_tree_attention_in_the_drafter_equals_recomputing_each_path_as_a_chain(
        request, tiny_target, prompts, head_name):
    from eagle_serve.models.target import TargetModel
    head_dir = request.getfixturevalue(head_name)
    drafter = load_drafter(head_dir, tiny_target, dtype=torch.float64, num_pages=32, page_size=4)
    target = TargetModel(tiny_target, dtype=torch.float64, num_pages=32, page_size=4,
                         feature_layers=drafter.feature_layers)
    seqs = [prompts[1][:19], prompts[4][:11]]  # two requests: trees batched together
    pool, tables = PagePool(32, 4), [[], []]
    for t, s in zip(tables, seqs):  # prefix + scratch for topk * (depth - 1) expanded nodes
        pool.grow(t, len(s) + 3 * 3)
    batch = catch_up_batch(seqs, tables, pool)
    _, feats = target.hidden_states(prefill_batch(seqs, tables, pool))
    features = torch.cat([feats[:len(seqs[0]) - 1], feats[len(seqs[0]):len(seqs[0]) + len(seqs[1]) - 1]])
    greedy = RowSampling(torch.zeros(2), torch.zeros(2, dtype=torch.int64), torch.ones(2),
                         torch.zeros(2, dtype=torch.int64))
    topk, depth, nodes = [3, 2], [4, 3], [10, 6]
    zeros = torch.zeros(2)
    out = drafter.propose(batch, features, DraftShapes(torch.tensor(nodes), torch.tensor(topk),
                                                       torch.tensor(depth), zeros, zeros), greedy)
    for b in range(2):
        parents, scores = out.parents[b, :nodes[b]].tolist(), out.scores[b, :nodes[b]].tolist()
        assert all(p < i for i, p in enumerate(parents))  # parents before children
        for node in [-1] + list(range(nodes[b])):  # depth first, the best child first: the
            kids = [scores[i] for i, p in enumerate(parents) if p == node]  # drafter's own
            assert kids == sorted(kids, reverse=True)                       # greedy path leads
            assert not kids or parents[node + 1] == node
        brute = path_log_probs(drafter, batch, features, b, out.tokens[b, :nodes[b]].tolist(),
                               parents)
        assert torch.allclose(out.scores[b, :nodes[b]], brute, atol=1e-9, rtol=0)
        best_rest = brute_force_best(drafter, batch, features, b, topk[b], depth[b])
        assert sorted(brute.tolist(), reverse=True) == pytest.approx(best_rest[:nodes[b]], abs=1e-9)


def prefill_batch(seqs, tables, pool) -> RaggedBatch:
    return ragged([s for s in seqs], [list(range(len(s))) for s in seqs], tables, pool)


def catch_up_batch(seqs, tables, pool) -> RaggedBatch:
    """Rows (f_p, x_{p+1}) for p = 0 .. len - 2: the drafter's catch-up on the whole prefix."""
    return ragged([s[1:] for s in seqs], [list(range(len(s) - 1)) for s in seqs], tables, pool)


def ragged(ids, positions, tables, pool) -> RaggedBatch:
    cu = [0]
    for i in ids:
        cu.append(cu[-1] + len(i))
    width = max(len(t) for t in tables)
    return RaggedBatch(
        input_ids=torch.tensor([x for i in ids for x in i]),
        positions=torch.tensor([p for ps in positions for p in ps]),
        cu_seqlens=torch.tensor(cu), seq_lens=torch.tensor([len(p) for p in positions]),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor([pool.slot(t, p) for t, ps in zip(tables, positions) for p in ps]))


def chain_features(drafter, batch, features, b, path_tokens) -> list[torch.Tensor]:
    """Request b alone: catch up, then feed `path_tokens` one by one as a chain (causal, no
    tree) -> the output feature after the prefix and after each path token."""
    cu = batch.cu_seqlens.tolist()
    one = RaggedBatch(batch.input_ids[cu[b]:cu[b + 1]], batch.positions[cu[b]:cu[b + 1]],
                      torch.tensor([0, cu[b + 1] - cu[b]]), batch.seq_lens[b:b + 1],
                      batch.block_tables[b:b + 1], batch.slot_mapping[cu[b]:cu[b + 1]])
    emb = torch.nn.functional.embedding(one.input_ids, drafter.embed_tokens)
    outs = [drafter.head.step(emb, features[cu[b]:cu[b + 1]], True, one, drafter.cache)[-1:]]
    end = int(one.seq_lens[0])
    for d, token in enumerate(path_tokens):  # depth d + 1 at position end + d, as drafting
        step = drafter._single_token_batch(one, torch.tensor([0]), torch.tensor([token]),
                                           torch.tensor([end + d]))
        emb = torch.nn.functional.embedding(step.input_ids, drafter.embed_tokens)
        outs.append(drafter.head.step(emb, outs[-1], False, step, drafter.cache))
    return outs


def log_probs(drafter, feature) -> torch.Tensor:
    """[V_target] log q over target ids (-inf outside the draft vocabulary)."""
    logp = torch.log_softmax(drafter.logits(feature).double(), dim=-1)[0]
    full = torch.full((drafter.vocab_size,), float("-inf"), dtype=torch.float64)
    ids = drafter.to_target_ids(torch.arange(logp.shape[0]))
    full[ids] = logp
    return full


def path_log_probs(drafter, batch, features, b, tokens, parents) -> torch.Tensor:
    """Cumulative log q of each node, every path recomputed from scratch as a chain."""
    scores = []
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.insert(0, tokens[j])
            j = parents[j]
        feats = chain_features(drafter, batch, features, b, path[:-1])
        scores.append(sum(float(log_probs(drafter, f)[t]) for f, t in zip(feats, path)))
    return torch.tensor(scores, dtype=torch.float64)


def brute_force_best(drafter, batch, features, b, topk, depth) -> list[float]:
    """EAGLE-2's candidate set by brute force (every expansion its own chain): the scores of
    all candidates, best first."""
    frontier, candidates = [((), 0.0)], []
    for _ in range(depth):
        children = []
        for path, score in frontier:
            logp = log_probs(drafter, chain_features(drafter, batch, features, b, list(path))[-1])
            values, ids = logp.topk(topk)
            children += [(path + (int(t),), score + float(v)) for v, t in zip(values, ids)]
        candidates += children
        frontier = sorted(children, key=lambda c: -c[1])[:topk]
    return sorted((s for _, s in candidates), reverse=True)


# ---- sampled requests stay exactly lossless (they draft chains) ----

def test_a_sampled_request_asking_for_a_tree_drafts_a_chain_and_follows_the_target_distribution(
        tmp_path):
    """A 6-token vocabulary so that draft and target overlap (drafts are often accepted):
    the first three tokens of n seeded requests against the target's exact joint law."""
    target_dir = make_tiny_llama(tmp_path / "t6", vocab_size=6, seed=3)
    head_dir = make_random_head(tmp_path / "h6", target_dir, 1, seed=4)
    temperature, top_k, n, prompt = 3.0, 3, 3000, [1, 4, 2, 5]
    engine = engine_for(target_dir, head_dir, max_running=64, max_waiting=n, num_draft_slots=512)
    calls = record_tree_calls(engine)
    params = [SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, seed=i,
                             num_speculative_tokens=2, draft_topk=4, draft_depth=2)
              for i in range(n)]
    results = engine.generate([prompt] * n, params)
    assert calls and not any(calls)  # no tree arguments: chains only
    s = engine.stats
    assert s.accepted_tokens > 0.2 * s.draft_tokens > 0  # acceptance and rejection both ran
    assert s.accepted_tokens < s.draft_tokens
    counts = torch.zeros(6 ** 3)
    for r in results:
        a, b, c = r.token_ids
        counts[(a * 6 + b) * 6 + c] += 1
    joint = exact_joint(target_dir, prompt, temperature, top_k)
    assert chi2_pvalue(counts, joint) > ALPHA  # nothing outside its support


def exact_joint(target_dir, prompt, temperature, top_k) -> torch.Tensor:
    """[6^3] P(t1, t2, t3) of the target with temperature and top-k."""
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float64).eval()
    seqs = [prompt + [a, b] for a in range(6) for b in range(6)]
    with torch.no_grad():
        logits = model(torch.tensor(seqs)).logits  # [36, L + 2, 6]

    def probs(rows):
        r = rows.shape[0]
        return compute_probs_ref(rows, torch.full((r,), temperature), torch.full((r,), top_k),
                                 torch.ones(r)).double()
    p1 = probs(logits[0:1, len(prompt) - 1])[0]                       # [6]
    p2 = probs(logits[::6, len(prompt)])                               # [6 (a), 6]
    p3 = probs(logits[:, len(prompt) + 1]).view(6, 6, 6)               # [a, b, 6]
    return (p1.view(6, 1, 1) * p2.view(6, 6, 1) * p3).flatten()


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "step", "step", "abort"]),
                              st.integers(0, 7), st.sampled_from(SHAPES + [(1, 2, 2)])),
                    min_size=1, max_size=25))
def test_any_mix_of_trees_finishing_cancelled_and_preempted_stays_exact_and_leaks_nothing(
        tiny_target, prompts, hf_greedy, ops):
    engine, expected = oracle_engine(tiny_target, prompts, hf_greedy, page_size=8,
                                     num_target_pages=10, num_drafter_pages=10,
                                     num_draft_slots=16, max_running=4)
    ids, which_of, aborted, outputs = [], {}, set(), {}

    def step():
        for out in engine.step():
            outputs[out.request_id] = outputs.get(out.request_id, []) + out.new_token_ids
    for op, which, shape in ops:
        if op == "add":
            ids.append(engine.add_request(prompts[which], tree(*shape, max_tokens=6 + which)))
            which_of[ids[-1]] = which
        elif op == "abort" and ids:
            aborted.add(ids[which % len(ids)])
            engine.abort(ids[which % len(ids)])
        else:
            step()
    while engine.has_work():
        step()
    for rid in ids:
        want = expected[which_of[rid]][:6 + which_of[rid]]
        got = outputs.get(rid, [])
        assert got == want or (rid in aborted and want[:len(got)] == got)
    assert engine.idle_counts() == {"target_pages_free": 10, "drafter_pages_free": 10,
                                    "draft_slots_free": 16}


# ---- confidence pruning ----

def record_drafts(engine) -> list[tuple[list[int], list[int], list[float] | None]]:
    """Wrap the drafter's propose: -> per request and call, (tokens, parents, path
    probabilities or None for a chain) of the drafts proposed."""
    drafts, propose = [], engine.drafter.propose

    def wrapped(*args, **kwargs):
        out = propose(*args, **kwargs)
        for b in range(out.tokens.shape[0]):
            tokens = out.tokens[b].tolist()
            n = tokens.index(-1) if -1 in tokens else len(tokens)
            parents = out.parents[b, :n].tolist() if out.parents is not None else list(range(-1, n - 1))
            probs = None
            if out.scores is not None and args[2].topk[b] > 1:  # propose(batch, features, shapes, ...)
                probs = out.scores[b, :n].exp().tolist()
            drafts.append((tokens[:n], parents, probs))
        return out
    engine.drafter.propose = wrapped
    return drafts


def depths(parents: list[int]) -> list[int]:
    out = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


@pytest.mark.parametrize("head_name", ["eagle1_head", "eagle3_head"])
def test_pruned_drafts_are_the_confident_ones_and_the_output_stays_the_targets(
        request, tiny_target, prompts, hf_greedy, head_name):
    """Limits from the unpruned drafts' own probabilities (medians), so both kept and pruned
    drafts occur: a tree keeps its first draft and those at or above min_prob, and drafts a
    level deeper only under a draft at or above expand_prob; chains stop early."""
    head = request.getfixturevalue(head_name)
    params = [tree(4, 3, 8), tree(1, 4, 4), tree(3, 2, 6, max_tokens=8), tree(4, 3, 8, max_tokens=6)]
    probe = engine_for(tiny_target, head, max_running=4, max_tree_batch=2)
    seen = record_drafts(probe)
    probe.generate(prompts[:4], params)
    later = sorted(p for _, _, probs in seen if probs for p in probs[1:])
    firsts = sorted(probs[0] for _, _, probs in seen if probs)
    min_prob, expand_prob = later[len(later) // 2], firsts[len(firsts) // 2]

    engine = engine_for(tiny_target, head, max_running=4, max_tree_batch=2, draft_min_prob=min_prob,
                        draft_expand_prob=expand_prob)
    drafts = record_drafts(engine)
    results = engine.generate(prompts[:4], params)
    assert [r.token_ids for r in results] == [hf_greedy(p, sp.max_tokens) for p, sp in zip(prompts, params)]
    trees = [(parents, probs) for _, parents, probs in drafts if probs is not None]
    chains = [tokens for tokens, _, probs in drafts if probs is None and tokens]
    assert trees and chains
    for parents, probs in trees:
        assert all(p >= min_prob for p in probs[1:])
        d = depths(parents)
        for level in range(2, max(d) + 1):  # a level only under a confident draft
            assert max(p for p, dd in zip(probs, d) if dd == level - 1) >= expand_prob
    assert any(len(probs) > 1 for _, probs in trees) and any(len(c) > 1 for c in chains)
    nodes = lambda recorded: sum(len(t) for t, _, _ in recorded)  # noqa: E731
    assert nodes(drafts) < nodes(seen) * 0.8  # pruned, though more rounds drafted
    assert engine.idle_counts() == {"target_pages_free": 256, "drafter_pages_free": 256,
                                    "draft_slots_free": 128}


@pytest.mark.parametrize("limits, most, deepest", [((1.0, 0.0), 1, 1), ((0.0, 1.0), 4, 1)],
                         ids=["min_prob=1: one draft", "expand_prob=1: one level"])
def test_pruning_at_certainty_drafts_one_draft_or_one_level(tiny_target, eagle3_head, prompts,
                                                            hf_greedy, limits, most, deepest):
    engine = engine_for(tiny_target, eagle3_head, max_running=2, draft_min_prob=limits[0],
                        draft_expand_prob=limits[1])
    drafts = record_drafts(engine)
    params = [tree(4, 3, 8), tree(1, 5, 5)]
    results = engine.generate(prompts[2:4], params)
    assert [r.token_ids for r in results] == [hf_greedy(p, MAX_TOKENS) for p in prompts[2:4]]
    assert drafts and max(len(t) for t, _, _ in drafts) == most
    assert max(max(depths(p), default=0) for _, p, _ in drafts) == deepest


def test_the_served_policy_drafts_sampled_requests_as_short_chains_unless_they_ask_otherwise():
    from eagle_serve.settings import EngineConfig
    from eagle_serve.spec.policy import DraftPolicy

    policy = DraftPolicy(EngineConfig.served())
    sampled = dict(temperature=0.7)
    assert policy.request_shape(SamplingParams(**sampled), 8) == (1, 2)
    assert policy.request_shape(SamplingParams(**sampled, draft_topk=4, draft_depth=4), 8) == (1, 4)
    assert policy.request_shape(SamplingParams(**sampled), 1) == (1, 1)
    assert policy.request_shape(SamplingParams(), 8) == (4, 3)
    assert policy.request_shape(SamplingParams(), 0) == (1, 0)


def test_coupled_sampled_requests_draft_a_two_wide_tree_unless_they_ask_otherwise():
    from eagle_serve.settings import EngineConfig
    from eagle_serve.spec.policy import DraftPolicy

    policy = DraftPolicy(EngineConfig.served())
    sampled = dict(temperature=0.7)
    assert policy.request_shape(SamplingParams(**sampled), 8, coupled=True) == (2, 2)
    assert policy.request_shape(SamplingParams(**sampled), 1, coupled=True) == (2, 1)
    assert policy.request_shape(SamplingParams(**sampled, draft_depth=3), 8, coupled=True) == (2, 3)
    assert policy.request_shape(SamplingParams(**sampled, draft_topk=1), 8, coupled=True) == (1, 3)
    assert policy.request_shape(SamplingParams(**sampled, draft_topk=3, draft_depth=2), 8,
                                coupled=True) == (3, 2)
    chains = DraftPolicy(EngineConfig.served(coupled_draft_topk=1))
    assert chains.request_shape(SamplingParams(**sampled), 8, coupled=True) == (1, 2)
    with pytest.raises(ValueError, match="coupled_draft_topk must be in"):
        EngineConfig.served(coupled_draft_topk=0).validate()
