"""RMSNorm on CPU in one call: eagle_serve/kernels/cpu.cpp's `rms_norm` (fp32, AVX2 + FMA) instead of HF's
six PyTorch ops a norm (cast, square, mean, rsqrt, two products), each paying PyTorch's dispatch:
a fp32 decode step of the default target runs 61 norms. Every row is normed on its own by one
instruction sequence, so a verify row's norm is its decode step's, bitwise (as with the linears
of cpu_matmul). Results equal HF's up to float rounding (the sum of squares is summed in another
order). Other dtypes (bf16, the float64 of the exactness tests), autograd and CPUs where the
kernels do not build run HF's module unchanged.
"""
from __future__ import annotations

import torch
from torch import nn

from eagle_serve.kernels.cpu import cpu_kernels


class CpuRMSNorm(nn.Module):
    """Inference drop-in for an HF RMSNorm on CPU: x [..., H] -> [..., H]."""

    def __init__(self, norm: nn.Module, plus_one: bool):
        """norm: HF's module (weight [H]; variance_epsilon or eps); plus_one: it scales by
        1 + weight (Gemma's)."""
        super().__init__()
        self.weight = norm.weight  # the same parameter: state dicts keep their names
        self.eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", None)))
        self.plus_one = plus_one
        object.__setattr__(self, "hf", norm)  # the fallback, not a submodule (no second weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if x.dtype == torch.float32 == self.weight.dtype and not grad:
            scale = self.weight + 1 if self.plus_one else self.weight
            return cpu_kernels().rms_norm(x, scale, self.eps)
        return self.hf(x)


def use_cpu_norms(model: nn.Module, plus_one: bool = False) -> nn.Module:
    """Replace every HF RMSNorm (by class name) inside `model` by a CpuRMSNorm, in place, where
    the kernels run: on CPU, width a multiple of 8, kernels built -> model."""
    if cpu_kernels() is None:
        return model
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if (type(child).__name__.endswith("RMSNorm") and child.weight.device.type == "cpu"
                    and child.weight.shape[-1] % 8 == 0):
                setattr(module, name, CpuRMSNorm(child, plus_one))
    return model
