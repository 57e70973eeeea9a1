"""Scatter rows (draft probabilities, hidden states) into workspace slots and gather them back."""
from __future__ import annotations

import torch


def scatter_rows_ref(store: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """store: [S, D]; slots: [N] int64; rows: [N, D] -> store[slots[i]] = rows[i]"""
    assert store.ndim == 2 and rows.shape == (slots.shape[0], store.shape[1])
    store.index_copy_(0, slots, rows.to(store.dtype))


def gather_rows_ref(store: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """store: [S, D]; slots: [N] int64 -> [N, D]"""
    return store.index_select(0, slots)


def scatter_rows(store, slots, rows, impl: str | None = None):
    return scatter_rows_ref(store, slots, rows)


def gather_rows(store, slots, impl: str | None = None):
    return gather_rows_ref(store, slots)
