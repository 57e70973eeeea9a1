"""Lookup draft sources (eagle_serve.spec.lookup) and draft trees that mix them with the head's."""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from transformers import AutoTokenizer

from eagle_serve.core.requests import SamplingParams
from eagle_serve.kernels.cpu import cpu_kernels
from eagle_serve.spec import lookup
from eagle_serve.spec.lookup import (
    CONTEXT,
    CORPUS,
    MAX_MATCH,
    VOTE_CAP,
    ContextIndex,
    CorpusIndex,
    CorpusRecord,
    Proposal,
    check_corpus_tokenizer,
    corpus_strength,
    load_corpus_index,
    lookup_accuracy,
    tokenizer_fingerprint,
)
from eagle_serve.spec.lookup_scores import MAX_PLACE, PRIOR_RATE, LookupKey, LookupScores
from eagle_serve.spec.policy import Branch
from eagle_serve.spec.proposals import merge_branch
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


def brute_force_corpus(sequences, tokens: list[int], limit: int, min_prob: float) -> Proposal | None:
    """The longest suffix of tokens (at most MAX_MATCH) that occurs in some record (prompt +
    answer); the most frequent next token of its occurrences (ties: the lowest), then of those
    that went on with it, while the product of the shares holds."""
    records, ctx = [p + a for p, a in sequences], tokens[-MAX_MATCH:]
    for n in range(len(ctx), 0, -1):
        at = [(r, j) for r in records for j in range(n, len(r) + 1) if r[j - n:j] == ctx[-n:]]
        if at:
            break
    else:
        return None
    out, strengths, prob = [], [], 1.0
    while len(out) < limit:
        at = [(r, j) for r, j in at if j < len(r)]
        if not at:
            break
        counts = Counter(r[j] for r, j in at)
        top = max(counts.values())
        token = min(t for t, c in counts.items() if c == top)
        prob *= top / len(at)
        if prob < min_prob:
            break
        out.append(token)
        strengths.append(corpus_strength(n + len(out) - 1, top, len(at)))
        at = [(r, j + 1) for r, j in at if r[j] == token]
    return Proposal(out, CORPUS, tuple(strengths)) if out else None


@pytest.fixture(params=["c++", "python"])
def walk_in(request, monkeypatch):
    """Corpus lookups walk in eagle_serve/kernels/cpu_lookup.cpp, or in CorpusIndex.walk (its reference)."""
    if request.param == "python":
        monkeypatch.setattr(CorpusIndex, "_kernel", None)
    elif cpu_kernels() is None:
        pytest.skip("the CPU kernels run on CPUs with AVX2 and FMA")
    return request.param


def test_corpus_lookup_equals_a_brute_force_search_on_random_corpora(monkeypatch, walk_in):
    monkeypatch.setattr(lookup, "VOTE_CAP", 10**9)  # every occurrence votes, as in the brute force
    rng = random.Random(3)
    for trial in range(12):
        vocab = rng.choice([3, 5, 12])
        sequences = [([rng.randrange(vocab) for _ in range(rng.randrange(0, 4))],
                      [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))]) for _ in range(30)]
        index = CorpusIndex.build(sequences, vocab_size=vocab, fingerprint="x")
        for _ in range(40):  # random streams, and streams that end with a long run of a record
            prompt, answer = rng.choice(sequences)
            record = prompt + answer
            cut = rng.randrange(1, len(record) + 1)
            tokens = rng.choice([[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))],
                                 [rng.randrange(vocab) for _ in range(rng.randrange(0, 3))] + record[:cut]])
            limit, min_prob = rng.randrange(1, 7), rng.choice([0.0, 0.2, 0.5])
            assert index.propose(tokens, limit, min_prob) == brute_force_corpus(
                sequences, tokens, limit, min_prob), (trial, tokens)


