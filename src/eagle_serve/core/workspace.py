"""The draft-token workspace: a pool of slots, one per draft token in flight.

After MLC-LLM's DraftTokenWorkspaceManager: a slot holds what verification needs of one draft
token (its draft probabilities q over the target vocabulary); slots are handed out from a free
list, each owned by one draft token until its request frees it. `num_free` returning to
`num_slots` when idle is the leak check.
"""
from __future__ import annotations

import torch

from eagle_serve.kernels.workspace import gather_rows, scatter_rows


class DraftWorkspace:
    def __init__(self, num_slots: int, vocab_size: int, dtype=torch.float32, device="cpu"):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._in_use = [False] * num_slots
        # [num_slots, V] draft probabilities; allocated lazily on first sampled draft.
        self._probs: torch.Tensor | None = None
        self._shape, self._dtype, self._device = (num_slots, vocab_size), dtype, device

    @property
    def vocab_size(self) -> int:
        return self._shape[1]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n slots; None if too few are free."""
        if n > len(self._free):
            return None
        slots = [self._free.pop() for _ in range(n)]
        for slot in slots:
            self._in_use[slot] = True
        return slots

    def free(self, slots: list[int]) -> None:
        """Return slots to the pool."""
        for slot in slots:
            assert self._in_use[slot], f"slot {slot} freed twice"
            self._in_use[slot] = False
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
