"""What the engine sends to the target and drafter, and what comes back.

The engine talks to both models only through `TargetRunner.forward` and
`DrafterRunner.propose`, with plain tensors, so the same engine drives in-process models
(tests, library use) and Triton BLS calls (the `spec_decode` model). The engine owns the page
tables; the models own the KV tensors and write where the slot mapping says.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class KVLost(RuntimeError):
    """A model process lost its KV cache (it restarted); every running request recomputes."""


@dataclass
class RaggedBatch:
    """New tokens of several requests in one flat batch, against a paged KV cache.

    Request b owns rows cu_seqlens[b]:cu_seqlens[b+1]; they are its positions
    seq_lens[b] - n_b .. seq_lens[b] - 1.
    """
    input_ids: torch.Tensor     # [T] int64
    positions: torch.Tensor     # [T] int64
    cu_seqlens: torch.Tensor    # [B+1] int64
    seq_lens: torch.Tensor      # [B] int64: context length after this forward
    block_tables: torch.Tensor  # [B, P] int64, -1 padded
    slot_mapping: torch.Tensor  # [T] int64: page * page_size + offset

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    def to(self, device) -> "RaggedBatch":
        return RaggedBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


@dataclass
class RowSampling:
    """Sampling parameters per row (a row is a request in drafting, a position in verifying)."""
    temperature: torch.Tensor  # [R] float32; 0 = greedy
    top_k: torch.Tensor        # [R] int64; 0 = off
    top_p: torch.Tensor        # [R] float32
    seeds: torch.Tensor        # [R] int64

    @property
    def sampled(self) -> torch.Tensor:  # [R] bool
        return self.temperature > 0

    def select(self, rows: torch.Tensor) -> "RowSampling":
        return RowSampling(self.temperature[rows], self.top_k[rows], self.top_p[rows],
                           self.seeds[rows])


@dataclass
class TargetOutput:
    hidden: torch.Tensor  # [T, F]: the features the drafter reads (F = H, or 3H for EAGLE-3)
    argmax: torch.Tensor  # [R] int64: target argmax at each requested row
    probs: torch.Tensor   # [R_sampled, V]: processed probabilities of the sampled rows, in order


@dataclass
class DraftOutput:
    tokens: torch.Tensor  # [B, max_k] int64 target-vocabulary ids, -1 padded
    probs: torch.Tensor   # [N_sampled, V] draft probabilities q of sampled requests' drafts,
    #                       request-major, draft order


class TargetRunner(Protocol):
    feature_size: int
    vocab_size: int

    def forward(self, batch: RaggedBatch, logit_rows: torch.Tensor,
                sampling: RowSampling) -> TargetOutput: ...


class DrafterRunner(Protocol):
    def propose(self, batch: RaggedBatch, features: torch.Tensor, num_drafts: torch.Tensor,
                sampling: RowSampling) -> DraftOutput: ...
