"""Sampling and rejection sampling reproduce the target distribution (fixed seeds, alpha 1e-6)."""
from __future__ import annotations

import pytest
import torch

from eagle_serve.kernels.rejection import (
    greedy_accept_ref,
    greedy_tree_accept,
    random_accept_ref,
    random_tree_accept_ref,
)
from eagle_serve.kernels.sampling import DRAFT, SAMPLE, compute_probs_ref, coupled_scores, keyed_uniform, sample_ref
from eagle_serve.testing import ALPHA, chi2_pvalue


def test_greedy_accepts_the_matching_prefix_then_the_targets_token():
    drafts = torch.tensor([5, 6, 7, 1, 2, 9])
    cu = torch.tensor([0, 3, 3, 6])  # requests with 3, 0 and 3 drafts
    argmax = torch.tensor([5, 6, 8, 4,  # r0: 2 match, then 8 replaces 7
                           3,           # r1: no drafts -> its token
                           1, 2, 9, 11])  # r2: all match + bonus 11
    out, num = greedy_accept_ref(drafts, cu, argmax)
    assert num.tolist() == [3, 1, 4]
    assert out.tolist() == [[5, 6, 8, -1], [3, -1, -1, -1], [1, 2, 9, 11]]


def test_greedy_tree_acceptance_follows_the_targets_argmax_down_a_hand_made_tree():
    # request 0:  root -> n0 (5) -> n2 (7) -> n4 (9)
    #                  -> n1 (6) -> n3 (8)
    #                            -> n5 (3)
    # the target: 6 after the root (-> n1), 3 after n1 (-> n5), 11 after n5 (bonus)
    drafts = torch.tensor([5, 6, 7, 8, 9, 3,  1, 2])
    parents = torch.tensor([-1, -1, 0, 1, 2, 1,  -1, -1])
    cu = torch.tensor([0, 6, 6, 8])  # request 1 has no drafts; request 2: two depth-1 nodes
    argmax = torch.tensor([6, 7, 3, 9, 1, 2, 11,  # r0: root, n0 .. n5
                           4,                     # r1: root only
                           2, 0, 5])              # r2: root picks n1 (2), then 5 at n1
    out, num, path = greedy_tree_accept(drafts, parents, cu, argmax)
    assert num.tolist() == [3, 1, 2]
    assert out.tolist() == [[6, 3, 11, -1, -1, -1, -1], [4] + [-1] * 6, [2, 5] + [-1] * 5]
    assert path.tolist() == [[1, 5, -1, -1, -1, -1], [-1] * 6, [1] + [-1] * 5]


def test_greedy_tree_acceptance_of_chains_is_greedy_acceptance():
    gen = torch.Generator().manual_seed(5)
    ks = [0, 3, 1, 6, 4, 2]
    cu = torch.tensor([0] + [sum(ks[:i + 1]) for i in range(len(ks))])
    drafts = torch.randint(0, 3, (int(cu[-1]),), generator=gen)
    parents = torch.cat([torch.arange(k) - 1 for k in ks])
    argmax = torch.randint(0, 3, (int(cu[-1]) + len(ks),), generator=gen)
    out, num, path = greedy_tree_accept(drafts, parents, cu, argmax)
    ref_out, ref_num = greedy_accept_ref(drafts, cu, argmax)
    assert torch.equal(num, ref_num) and torch.equal(out, ref_out)
    for b, n in enumerate(num.tolist()):
        assert path[b, :n - 1].tolist() == list(range(n - 1))


def test_keyed_uniforms_depend_only_on_the_key():
    a = keyed_uniform(7, 100, DRAFT, 5)
    assert torch.equal(a, keyed_uniform(7, 100, DRAFT, 5))
    assert not torch.equal(a, keyed_uniform(7, 101, DRAFT, 5))
    assert not torch.equal(a, keyed_uniform(8, 100, DRAFT, 5))


def test_the_cpu_noise_and_race_are_the_torch_forms_bit_for_bit(monkeypatch):
    """eagle_serve/kernels/cpu_random.cpp against sampling.py's torch form (what runs where it is not built,
    and on other devices): the same uniforms, and the same winners over peaked, flat, float32
    and float64 rows with zeros (its log is skipped where it cannot change the winner)."""
    from eagle_serve.kernels import sampling
    from eagle_serve.kernels.cpu import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("eagle_serve/kernels/cpu.cpp is not built on this CPU")
    keys = [sampling.key_seed(s, 11, DRAFT) for s in range(4)]
    assert torch.equal(cpu_kernels().keyed_uniforms(torch.tensor(keys), 5000),
                       torch.stack([sampling.stream_uniforms(k, 5000) for k in keys]))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(48, 4096, generator=g) * torch.tensor([0.1, 1.0, 4.0, 12.0]).repeat(12).unsqueeze(1)
    probs = torch.softmax(logits, -1).masked_fill(torch.rand(48, 4096, generator=g) < 0.3, 0.0)
    seeds, positions = list(range(48)), [5 + i % 3 for i in range(48)]
    fast = [sampling.sample_ref(p, seeds, positions, SAMPLE) for p in (probs, probs.double())]
    monkeypatch.setattr(sampling, "cpu_kernels", lambda: None)
    slow = sampling.sample_ref(probs, seeds, positions, SAMPLE)
    assert torch.equal(fast[0], slow) and torch.equal(fast[1], slow)
    assert bool((probs.gather(1, slow.unsqueeze(1)) > 0).all())


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    probs = compute_probs_ref(logits, torch.ones(3), torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.8, 0.1]))
    assert torch.allclose(probs[0], torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    assert torch.allclose(probs[1], torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    assert torch.allclose(probs[2], torch.tensor([1.0, 0, 0, 0, 0]))


def test_exponential_race_sampling_follows_the_distribution():
    probs = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.4, 0.1, 0.0])
    n = 20000
    draws = sample_ref(probs.expand(n, -1), [3] * n, list(range(n)), DRAFT)
    assert chi2_pvalue(torch.bincount(draws, minlength=7), probs) > ALPHA


