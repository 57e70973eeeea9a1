"""The draft-token workspace: a pool of slots, one per draft token in flight.

After MLC-LLM's DraftTokenWorkspaceManager: a slot holds what verification needs of one draft
token (its draft probabilities q over the target vocabulary); slots are handed out from a free
list with reference counts (a slot shared by several tree children is freed when the last one
lets go). `num_free` returning to `num_slots` when idle is the leak check.
"""
from __future__ import annotations

import torch

from kernels.workspace import gather_rows, scatter_rows


class DraftWorkspace:
    def __init__(self, num_slots: int, vocab_size: int, dtype=torch.float32, device="cpu",
                 store_probs: bool = True):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._refs = [0] * num_slots
        # [num_slots, V] draft probabilities; allocated lazily on first sampled draft.
        self._probs: torch.Tensor | None = None
        self._shape, self._dtype, self._device = (num_slots, vocab_size), dtype, device

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int, ref_counts: list[int] | None = None) -> list[int] | None:
        """n slots with the given initial reference counts (default 1); None if too few."""
        if n > len(self._free):
            return None
        slots = [self._free.pop() for _ in range(n)]
        for slot, refs in zip(slots, ref_counts or [1] * n):
            assert refs > 0
            self._refs[slot] = refs
        return slots

    def free(self, slots: list[int]) -> None:
        """Drop one reference from each slot; a slot with none left returns to the pool."""
        for slot in slots:
            assert self._refs[slot] > 0, f"slot {slot} freed twice"
            self._refs[slot] -= 1
            if self._refs[slot] == 0:
                self._free.append(slot)

    @property
    def probs(self) -> torch.Tensor:
        if self._probs is None:
            self._probs = torch.zeros(self._shape, dtype=self._dtype, device=self._device)
        return self._probs

    def store(self, slots: list[int], probs: torch.Tensor) -> None:
        """probs: [len(slots), V] -> written into those slots."""
        if slots:
            scatter_rows(self.probs, torch.tensor(slots, device=probs.device), probs)

    def load(self, slots: list[int]) -> torch.Tensor:
        """-> [len(slots), V]"""
        return gather_rows(self.probs, torch.tensor(slots, device=self._device))
