"""Lookup draft sources (eagle_serve.lookup) and draft trees that mix them with the head's."""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
from transformers import AutoTokenizer

from eagle_serve.draft_round import merge_branch
from eagle_serve.drafting import Branch
from eagle_serve.lookup import (CONTEXT, CORPUS, ContextIndex, CorpusIndex, CorpusRecord, Proposal,
                                check_corpus_tokenizer, load_corpus_index, lookup_accuracy,
                                tokenizer_fingerprint)
from eagle_serve.lookup_scores import MAX_PLACE, PRIOR_RATE, LookupKey, LookupScores
from eagle_serve.requests import SamplingParams
from eagle_serve.testing import tiny_engine

MAX_TOKENS = 40


def brute_force_context(tokens: list[int], limit: int, min_n=2, max_n=8) -> Proposal | None:
    """The longest suffix (max_n .. min_n) that occurred earlier with a follower; its latest
    such occurrence; what followed, continued periodically past the end (each token's strength:
    the suffix's length)."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        ends = [j for j in range(n, len(tokens)) if tokens[j - n:j] == tokens[-n:]]
        if ends:
            seq = list(tokens)
            start = max(ends)
            while len(seq) < start + limit:
                seq.append(seq[len(seq) - (len(tokens) - start)])
            return Proposal(seq[start:start + limit], CONTEXT, (n,) * limit)
    return None


def test_context_lookup_equals_a_brute_force_search_on_random_streams_grown_in_random_steps():
    rng = random.Random(7)
    for trial in range(60):
        vocab = rng.choice([2, 3, 5, 20])
        index, tokens = ContextIndex(), [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        while len(tokens) < 80:
            limit = rng.randrange(1, 7)
            assert index.propose(tokens, limit) == brute_force_context(tokens, limit), (trial, tokens)
            tokens += [rng.randrange(vocab) for _ in range(rng.randrange(1, 5))]


def test_a_repetition_loop_is_continued_past_the_end_of_the_stream():
    assert ContextIndex().propose([9, 1, 2, 1, 2, 1, 2], 5).tokens == [1, 2, 1, 2, 1]


def corpus_counts(sequences, n):
    counts: dict[tuple, Counter] = {}
    for prompt, answer in sequences:
        seq = prompt + answer
        for t in range(max(len(prompt), n), len(seq)):
            counts.setdefault(tuple(seq[t - n:t]), Counter())[seq[t]] += 1
    return counts


def test_the_corpus_table_holds_each_contexts_most_frequent_next_token_and_its_share():
    rng = random.Random(3)
    sequences = [([rng.randrange(6) for _ in range(rng.randrange(0, 4))],
                  [rng.randrange(6) for _ in range(rng.randrange(1, 30))]) for _ in range(200)]
    index = CorpusIndex.build(sequences, vocab_size=6, fingerprint="x", max_n=3, min_count=2)
    for n in (1, 2, 3):
        counts = corpus_counts(sequences, n)
        kept = {ctx: c for ctx, c in counts.items() if c.most_common(1)[0][1] >= 2}
        assert len(index.tables[n].keys) == len(kept)
        for ctx, c in kept.items():
            found = index._lookup(list(ctx))
            top = c.most_common(1)[0][1]
            assert found[0] == n and c[found[1]] == top
            assert found[2] == pytest.approx(top / sum(c.values()))


def test_a_corpus_walk_follows_the_longest_known_context_while_its_probability_holds():
    sequences = [([], [1, 2, 3, 4, 5])] * 3 + [([], [2, 3, 9])]
    index = CorpusIndex.build(sequences, vocab_size=16, fingerprint="x")
    assert index.propose([7, 1, 2], 4, min_prob=0.5) == Proposal([3, 4, 5], CORPUS, (10, 10, 10))
    # after (2, 3) comes 4 three times in four: below 0.8 the walk stops before it
    assert index.propose([8, 2, 3], 4, min_prob=0.8) is None
    assert index.propose([8, 2, 3], 4, min_prob=0.7) == Proposal([4, 5], CORPUS, (7, 10))


def test_the_offline_lookup_measure_counts_what_each_source_gets_right_position_by_position():
    rng = random.Random(5)
    records = [CorpusRecord(None, [rng.randrange(4) for _ in range(3)],
                            [rng.randrange(4) for _ in range(rng.randrange(1, 25))]) for _ in range(30)]
    index = CorpusIndex.build([(r.prompt_ids, r.output_ids) for r in records[:20]], vocab_size=4,
                              fingerprint="x")
    proposed, right, positions = Counter(), Counter(), 0
    for r in records[20:]:
        for i in range(len(r.output_ids)):
            tokens, truth = r.prompt_ids + r.output_ids[:i], r.output_ids[i:i + 3]
            found = {CONTEXT: brute_force_context(tokens, 3), CORPUS: index.propose(tokens[-3:], 3, 0.3)}
            for source, p in found.items():
                if p is not None:
                    proposed[source] += 1
                    agree = [a == b for a, b in zip(p.tokens, truth)]
                    right[source] += agree.index(False) if False in agree else len(agree)
            positions += 1
    report = lookup_accuracy(records[20:], index, limit=3, min_prob=0.3)
    for source in (CONTEXT, CORPUS):
        assert report[source]["proposes_at"] == round(proposed[source] / positions, 4)
        assert report[source]["tokens_right_per_position"] == round(right[source] / positions, 4)
    assert right[CONTEXT] and right[CORPUS]
    assert set(lookup_accuracy(records[20:], None, limit=3, min_prob=0.3)) == {CONTEXT}


def test_the_corpus_index_refuses_a_tokenizer_it_was_not_built_with(tmp_path, tiny_target):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target))
    index = CorpusIndex.build([([1], [2, 3, 2, 3])], len(tokenizer), "0123456789abcdef")
    index.save(tmp_path / "corpus-index.npz")
    with pytest.raises(ValueError, match="built with another tokenizer"):
        load_corpus_index(tmp_path / "corpus-index.npz", tokenizer)
    index.fingerprint = tokenizer_fingerprint(tokenizer)
    index.save(tmp_path / "corpus-index.npz")
    assert load_corpus_index(tmp_path / "corpus-index.npz", tokenizer).tables.keys() == {1, 2, 3}


def test_a_corpus_tokenized_with_another_vocabulary_is_refused(tiny_target):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target))
    texts = ["The quick brown fox jumps over the lazy dog.", "One, two, three: four five six."]
    good = [CorpusRecord(t, [1] + tokenizer.encode(t, add_special_tokens=False) + [2], [5, 6])
            for t in texts]
    check_corpus_tokenizer(good, tokenizer)
    other = [replace(r, prompt_ids=[(i * 7919 + 11) % len(tokenizer) for i in r.prompt_ids])
             for r in good]
    with pytest.raises(ValueError, match="built with another tokenizer"):
        check_corpus_tokenizer(other, tokenizer)
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        check_corpus_tokenizer([replace(good[0], output_ids=[len(tokenizer)])], tokenizer)


def test_a_branch_shares_the_nodes_that_hold_its_prefix_and_respects_the_budget():
    drafts, parents, keys = [5, 6, 7], [-1, -1, 0], [None] * 3   # the head's 5 -> 7, and 6
    context = [LookupKey(True, CONTEXT, 3, place) for place in (1, 2, 3, 4)]
    assert merge_branch(drafts, parents, keys, Branch([5, 7, 8, 9], CONTEXT, context), 1) == 1
    assert (drafts, parents, keys) == ([5, 6, 7, 8], [-1, -1, 0, 2], [None] * 3 + [context[2]])
    corpus = [LookupKey(True, CORPUS, 9, place) for place in (1, 2)]
    assert merge_branch(drafts, parents, keys, Branch([4, 1], CORPUS, corpus), 5) == 2
    assert parents[-2:] == [-1, 4] and keys[-2:] == corpus


@pytest.fixture(scope="module")
def looping_prompts(prompts):
    """Prompts that repeat themselves, so context lookups fire from the first round."""
    return [p[:6] * 3 for p in prompts[:4]] + prompts[4:]


@pytest.mark.parametrize("topk", [1, 4])
def test_trees_mixing_head_context_and_corpus_branches_equal_hf_generate(
        tmp_path, tiny_target, eagle3_head, looping_prompts, hf_greedy, topk):
    expected = [hf_greedy(p, MAX_TOKENS) for p in looping_prompts]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target))
    corpus = CorpusIndex.build(list(zip(looping_prompts[::2], expected[::2])), len(tokenizer),
                               tokenizer_fingerprint(tokenizer))
    corpus.save(tmp_path / "corpus.npz")
    engine = tiny_engine(tiny_target, eagle3_head, max_running=4, lookup_tokens=6,
                         corpus=tmp_path / "corpus.npz")
    params = SamplingParams(max_tokens=MAX_TOKENS, draft_topk=topk, draft_depth=3)
    assert [r.token_ids for r in engine.generate(looping_prompts, params)] == expected
    accepted = engine.stats.accepted_tokens_by_source
    assert accepted[CONTEXT] > 0 and accepted[CORPUS] > 0 and engine.stats.kv_moves > 0
    assert engine.idle_counts() == {"target_pages_free": 256, "drafter_pages_free": 256,
                                    "draft_slots_free": 128}


def test_a_request_whose_lookups_propose_nothing_drafts_exactly_the_heads_tree(
        tiny_target, eagle3_head, prompts, monkeypatch):
    params = SamplingParams(max_tokens=MAX_TOKENS, draft_topk=4, draft_depth=3)
    plain = tiny_engine(tiny_target, eagle3_head, lookup_tokens=0)
    looked = tiny_engine(tiny_target, eagle3_head, lookup_tokens=6)
    monkeypatch.setattr(looked.policy, "lookups", lambda *args: [])
    assert looked.generate(prompts[:3], params) == plain.generate(prompts[:3], params)
    assert replace(looked.stats, queue_times=None) == replace(plain.stats, queue_times=None)


def test_requests_that_switch_lookups_off_draft_from_the_head_alone_and_sampled_ones_look_up_too(
        tiny_target, eagle3_head, looping_prompts, hf_greedy):
    engine = tiny_engine(tiny_target, eagle3_head, lookup_tokens=6, sampled_lookup_tokens=2)
    engine.generate(looping_prompts[:2], SamplingParams(max_tokens=MAX_TOKENS, context_lookup=False))
    engine.generate(looping_prompts[:2], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=1,
                                                        context_lookup=False))
    assert engine.stats.draft_tokens_by_source[CONTEXT] == 0
    # A low temperature, so that the random model's sampled output loops as its greedy one does.
    engine.generate(looping_prompts[:2], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.05, seed=1))
    assert engine.stats.draft_tokens_by_source[CONTEXT] > 0


def test_lookups_continue_the_heads_most_likely_path_as_well_as_the_tokens():
    from eagle_serve.draft_round import first_path
    from eagle_serve.drafting import DraftPolicy
    from eagle_serve.requests import AcceptanceRecord, Request
    from eagle_serve.settings import EngineConfig

    policy = DraftPolicy(EngineConfig.served(lookup_tokens=3))
    req = Request("r", 2, SamplingParams(), k=8, seed=0, stop=None, tokens=[7, 1, 2, 3, 4, 5, 9, 1])
    policy.setup_lookup(req)
    drafts, parents = [2, 6, 3, 8], [-1, -1, 0, 2]       # first path 2 -> 3 -> 8
    assert first_path(drafts, parents) == [2, 3, 8]
    assert policy.lookups(req, left=10, batch_size=1) == []     # (9, 1) never occurred before
    req.acceptance = AcceptanceRecord(reached=100, accepted=90)  # the head's path: mostly kept
    keys = [LookupKey(True, CONTEXT, 3, place) for place in (1, 2, 3)]  # (1, 2, 3) matched
    assert policy.lookups(req, left=10, batch_size=1, head_path=[2, 3]) == [
        Branch([2, 3, 4, 5, 9], CONTEXT, [None, None] + keys)]
    assert policy.lookups(req, left=4, batch_size=1, head_path=[2, 3])[0].tokens == [2, 3, 4, 5]
    # the rows cost draft_step_cost (0.05) each: past a head path kept half the time (0.25 for
    # both), the context's third token (0.5 ** 3 before anything was measured) does not pay
    req.acceptance = AcceptanceRecord()
    assert policy.lookups(req, left=10, batch_size=1, head_path=[2, 3])[0].tokens == [2, 3, 4, 5]


def test_a_greedy_request_beside_others_looks_up_while_it_may_draft_at_all():
    """Lookups cost verify rows and no drafter call: a greedy request drafts them in a batch
    too (chains of the head beside them), up to max_draft_batch running requests."""
    from eagle_serve.drafting import DraftPolicy
    from eagle_serve.requests import Request
    from eagle_serve.settings import EngineConfig

    policy = DraftPolicy(EngineConfig.served(lookup_tokens=3, max_tree_batch=1, max_draft_batch=4,
                                             draft_call_cost=0.0, draft_step_cost=0.0))
    req = Request("r", 2, SamplingParams(), k=8, seed=0, stop=None, tokens=[7, 1, 2, 3, 4, 9, 1, 2])
    policy.setup_lookup(req)
    found = [Branch([3, 4, 9], CONTEXT, [LookupKey(True, CONTEXT, 2, place) for place in (1, 2, 3)])]
    assert [policy.lookups(req, left=10, batch_size=b) for b in (1, 2, 4, 5)] == [found] * 3 + [[]]


def test_a_lookup_tokens_chance_is_its_keys_measured_rate_times_its_predecessors_chance():
    keys = LookupScores.keys(Proposal([5, 6, 7, 8, 9, 4], CONTEXT, (4,) * 6), matched=True)
    assert keys == [LookupKey(True, CONTEXT, 4, min(place, MAX_PLACE)) for place in range(1, 7)]
    scores = LookupScores()
    assert scores.chances(keys[:3]) == [PRIOR_RATE, PRIOR_RATE ** 2, PRIOR_RATE ** 3]
    for i in range(2000):  # the first place kept 3 times in 4, the second always
        scores.record(keys[0], i % 4 != 0)
        scores.record(keys[1], True)
    assert scores.chances(keys[:3]) == pytest.approx([0.75, 0.75, 0.75 * PRIOR_RATE], abs=0.01)
    assert scores.chances(keys[:3], measured=False) == [PRIOR_RATE, PRIOR_RATE ** 2, PRIOR_RATE ** 3]
    other = LookupScores.keys(Proposal([5], CORPUS, (9,)), matched=False)  # rejection-sampled
    assert scores.chances(other) == [PRIOR_RATE]
