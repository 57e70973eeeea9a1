"""Triton-language kernels for the speculative-decoding hot paths, each beside its PyTorch
reference (the reference is the specification; the kernel must agree with it; paged attention's
has a module of its own, attention_ref.py, which the CPU's row-wise path shares), and C++ kernels
for CPUs with AVX2 (cpu.cpp, loaded by cpu.py): the row-invariant fp32 linear and attention,
and fp32's RMSNorm and RoPE + KV write.

Every public function takes `impl`: None runs the kernel on CUDA tensors and the reference on
CPU tensors; "triton" forces the kernel (on CPU this needs TRITON_INTERPRET=1 set before triton
is imported, as tests/conftest.py does); "ref" forces the reference.
"""
from __future__ import annotations

import torch

IMPLS = ("triton", "ref")


def use_kernel(impl: str | None, tensor: torch.Tensor) -> bool:
    """Whether a call with this `impl` on data living where `tensor` lives runs the kernel."""
    if impl is None:
        return tensor.is_cuda
    assert impl in IMPLS, f"impl must be one of {IMPLS} or None, not {impl!r}"
    return impl == "triton"


def on(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` as a contiguous `dtype` tensor on `device`, converted only where it is not one
    already (a launcher's metadata is usually in place: no copy, and no host sync on a GPU)."""
    if tensor.device != device:
        tensor = tensor.to(device)
    if tensor.dtype != dtype:
        tensor = tensor.view(dtype) if tensor.dtype == torch.bool and dtype == torch.int8 \
            else tensor.to(dtype)
    return tensor.contiguous()
