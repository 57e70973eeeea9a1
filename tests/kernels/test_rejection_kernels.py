"""The rejection-sampling kernels (under TRITON_INTERPRET=1 on CPU) against their references:
exact for greedy and for forced outcomes, in distribution for random acceptance."""
from __future__ import annotations

import itertools

import pytest
import torch

from eagle_serve.kernels.rejection import greedy_accept, greedy_accept_ref, random_accept, random_accept_ref
from eagle_serve.kernels.sampling import DRAFT, sample
from eagle_serve.testing import ALPHA, chi2_pvalue


def ragged(num_drafts: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(itertools.accumulate(num_drafts)))


def test_greedy_kernel_accepts_the_matching_prefix_then_the_targets_token():
    drafts = torch.tensor([5, 6, 7, 1, 2, 9])
    cu = torch.tensor([0, 3, 3, 6])  # requests with 3, 0 and 3 drafts
    argmax = torch.tensor([5, 6, 8, 4, 3, 1, 2, 9, 11])
    out, num = greedy_accept(drafts, cu, argmax, impl="triton")
    assert num.tolist() == [3, 1, 4]
    assert out.tolist() == [[5, 6, 8, -1], [3, -1, -1, -1], [1, 2, 9, 11]]


@pytest.mark.parametrize("num_drafts", [[4], [0], [3, 0, 5, 1, 2, 5, 4]])
def test_greedy_kernel_equals_the_reference_on_ragged_batches(num_drafts):
    gen = torch.Generator().manual_seed(sum(num_drafts))
    cu = ragged(num_drafts)
    argmax = torch.randint(0, 111, (int(cu[-1]) + len(num_drafts),), generator=gen)
    drafts = torch.cat([argmax[cu[b] + b: cu[b + 1] + b] for b in range(len(num_drafts))])
    wrong = torch.rand(drafts.shape, generator=gen) < 0.25  # break some matches
    drafts = torch.where(wrong, (drafts + 1) % 111, drafts)
    kernel = greedy_accept(drafts, cu, argmax, impl="triton")
    ref = greedy_accept_ref(drafts, cu, argmax)
    assert kernel[0].tolist() == ref[0].tolist() and kernel[1].tolist() == ref[1].tolist()


def one_hot(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


@pytest.mark.parametrize("vocab", [111, 49152])
def test_random_kernel_is_exact_when_the_outcome_is_forced(vocab):
    """One-hot p and q: a draft is accepted iff p agrees, the recovered token is p's and the
    bonus is p's, whatever the noise."""
    last = vocab - 1
    if vocab == 111:  # seven requests: all accepted + bonus, rejections at every place, no drafts
        num_drafts = [2, 3, 0, 1, 2, 1, 3]
        drafts = [7, 8, 1, 2, 3, 5, 9, 4, 4, 4, 5, 6]
        target = [7, 8, 110, 1, 0, 3, 3, 99, 6, 60, 9, 5, 4, 4, 40, 4, 5, 50, 7]
        draft_q = drafts
    else:  # one request: accept, reject (recovered from the far end of the vocabulary)
        num_drafts, drafts, target, draft_q = [2], [3, 40000], [3, last, 17], [3, 40000]
    cu = ragged(num_drafts)
    args = (torch.tensor(drafts), cu, one_hot(target, vocab), one_hot(draft_q, vocab),
            list(range(len(num_drafts))), [5] * len(num_drafts))
    kernel, ref = random_accept(*args, impl="triton"), random_accept_ref(*args)
    assert kernel[0].tolist() == ref[0].tolist() and kernel[1].tolist() == ref[1].tolist()
    if vocab == 111:
        assert ref[1].tolist() == [3, 2, 1, 1, 2, 2, 3]
        assert ref[0][:, 0].tolist() == [7, 1, 99, 6, 9, 4, 4]
    else:
        assert ref[0].tolist() == [[3, last, -1]]


def test_random_kernel_without_drafts_emits_only_bonus_tokens():
    args = (torch.zeros(0, dtype=torch.int64), torch.tensor([0, 0, 0]), one_hot([4, 110], 111),
            torch.zeros(0, 111), [1, 2], [0, 9])
    kernel, ref = random_accept(*args, impl="triton"), random_accept_ref(*args)
    assert kernel[0].tolist() == ref[0].tolist() == [[4], [110]]
    assert kernel[1].tolist() == ref[1].tolist() == [1, 1]


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=pytest.mark.slow)])
def test_random_acceptance_reproduces_the_target_distribution_over_two_positions(impl):
    """Drafts come from q (unlike p); the emitted first two tokens must follow p0 x p1, and a
    bonus token p2. n trials as one batch of n requests (2 drafts each): the keyed draws of each
    are those it gets alone."""
    torch.manual_seed(0)
    vocab, n = 6, 12000
    p = torch.softmax(torch.randn(3, vocab) * 1.5, dim=1)  # target at positions 0, 1, 2 (bonus)
    q = torch.softmax(torch.randn(2, vocab) * 1.5, dim=1)  # drafter at positions 0, 1
    q[0, 2] = 0.0  # a token the drafter never proposes must still come out (via the residual)
    q[0] /= q[0].sum()
    seeds = [1_000_003 * trial + 17 for trial in range(n)]
    drafts = sample(q.repeat(n, 1), [s for s in seeds for _ in range(2)], [0, 1] * n, DRAFT,
                    impl=impl)
    out, num = random_accept(drafts, torch.arange(0, 2 * n + 1, 2), p.repeat(n, 1), q.repeat(n, 1),
                             seeds, [0] * n, impl=impl)
    assert bool((num >= 1).all())
    # First draft rejected: the second token is sampled from p1 in the next round.
    next_round = sample(p[1:2].expand(n, -1).contiguous(), [s + 1 for s in seeds], [1] * n, DRAFT,
                        impl=impl)
    second = torch.where(num >= 2, out[:, 1], next_round)
    counts = torch.bincount(out[:, 0] * vocab + second, minlength=vocab * vocab)
    joint = (p[0].unsqueeze(1) * p[1].unsqueeze(0)).flatten()
    assert chi2_pvalue(counts, joint) > ALPHA
    bonus = out[num == 3, 2]  # both drafts accepted: the bonus token follows p2
    assert chi2_pvalue(torch.bincount(bonus, minlength=vocab), p[2]) > ALPHA


def test_random_kernel_repeats_for_a_seed_and_ignores_the_batch():
    torch.manual_seed(1)
    num_drafts = [3, 1, 4]
    cu = ragged(num_drafts)
    p = torch.softmax(torch.randn(int(cu[-1]) + 3, 111), dim=1)
    q = torch.softmax(torch.randn(int(cu[-1]), 111), dim=1)
    drafts = torch.randint(0, 111, (int(cu[-1]),))
    seeds, positions = [5, 6, 7], [10, 3, 42]
    first = random_accept(drafts, cu, p, q, seeds, positions, impl="triton")
    again = random_accept(drafts, cu, p, q, seeds, positions, impl="triton")
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    alone = random_accept(drafts[4:], torch.tensor([0, 4]), p[6:], q[4:], seeds[2:], positions[2:],
                          impl="triton")
    assert torch.equal(alone[0][0], first[0][2]) and int(alone[1][0]) == int(first[1][2])