def test_a_corpus_walk_follows_the_longest_match_while_its_probability_holds(walk_in):
    sequences = [([], [1, 2, 3, 4, 5])] * 3 + [([], [2, 3, 9])]
    index = CorpusIndex.build(sequences, vocab_size=16, fingerprint="x")
    # (1, 2) occurs three times, always followed by 3, 4, 5; the walk stops at a record's end
    assert index.propose([7, 1, 2], 4, min_prob=0.5) == Proposal(
        [3, 4, 5], CORPUS, (corpus_strength(2, 3, 3), corpus_strength(3, 3, 3), corpus_strength(4, 3, 3)))
    # after (2, 3) comes 4 three times in four: below 0.8 the walk stops before it
    assert index.propose([8, 2, 3], 4, min_prob=0.8) is None
    assert index.propose([8, 2, 3], 4, min_prob=0.7) == Proposal(
        [4, 5], CORPUS, (corpus_strength(2, 3, 4), corpus_strength(3, 3, 3)))
    # no match runs across two records: (5, 2) is not in the corpus, (2) is
    assert index.propose([5, 2], 1, min_prob=0.0) == Proposal([3], CORPUS, (corpus_strength(1, 4, 4),))
    assert index.propose([6], 4, min_prob=0.0) is None


def test_a_context_with_many_occurrences_votes_over_evenly_spaced_ones(walk_in):
    sequences = [([], [7, 1, 5])] * 600 + [([], [7, 2, 5])] * 300
    proposal = CorpusIndex.build(sequences, vocab_size=16, fingerprint="x").propose([7], 2, 0.0)
    assert proposal.tokens == [1, 5]
    # of the ~VOTE_CAP occurrences read, about two thirds go on with 1 (a share in [0.6, 1), 5+)
    assert proposal.strengths[0] == corpus_strength(1, 2 * VOTE_CAP // 3, VOTE_CAP) == 22


def test_a_corpus_steps_strength_reads_as_match_length_agreement_and_evidence_bands():
    assert [corpus_strength(n, 5, 5) for n in (1, 2, 3, 5, 6, 11, 12, 40)] == [
        32, 32, 132, 132, 232, 232, 332, 332]
    assert [corpus_strength(4, a, 10) for a in (1, 2, 4, 5, 9)] == [100, 101, 111, 112, 122]
    assert [corpus_strength(7, a, a) for a in (1, 2, 4, 5)] == [230, 231, 231, 232]


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
            found = {CONTEXT: brute_force_context(tokens, 3), CORPUS: index.propose(tokens, 3, 0.3)}
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
    loaded = load_corpus_index(tmp_path / "corpus-index.npz", tokenizer)
    assert loaded.propose([2, 3], 2, 0.0).tokens == [2, 3]


def test_an_index_of_an_older_version_is_refused_with_the_command_that_rebuilds_it(tmp_path, tiny_target):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target))
    np.savez_compressed(tmp_path / "old.npz", bits=16, fingerprint=tokenizer_fingerprint(tokenizer),
                        keys_1=np.zeros(1, dtype=np.int64))
    with pytest.raises(ValueError, match="older version.*python -m eagle_serve.spec.lookup build"):
        load_corpus_index(tmp_path / "old.npz", tokenizer)


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
    context = [LookupKey("greedy", CONTEXT, 3, place) for place in (1, 2, 3, 4)]
    assert merge_branch(drafts, parents, keys, Branch([5, 7, 8, 9], CONTEXT, context), 1) == 1
    assert (drafts, parents, keys) == ([5, 6, 7, 8], [-1, -1, 0, 2], [None] * 3 + [context[2]])
    corpus = [LookupKey("greedy", CORPUS, 9, place) for place in (1, 2)]
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
    from eagle_serve.core.requests import AcceptanceRecord, Request
    from eagle_serve.settings import EngineConfig
    from eagle_serve.spec.policy import DraftPolicy
    from eagle_serve.spec.proposals import first_path

    policy = DraftPolicy(EngineConfig.served(lookup_tokens=3))
    req = Request("r", 2, SamplingParams(), k=8, seed=0, stop=None, tokens=[7, 1, 2, 3, 4, 5, 9, 1])
    policy.setup_lookup(req)
    drafts, parents = [2, 6, 3, 8], [-1, -1, 0, 2]       # first path 2 -> 3 -> 8
    assert first_path(drafts, parents) == [2, 3, 8]
    assert policy.lookups(req, left=10, batch_size=1) == []     # (9, 1) never occurred before
    req.acceptance = AcceptanceRecord(reached=100, accepted=90)  # the head's path: mostly kept
    keys = [LookupKey("greedy", CONTEXT, 3, place) for place in (1, 2, 3)]  # (1, 2, 3) matched
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
    from eagle_serve.core.requests import Request
    from eagle_serve.settings import EngineConfig
    from eagle_serve.spec.policy import DraftPolicy

    policy = DraftPolicy(EngineConfig.served(lookup_tokens=3, max_tree_batch=1, max_draft_batch=4,
                                             draft_call_cost=0.0, draft_step_cost=0.0))
    req = Request("r", 2, SamplingParams(), k=8, seed=0, stop=None, tokens=[7, 1, 2, 3, 4, 9, 1, 2])
    policy.setup_lookup(req)
    found = [Branch([3, 4, 9], CONTEXT, [LookupKey("greedy", CONTEXT, 2, place) for place in (1, 2, 3)])]
    assert [policy.lookups(req, left=10, batch_size=b) for b in (1, 2, 4, 5)] == [found] * 3 + [[]]


