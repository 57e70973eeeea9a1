"""Scatter into and gather from workspace slots: the kernels equal the references exactly."""
from __future__ import annotations

import pytest
import torch

from eagle_serve.kernels.workspace import gather_rows, gather_rows_ref, scatter_rows, scatter_rows_ref


@pytest.mark.parametrize("slots_count, width, rows", [(11, 111, 7), (5, 49152, 3), (4, 96, 1)])
def test_scatter_then_gather_round_trips_exactly(slots_count, width, rows):
    gen = torch.Generator().manual_seed(width)
    slots = torch.randperm(slots_count, generator=gen)[:rows]
    values = torch.randn(rows, width, generator=gen)
    store, expected = torch.zeros(slots_count, width), torch.zeros(slots_count, width)
    scatter_rows(store, slots, values, impl="triton")
    scatter_rows_ref(expected, slots, values)
    assert torch.equal(store, expected)
    assert torch.equal(gather_rows(store, slots, impl="triton"), gather_rows_ref(store, slots))
    assert torch.equal(gather_rows(store, slots, impl="triton"), values)


def test_scatter_casts_to_the_store_dtype_like_the_reference():
    # float32 values a bfloat16 holds exactly: the interpreter truncates where a GPU rounds.
    values = (torch.randn(3, 40) * 100).bfloat16().float()
    store = torch.zeros(6, 40, dtype=torch.bfloat16)
    expected = store.clone()
    slots = torch.tensor([5, 0, 2])
    scatter_rows(store, slots, values, impl="triton")
    scatter_rows_ref(expected, slots, values)
    assert torch.equal(store, expected)


def test_padding_slots_are_skipped_on_scatter_and_read_as_zero():
    store = torch.full((4, 9), 7.0)
    scatter_rows(store, torch.tensor([-1, 2, -1]), torch.ones(3, 9), impl="triton")
    assert store[2].tolist() == [1.0] * 9 and bool((store[[0, 1, 3]] == 7).all())
    out = gather_rows(store, torch.tensor([2, -1]), impl="triton")
    assert out[0].tolist() == [1.0] * 9 and out[1].tolist() == [0.0] * 9


def test_empty_slot_lists_move_nothing():
    store = torch.ones(3, 5)
    scatter_rows(store, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 5), impl="triton")
    assert bool((store == 1).all())
    assert gather_rows(store, torch.zeros(0, dtype=torch.int64), impl="triton").shape == (0, 5)
