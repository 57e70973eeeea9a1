"""The decoder layer's small ops fused, for the GPU path: one launch each where PyTorch makes
several, each row computed by one program (so a row's result never depends on how many rows
the batch holds: a verify pass and a decode step round a token's hidden state alike).

- add_rms_norm: the residual add and the RMSNorm after it (HF's LlamaRMSNorm arithmetic:
  float32 statistics, the normalized row rounded to the model's dtype before the weight);
  9 launches in PyTorch, 1 here.
- rope_write_kv: RoPE on q and k (HF's apply_rotary_pos_emb, each product rounded as PyTorch
  rounds it, so bf16 results equal the reference bitwise), the KV cache write, and q written
  contiguous for attention; ~10 launches in PyTorch, 1 here.
- silu_mul: SiLU(gate) * up over the fused gate/up projection's output; 2 launches and a
  strided copy in PyTorch, 1 here.

Each has its PyTorch reference beside it (`*_ref`, the specification) and a dispatcher taking
`impl` as in eagle_serve/kernels/__init__.py. Float64 runs the references only (not served on
a GPU; the exactness tests' dtype).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagle_serve.kernels import use_kernel
from eagle_serve.kernels.paged_attention import write_kv_ref


def fused_layers_run(tensor: torch.Tensor, impl: str | None = None) -> bool:
    """Whether a model whose data lives where `tensor` lives runs its layers on these kernels."""
    return use_kernel(impl, tensor) and tensor.dtype != torch.float64


# ----------------------------------------------------------------------------- references


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H] (residual None: x alone); weight: [H]
    -> (rms_norm(x + residual) * weight [T, H], x + residual [T, H])"""
    total = x if residual is None else x + residual
    h = total.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(total.dtype), total


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first R dims of every head (R = D, or less for partial rotary as Phi-3 may).

    q: [T, Hq, D]; k: [T, Hkv, D]; cos, sin: [T, R] -> q, k (views of one [T, Hq + Hkv, D]
    tensor; the arithmetic of HF's apply_rotary_pos_emb, so float64 results equal HF's exactly)
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, R]
    r = cos.shape[-1]
    qk = torch.cat([q, k], dim=1)  # [T, Hq + Hkv, D]: one rotation for both
    part = qk[..., :r]
    half = torch.cat((-part[..., r // 2:], part[..., :r // 2]), dim=-1)
    out = (part * cos) + (half * sin)
    out = out if r == qk.shape[-1] else torch.cat([out, qk[..., r:]], dim=-1)
    return out.split([q.shape[1], k.shape[1]], dim=1)


def rope_write_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; cos, sin: [T, R]; caches [P, page, Hkv, D];
    slot_mapping: [T] (-1 = skip) -> rotated q [T, Hq, D] (k rotated and v written to the cache;
    q a view, where the kernel writes it contiguous)"""
    q, k = apply_rope(q, k, cos, sin)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] (gate, up side by side) -> silu(gate) * up [T, I]"""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# ----------------------------------------------------------------------------- dispatchers


def add_rms_norm(x, residual, weight, eps, impl: str | None = None):
    """As add_rms_norm_ref, on the kernel where fused_layers_run(x, impl)."""
    if fused_layers_run(x, impl):
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, impl: str | None = None):
    """As rope_write_kv_ref, on the kernel where fused_layers_run(q, impl)."""
    if fused_layers_run(q, impl):
        return rope_write_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return rope_write_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def silu_mul(gate_up, impl: str | None = None):
    """As silu_mul_ref, on the kernel where fused_layers_run(gate_up, impl)."""
    if fused_layers_run(gate_up, impl):
        return silu_mul_triton(gate_up)
    return silu_mul_ref(gate_up)


# ----------------------------------------------------------------------------- launchers


def norm_block(hidden: int) -> int:
    """BLOCK_H of _add_rms_norm_kernel: the whole row in one program (row-invariant)."""
    return triton.next_power_of_2(hidden)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.ndim == 2 and x.stride(1) == 1 and weight.shape == (x.shape[1],)
    assert residual is None or (residual.shape == x.shape and residual.stride(1) == 1)
    tokens, hidden = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    total = x if residual is None else torch.empty_like(out)
    if tokens:
        r = x if residual is None else residual
        _add_rms_norm_kernel[(tokens,)](
            x, r, weight, out, total, hidden, float(eps), x.stride(0), r.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK_H=norm_block(hidden))
    return out, total


def rope_write_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """q, k, v may be strided views (of the fused q/k/v projection): the last dim contiguous."""
    tokens, q_heads, head_dim = q.shape
    kv_heads, rotary = k.shape[1], cos.shape[1]
    assert k.shape == v.shape == (tokens, kv_heads, head_dim) and cos.shape == sin.shape
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and rotary % 2 == 0 and rotary <= head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == k.shape[1:]
    out = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype, device=q.device)
    if tokens:
        cos, sin = cos.contiguous(), sin.contiguous()
        _rope_write_kv_kernel[(tokens,)](
            q, k, v, cos, sin, slot_mapping, out, k_cache, v_cache,
            k_cache.shape[0] * k_cache.shape[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), Q_HEADS=q_heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
            ROTARY=rotary, BLOCK_H=triton.next_power_of_2(max(q_heads, kv_heads)),
            BLOCK_D=triton.next_power_of_2(head_dim))
    return out


SILU_BLOCK = 1024  # columns a program of _silu_mul_kernel covers


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    assert gate_up.ndim == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, width), dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        _silu_mul_kernel[(tokens, triton.cdiv(width, SILU_BLOCK))](
            gate_up, out, width, gate_up.stride(0), BLOCK=SILU_BLOCK)
    return out


