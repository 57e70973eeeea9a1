"""CPU linears (oneDNN inner products on dense tensors) compute what nn.Linear computes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from eagle_serve.checkpoints import load_drafter
from eagle_serve.cpu_matmul import CpuLinear
from eagle_serve.target import TargetModel


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_cpu_linear_matches_nn_linear_for_zero_to_nine_rows(dtype, tol, bias):
    torch.manual_seed(0)
    linear = nn.Linear(24, 40, bias=bias).to(dtype)
    ours = CpuLinear(linear)
    with torch.inference_mode():
        for rows in range(0, 10):
            x = torch.randn(rows, 24, dtype=dtype)
            out = ours(x)
            assert out.shape == (rows, 40) and out.dtype == dtype
            torch.testing.assert_close(out, linear(x), rtol=tol, atol=tol)
        x = torch.randn(2, 3, 24, dtype=dtype)  # leading dims are kept
        torch.testing.assert_close(ours(x), linear(x), rtol=tol, atol=tol)
    assert torch.equal(ours.weight, linear.weight)
    assert ours.onednn == (dtype == torch.float32)
    assert ours.weight.data_ptr() == linear.weight.data_ptr()  # no copy


def test_the_cpu_target_and_drafter_run_cpu_linears_only(tiny_target, eagle3_head):
    target = TargetModel(tiny_target, dtype=torch.float64, num_pages=8, page_size=4)
    drafter = load_drafter(eagle3_head, tiny_target, dtype=torch.float64, num_pages=8, page_size=4)
    for model in (target.hf, drafter.head):
        kinds = {type(m) for m in model.modules()}
        assert nn.Linear not in kinds and CpuLinear in kinds
    assert target.lm_head.weight.shape == (target.vocab_size, target.config.hidden_size)