def test_a_lookup_tokens_chance_is_its_keys_measured_rate_times_its_predecessors_chance():
    keys = LookupScores.keys(Proposal([5, 6, 7, 8, 9, 4], CONTEXT, (4,) * 6), rule="greedy")
    assert keys == [LookupKey("greedy", CONTEXT, 4, min(place, MAX_PLACE)) for place in range(1, 7)]
    scores = LookupScores()
    assert scores.chances(keys[:3]) == [PRIOR_RATE, PRIOR_RATE ** 2, PRIOR_RATE ** 3]
    for i in range(2000):  # the first place kept 3 times in 4, the second always
        scores.record(keys[0], i % 4 != 0)
        scores.record(keys[1], True)
    assert scores.chances(keys[:3]) == pytest.approx([0.75, 0.75, 0.75 * PRIOR_RATE], abs=0.01)
    assert scores.chances(keys[:3], measured=False) == [PRIOR_RATE, PRIOR_RATE ** 2, PRIOR_RATE ** 3]
    other = LookupScores.keys(Proposal([5], CORPUS, (9,)), rule="rejection")
    assert scores.chances(other) == [PRIOR_RATE]


def test_greedy_and_coupled_requests_lookups_are_scored_apart():
    """A coupled sampled request's lookup drafts must equal a sample, not the argmax: they are
    kept less often, so the rate a greedy request's drafts earned must not price them (nor the
    other way round) on a server running both."""
    from eagle_serve.core.requests import Request
    from eagle_serve.settings import EngineConfig
    from eagle_serve.spec.policy import DraftPolicy

    policy = DraftPolicy(EngineConfig.served(lookup_tokens=3, sampled_lookup_tokens=3,
                                             sampled_verify="coupled"))
    tokens = [7, 1, 2, 3, 4, 9, 1, 2]  # (1, 2) occurred before: 3, 4, 9 follow it
    greedy, coupled = (Request(name, 2, params, k=8, seed=0, stop=None, tokens=list(tokens))
                       for name, params in (("g", SamplingParams()),
                                            ("c", SamplingParams(temperature=0.7, seed=1))))
    for req in (greedy, coupled):
        policy.setup_request(req)
    assert (greedy.rule, coupled.rule) == ("greedy", "coupled")
    first = policy.lookups(greedy, left=10, batch_size=1)[0].keys[0]
    for _ in range(2000):  # the greedy request's first context token never kept
        policy.lookup_scores.record(first, False)
    assert policy.lookups(greedy, left=10, batch_size=1) == []
    branch, = policy.lookups(coupled, left=10, batch_size=1)
    assert branch.tokens[0] == 3 and branch.keys[0] == replace(first, rule="coupled")