def test_coupled_scores_pick_the_targets_own_sample_when_q_is_the_target_distribution():
    """With q = p the coupled draft is the target's seeded sample at every row; with q a draft
    vocabulary's renormalized share of p, it is that sample whenever the sample falls inside the
    draft vocabulary."""
    torch.manual_seed(0)
    rows, vocab = 300, 40
    p = torch.softmax(torch.randn(rows, vocab, dtype=torch.float64) * 2, dim=-1)
    seeds, positions = list(range(rows)), [17 + r % 5 for r in range(rows)]
    target = sample_ref(p, seeds, positions, SAMPLE)
    assert torch.equal(coupled_scores(p, torch.arange(vocab), vocab, seeds, positions).argmax(-1), target)
    draft_vocab = torch.arange(0, vocab, 2)  # draft id i is target id 2i
    q = p[:, draft_vocab] / p[:, draft_vocab].sum(-1, keepdim=True)
    drafted = draft_vocab[coupled_scores(q, draft_vocab, vocab, seeds, positions).argmax(-1)]
    inside = target % 2 == 0
    assert 0 < int(inside.sum()) < rows
    assert torch.equal(drafted[inside], target[inside])


def test_random_acceptance_is_exactly_repeatable_for_a_seed():
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(4, 9), dim=1)
    q = torch.softmax(torch.randn(3, 9), dim=1)
    drafts = sample_ref(q, [5] * 3, [10, 11, 12], DRAFT)
    first = random_accept_ref(drafts, torch.tensor([0, 3]), p, q, [5], [10])
    again = random_accept_ref(drafts, torch.tensor([0, 3]), p, q, [5], [10])
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_tree_rejection_sampling_of_a_chain_is_chain_rejection_sampling():
    torch.manual_seed(2)
    for trial in range(200):
        k, vocab = trial % 4, 7
        p = torch.softmax(torch.randn(k + 1, vocab) * 2, dim=1)
        q = torch.softmax(torch.randn(k, vocab) * 2, dim=1)
        drafts = sample_ref(q, [trial] * k, list(range(5, 5 + k)), DRAFT) if k else torch.zeros(0, dtype=torch.int64)
        cu, parents = torch.tensor([0, k]), torch.arange(-1, k - 1)
        out, num = random_accept_ref(drafts, cu, p, q, [trial], [5])
        tree_out, tree_num, path = random_tree_accept_ref(drafts, parents, cu, p, q, [trial], [5])
        assert torch.equal(out, tree_out) and torch.equal(num, tree_num)
        assert path[0, :num[0] - 1].tolist() == list(range(num[0] - 1))


def test_tree_rejection_sampling_with_sampled_and_one_hot_children_reproduces_the_target():
    """A sampled chain h1 -> h2 from the head, plus deterministic (one-hot) lookup children at
    the root and under h1, merged where a lookup repeats the head's token: the first two emitted
    tokens must follow p0(a) p1(b | a)."""
    torch.manual_seed(3)
    vocab, n = 6, 12000
    p0 = torch.softmax(torch.randn(vocab) * 1.5, dim=0)
    p1 = torch.softmax(torch.randn(vocab, vocab) * 1.5, dim=1)  # target's next token after a
    q0 = torch.softmax(torch.randn(vocab) * 1.5, dim=0)
    q1 = torch.softmax(torch.randn(vocab, vocab) * 1.5, dim=1)
    one_hot = lambda x: torch.nn.functional.one_hot(torch.tensor(x), vocab).float()  # noqa: E731
    seeds = [1_000_003 * trial + 29 for trial in range(n)]  # n trees in one batch (keyed draws)
    h1 = sample_ref(q0.expand(n, -1).contiguous(), seeds, [0] * n, DRAFT).tolist()
    h2 = sample_ref(q1[h1], seeds, [1] * n, DRAFT).tolist()
    drafts, parents, q, target, cu = [], [], [], [], [0]
    for a, b in zip(h1, h2):
        tree, up, laws = [a, b], [-1, 0], [q0, q1[a]]
        if a != 2:  # the root's lookup proposes 2, then 4 under it
            tree += [2, 4]
            up += [-1, 2]
            laws += [one_hot(2), one_hot(4)]
        if b != (a + 1) % vocab:  # a lookup under h1
            tree.append((a + 1) % vocab)
            up.append(0)
            laws.append(one_hot((a + 1) % vocab))
        drafts += tree
        parents += up
        q += laws
        target += [p0] + [p1[d] for d in tree]  # each node's next-token law
        cu.append(cu[-1] + len(tree))
    out, num, _ = random_tree_accept_ref(torch.tensor(drafts), torch.tensor(parents), torch.tensor(cu),
                                         torch.stack(target), torch.stack(q), seeds, [0] * n)
    first = out[:, 0]
    # nothing accepted: the second token is sampled from p1 in the next round
    next_round = sample_ref(p1[first], [s + 1 for s in seeds], [1] * n, DRAFT)
    second = torch.where(num >= 2, out[:, 1], next_round)
    counts = torch.bincount(first * vocab + second, minlength=vocab * vocab).float()
    joint = (p0.unsqueeze(1) * p1).flatten()
    assert chi2_pvalue(counts, joint) > ALPHA
