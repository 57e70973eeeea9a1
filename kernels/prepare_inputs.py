"""EAGLE input preparation after verification: which of the last verify batch's tokens the
drafter reads next round (vLLM's EagleProposer.prepare_inputs).

The verify batch held, for request b, n_b tokens at rows cu_num_tokens[b] .. cu_num_tokens[b+1]-1
(the last accepted token and the k_b drafts). After rejection its last num_rejected[b] rows are
stale, so the drafter keeps the first n_b - num_rejected[b] rows of each request, packed:

    cu_num_tokens:   [0, a, a + b, a + b + c]
    num_rejected:    [r1, r2, r3]
    cu_new:          [0, a - r1, a + b - r1 - r2, a + b + c - r1 - r2 - r3]
    token_indices:   [0 .. a - r1 - 1,  a .. a + b - r2 - 1,  a + b .. a + b + c - r3 - 1]

token_indices index the verify batch's rows (hidden states, positions, slot mapping).
They are int64 here (vLLM uses int32), like every other index in this package.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import use_kernel


def prepare_inputs_ref(cu_num_tokens: torch.Tensor, num_rejected: torch.Tensor,
                       num_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_num_tokens: [B+1]; num_rejected: [B] -> cu_new [B+1] int64, token_indices [T'] int64
    (T' = cu_new[-1]; num_tokens, if given, must equal it)."""
    assert cu_num_tokens.ndim == 1 and num_rejected.shape == (cu_num_tokens.shape[0] - 1,)
    cu = cu_num_tokens.to(torch.int64)
    kept = cu[1:] - cu[:-1] - num_rejected.to(torch.int64)  # [B]
    assert bool((kept >= 0).all()), "a request rejected more tokens than it had"
    cu_new = torch.zeros_like(cu)
    torch.cumsum(kept, dim=0, out=cu_new[1:])
    total = int(cu_new[-1])
    assert num_tokens is None or num_tokens == total
    shift = torch.repeat_interleave(cu[:-1] - cu_new[:-1], kept, output_size=total)  # [T']
    return cu_new, torch.arange(total, dtype=torch.int64, device=cu.device) + shift


def prepare_inputs(cu_num_tokens, num_rejected, num_tokens: int | None = None,
                   impl: str | None = None):
    """Dispatch on cu_num_tokens's device (impl as in kernels/__init__.py). Passing num_tokens
    (= the sum of the kept counts) spares the kernel path a device-to-host sync."""
    if use_kernel(impl, cu_num_tokens):
        return prepare_inputs_triton(cu_num_tokens, num_rejected, num_tokens)
    return prepare_inputs_ref(cu_num_tokens, num_rejected, num_tokens)


def prepare_inputs_triton(cu_num_tokens: torch.Tensor, num_rejected: torch.Tensor,
                          num_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As prepare_inputs_ref (without checking num_rejected, which would need a sync)."""
    assert cu_num_tokens.ndim == 1 and num_rejected.shape == (cu_num_tokens.shape[0] - 1,)
    assert not cu_num_tokens.is_floating_point() and not num_rejected.is_floating_point()
    cu = cu_num_tokens.to(torch.int64).contiguous()
    cu_new = torch.zeros_like(cu)
    torch.cumsum(cu[1:] - cu[:-1] - num_rejected.to(cu.device, torch.int64), dim=0,
                 out=cu_new[1:])
    total = int(cu_new[-1]) if num_tokens is None else num_tokens
    token_indices = torch.empty(total, dtype=torch.int64, device=cu.device)
    num_req = cu.shape[0] - 1
    if num_req and total:
        _prepare_inputs_kernel[(num_req,)](token_indices, cu, cu_new, BLOCK=1024)
    return cu_new, token_indices


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _prepare_inputs_kernel(out_ptr, cu_ptr, cu_new_ptr, BLOCK: tl.constexpr):
    # out: [T'] int64; cu: [B+1]; cu_new: [B+1]. Grid: (B,)
    req = tl.program_id(0)
    start_new = tl.load(cu_new_ptr + req)
    n = tl.load(cu_new_ptr + req + 1) - start_new
    start = tl.load(cu_ptr + req)
    for first in range(0, n, BLOCK):
        offs = first + tl.arange(0, BLOCK)
        tl.store(out_ptr + start_new + offs, start + offs, mask=offs < n)
