"""Scatter rows (draft probabilities, hidden states) into workspace slots and gather them back.

A workspace is a [S, D] store, one row per slot; a slot is reserved by whoever owns it (the
engine's workspace), these functions only move rows. The kernels tile rows x columns and
skip slots < 0 (padding); the references expect valid slots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagle_serve.kernels import on, use_kernel


def scatter_rows_ref(store: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """store: [S, D]; slots: [N] int64; rows: [N, D] -> store[slots[i]] = rows[i]"""
    assert store.ndim == 2 and rows.shape == (slots.shape[0], store.shape[1])
    store.index_copy_(0, slots, rows.to(store.dtype))


def gather_rows_ref(store: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """store: [S, D]; slots: [N] int64 -> [N, D]"""
    return store.index_select(0, slots)


def scatter_rows(store, slots, rows, impl: str | None = None):
    """Dispatch on store's device (impl as in eagle_serve/kernels/__init__.py)."""
    if use_kernel(impl, store):
        return scatter_rows_triton(store, slots, rows)
    return scatter_rows_ref(store, slots, rows)


def gather_rows(store, slots, impl: str | None = None):
    """Dispatch on store's device (impl as in eagle_serve/kernels/__init__.py)."""
    if use_kernel(impl, store):
        return gather_rows_triton(store, slots)
    return gather_rows_ref(store, slots)


def row_tile(n: int, d: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_D) for n rows of width d (eagle_serve/kernels/warmup.py enumerates them)."""
    block_d = min(triton.next_power_of_2(max(d, 1)), 1024)
    return min(triton.next_power_of_2(max(n, 1)), max(1, 4096 // block_d)), block_d


def scatter_rows_triton(store: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """As scatter_rows_ref; slots < 0 are skipped."""
    assert store.ndim == 2 and store.stride(1) == 1, "store: [S, D], rows contiguous"
    assert slots.ndim == 1 and not slots.is_floating_point()
    assert rows.shape == (slots.shape[0], store.shape[1])
    n, d = rows.shape
    if n == 0:
        return
    rows = on(rows, store.device, rows.dtype)
    block_n, block_d = row_tile(n, d)
    _scatter_rows_kernel[(triton.cdiv(n, block_n), triton.cdiv(d, block_d))](
        store, on(slots, store.device, torch.int64), rows, n, d, store.shape[0],
        store.stride(0), rows.stride(0), BLOCK_N=block_n, BLOCK_D=block_d)


def gather_rows_triton(store: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """As gather_rows_ref; rows for slots < 0 are zero."""
    assert store.ndim == 2 and store.stride(1) == 1, "store: [S, D], rows contiguous"
    assert slots.ndim == 1 and not slots.is_floating_point()
    n, d = slots.shape[0], store.shape[1]
    out = torch.empty((n, d), dtype=store.dtype, device=store.device)
    if n == 0:
        return out
    block_n, block_d = row_tile(n, d)
    _gather_rows_kernel[(triton.cdiv(n, block_n), triton.cdiv(d, block_d))](
        store, on(slots, store.device, torch.int64), out, n, d, store.shape[0],
        store.stride(0), out.stride(0), BLOCK_N=block_n, BLOCK_D=block_d)
    return out


# ----------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["N"])
def _scatter_rows_kernel(store_ptr, slots_ptr, rows_ptr, N, D, S, stride_store, stride_rows,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # store: [S, D]; slots: [N] int64; rows: [N, D]. Grid: (cdiv(N, BLOCK_N), cdiv(D, BLOCK_D))
    i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D))[None, :]
    slot = tl.load(slots_ptr + i, mask=i < N, other=-1)
    mask = ((i < N) & (slot >= 0) & (slot < S))[:, None] & (cols < D)
    x = tl.load(rows_ptr + i.to(tl.int64)[:, None] * stride_rows + cols, mask=mask)
    tl.store(store_ptr + slot[:, None] * stride_store + cols,
             x.to(store_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["N"])
def _gather_rows_kernel(store_ptr, slots_ptr, out_ptr, N, D, S, stride_store, stride_out,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # store: [S, D]; slots: [N] int64; out: [N, D]. Grid as _scatter_rows_kernel.
    i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D))[None, :]
    slot = tl.load(slots_ptr + i, mask=i < N, other=-1)
    valid = ((slot >= 0) & (slot < S))[:, None] & (cols < D)
    x = tl.load(store_ptr + slot[:, None] * stride_store + cols, mask=valid, other=0)
    tl.store(out_ptr + i.to(tl.int64)[:, None] * stride_out + cols, x,
             mask=(i < N)[:, None] & (cols < D))
