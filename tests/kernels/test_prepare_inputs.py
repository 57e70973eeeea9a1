"""EAGLE input preparation after rejections: the kernel equals the reference exactly."""
from __future__ import annotations

import itertools

import pytest
import torch

from kernels.prepare_inputs import prepare_inputs, prepare_inputs_ref


def test_rejected_tokens_are_dropped_from_the_end_of_each_request():
    cu = torch.tensor([0, 4, 7, 12])  # a = 4, b = 3, c = 5 verify tokens
    rejected = torch.tensor([1, 0, 3])
    for impl in ("ref", "triton"):
        cu_new, indices = prepare_inputs(cu, rejected, impl=impl)
        assert cu_new.tolist() == [0, 3, 6, 8]
        assert indices.tolist() == [0, 1, 2, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("num_req", [1, 7])
def test_kernel_equals_the_reference_on_ragged_batches(num_req):
    gen = torch.Generator().manual_seed(num_req)
    lengths = torch.randint(1, 9, (num_req,), generator=gen)
    lengths[0] = 1500  # a prefill longer than one 1024-wide block
    rejected = (torch.rand(num_req, generator=gen) * lengths).long()
    rejected[-1] = lengths[-1]  # a request that keeps nothing
    cu = torch.tensor([0] + list(itertools.accumulate(lengths.tolist())))
    ref = prepare_inputs_ref(cu, rejected)
    kernel = prepare_inputs(cu, rejected, impl="triton")
    given = prepare_inputs(cu, rejected, num_tokens=int(ref[0][-1]), impl="triton")
    for got in (kernel, given):
        assert got[0].tolist() == ref[0].tolist() and got[1].tolist() == ref[1].tolist()


def test_nothing_kept_gives_no_indices():
    cu_new, indices = prepare_inputs(torch.tensor([0, 2, 3]), torch.tensor([2, 1]), impl="triton")
    assert cu_new.tolist() == [0, 0, 0] and indices.numel() == 0