# ----------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["stride_x", "stride_r"])
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, total_ptr, H, eps, stride_x, stride_r,
                         HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr):
    # x, r: [T, H] rows stride_x, stride_r apart; w: [H]; out, total: [T, H] contiguous.
    # Grid: (T,): one program per row, the whole row in one block.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # rounded to the model's dtype, as PyTorch's add rounds it
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(total_ptr + row * H + cols, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / H
    normed = (h * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * H + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate(x_ptr, rows, d, mask, cos, sin, ROTARY: tl.constexpr):
    # One head block [BLOCK_H, BLOCK_D] rotated: x * cos + rotate_half(x) * sin on the first
    # ROTARY dims (each product and the sum rounded to the model's dtype), the rest unchanged.
    half = ROTARY // 2
    partner = tl.where(d < half, d + half, d - half)
    x = tl.load(x_ptr + rows[:, None] + d[None, :], mask=mask, other=0.0)
    xp = tl.load(x_ptr + rows[:, None] + partner[None, :], mask=mask & (d < ROTARY)[None, :], other=0.0)
    xp = tl.where((d < half)[None, :], -xp.to(tl.float32), xp.to(tl.float32))
    dtype = x_ptr.dtype.element_ty
    a = (x.to(tl.float32) * cos[None, :]).to(dtype)
    b = (xp * sin[None, :]).to(dtype)
    rotated = (a.to(tl.float32) + b.to(tl.float32)).to(dtype)
    return tl.where((d < ROTARY)[None, :], rotated, x)


@triton.jit(do_not_specialize=["S", "stride_qt", "stride_qh", "stride_kt", "stride_kh",
                               "stride_vt", "stride_vh"])
def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, out_ptr, k_cache_ptr,
                          v_cache_ptr, S, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                          stride_vh, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                          HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    # q: [T, Q_HEADS, HEAD_DIM], k, v: [T, KV_HEADS, HEAD_DIM] strided; cos, sin: [T, ROTARY];
    # slots: [T] (-1 = skip); out: [T, Q_HEADS, HEAD_DIM] contiguous; caches: [S, KV_HEADS * HEAD_DIM].
    # Grid: (T,): one program per token, every head.
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    cos = tl.load(cos_ptr + t * ROTARY + d, mask=d < ROTARY, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * ROTARY + d, mask=d < ROTARY, other=0.0).to(tl.float32)
    in_head = (d < HEAD_DIM)[None, :]
    q_mask = (h < Q_HEADS)[:, None] & in_head
    q = _rotate(q_ptr, t * stride_qt + h * stride_qh, d, q_mask, cos, sin, ROTARY)
    tl.store(out_ptr + (t * Q_HEADS + h)[:, None] * HEAD_DIM + d[None, :], q, mask=q_mask)
    slot = tl.load(slots_ptr + t + tl.zeros([BLOCK_H], tl.int64))  # [BLOCK_H]: the token's, per head
    kv_mask = ((h < KV_HEADS) & (slot >= 0) & (slot < S))[:, None] & in_head
    dst = slot[:, None] * (KV_HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :]
    k = _rotate(k_ptr, t * stride_kt + h * stride_kh, d, kv_mask, cos, sin, ROTARY)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    v = tl.load(v_ptr + (t * stride_vt + h * stride_vh)[:, None] + d[None, :], mask=kv_mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit(do_not_specialize=["I", "stride_t"])
def _silu_mul_kernel(gate_up_ptr, out_ptr, I, stride_t, BLOCK: tl.constexpr):
    # gate_up: [T, 2I] rows stride_t apart (gate, up side by side); out: [T, I] contiguous.
    # Grid: (T, cdiv(I, BLOCK))
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(gate_up_ptr + t * stride_t + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + t * stride_t + I + cols, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # rounded, as PyTorch's silu output is
    tl.store(out_ptr + t * I + cols, (act.to(tl.float32) * up.to(tl.float32)).to(dtype), mask=mask)
