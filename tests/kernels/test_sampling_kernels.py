"""The sampling kernels (under TRITON_INTERPRET=1 on CPU) against their references."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from eagle_serve.kernels import sampling
from eagle_serve.kernels.sampling import DRAFT, SAMPLE, compute_probs, compute_probs_ref, sample, sample_ref
from eagle_serve.testing import ALPHA, chi2_pvalue


def assert_probs_close(kernel: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(kernel, ref, atol=1e-6, rtol=1e-5)
    tiny = torch.maximum(kernel, ref) < 1e-6  # the reference may drop these (see the docstring)
    assert bool((((kernel > 0) == (ref > 0)) | tiny).all()), "kept sets differ"


def test_probs_kernel_matches_the_reference_at_vocab_111_over_seven_rows():
    torch.manual_seed(0)
    logits = torch.randn(7, 111) * 3
    temperature = torch.tensor([1.0, 0.3, 2.0, 0.7, 1.3, 0.5, 1.0])
    top_k = torch.tensor([0, 1, 5, 110, 111, 500, 20])
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.05, 0.95, 0.8, 0.999])
    for rows in (slice(0, 1), slice(1, 7)):  # one mixes top_p = 1 with top_p < 1 rows
        args = (logits[rows], temperature[rows], top_k[rows], top_p[rows])
        assert_probs_close(compute_probs(*args, impl="triton"), compute_probs_ref(*args))


@pytest.mark.parametrize("top_k, top_p", [([50, 0], [0.9, 0.95]), ([0], [1.0])])
def test_probs_kernel_matches_the_reference_at_vocab_49152(top_k, top_p):
    torch.manual_seed(1)
    rows = len(top_k)
    args = (torch.randn(rows, 49152) * 4, torch.full((rows,), 0.8), torch.tensor(top_k),
            torch.tensor(top_p))
    assert_probs_close(compute_probs(*args, impl="triton"), compute_probs_ref(*args))


def test_probs_kernel_gives_masked_tokens_zero_and_matches_the_reference():
    """Logits at -inf (EOS below a request's min_tokens) drop out before top-k and top-p."""
    torch.manual_seed(2)
    logits = torch.randn(5, 111) * 3
    banned = torch.tensor([0, 7, 42])
    logits[:, banned] = float("-inf")
    args = (logits, torch.tensor([1.0, 0.3, 2.0, 0.7, 1.0]), torch.tensor([0, 5, 108, 110, 1]),
            torch.tensor([1.0, 0.9, 0.5, 0.95, 1.0]))
    probs = compute_probs(*args, impl="triton")
    assert_probs_close(probs, compute_probs_ref(*args))
    assert float(probs[:, banned].abs().sum()) == 0.0
    assert torch.allclose(probs.sum(dim=1), torch.ones(5))


def test_probs_kernel_keeps_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    probs = compute_probs(logits, torch.ones(3), torch.tensor([2, 0, 0]),
                          torch.tensor([1.0, 0.8, 0.1]), impl="triton")
    assert torch.allclose(probs[0], torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    assert torch.allclose(probs[1], torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    assert torch.allclose(probs[2], torch.tensor([1.0, 0, 0, 0, 0]))


def test_probs_kernel_keeps_ties_at_the_cutoffs():
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]] * 2)
    probs = compute_probs(logits, torch.ones(2), torch.tensor([2, 0]), torch.tensor([1.0, 0.3]),
                          impl="triton")
    assert (probs[0] > 0).tolist() == [True, True, True, True, False]  # k-th value kept, all ties
    assert (probs[1] > 0).tolist() == [True, False, False, False, False]
    assert float(probs[1, 0]) == 1.0


def test_sample_kernel_follows_the_distribution():
    probs = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.4, 0.1, 0.0])
    n = 20000
    draws = sample(probs.expand(n, -1).contiguous(), [3] * n, list(range(n)), DRAFT, impl="triton")
    assert chi2_pvalue(torch.bincount(draws, minlength=7), probs) > ALPHA


def test_sample_kernel_follows_the_distribution_across_vocabulary_blocks():
    vocab, support = 1100, [3, 1023, 1024, 1099]  # both sides of the 1024-wide blocks
    probs = torch.zeros(vocab)
    probs[support] = torch.tensor([0.1, 0.3, 0.35, 0.25])
    n = 800
    draws = sample(probs.expand(n, -1).contiguous(), list(range(n)), [7] * n, SAMPLE,
                   impl="triton")
    assert chi2_pvalue(torch.bincount(draws, minlength=vocab), probs) > ALPHA


def test_sample_kernel_is_exact_on_one_hot_rows_at_vocab_49152():
    probs = torch.zeros(3, 49152)
    probs[0, 0] = probs[1, 49151] = probs[2, 12345] = 1.0
    seeds, positions = [1, 2, 3], [0, 5, 9]
    kernel = sample(probs, seeds, positions, SAMPLE, impl="triton")
    ref = sample_ref(probs, seeds, positions, SAMPLE)
    assert kernel.tolist() == ref.tolist() == [0, 49151, 12345]


def test_sample_kernel_depends_only_on_the_key_not_the_batch():
    torch.manual_seed(2)
    probs = torch.softmax(torch.randn(7, 111), dim=1)
    seeds, positions = [11, 12, 13, 14, 15, 16, 17], [4, 4, 4, 8, 8, 8, 9]
    batch = sample(probs, seeds, positions, DRAFT, impl="triton")
    assert torch.equal(batch, sample(probs, seeds, positions, DRAFT, impl="triton"))
    alone = [int(sample(probs[r:r + 1], seeds[r:r + 1], positions[r:r + 1], DRAFT, impl="triton"))
             for r in (0, 6)]
    assert alone == [int(batch[0]), int(batch[6])]
    flat = torch.full((64, 111), 1 / 111)
    others = sample(flat, list(range(64)), [0] * 64, DRAFT, impl="triton")
    assert len(set(others.tolist())) > 40  # different keys, different draws


def test_cpu_tensors_take_the_reference_unless_the_kernel_is_asked_for(monkeypatch):
    def fail(*args):
        raise AssertionError("the kernel ran")
    monkeypatch.setattr(sampling, "compute_probs_triton", fail)
    logits = torch.randn(2, 9)
    args = (logits, torch.ones(2), torch.tensor([0, 3]), torch.tensor([1.0, 0.9]))
    assert torch.equal(compute_probs(*args), compute_probs_ref(*args))
    assert torch.equal(compute_probs(*args, impl="ref"), compute_probs_ref(*args))
    with pytest.raises(AssertionError, match="the kernel ran"):
        compute_probs(*args, impl="triton")
    with pytest.raises(AssertionError, match="impl must be"):
        compute_probs(*args, impl="cuda")


@triton.jit
def _bits_kernel(out_ptr, key, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    ours = sampling._random_bits(tl.full([BLOCK], key, tl.int64), cols)
    tl.store(out_ptr + cols, (ours == tl.randint(key, cols)).to(tl.int32))


def test_the_per_row_philox_draws_tl_rands_bits():
    same = torch.zeros(64, dtype=torch.int32)
    _bits_kernel[(1,)](same, sampling.key_seed(3, 7, SAMPLE), BLOCK=64)
    assert bool(same.all())

