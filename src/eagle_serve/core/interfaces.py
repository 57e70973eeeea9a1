"""What the engine sends to the target and drafter, and what comes back.

The engine talks to both models only through `TargetRunner.forward` and
`DrafterRunner.propose`, with plain tensors, so the same engine drives in-process models
(tests, library use) and Triton BLS calls (the `spec_decode` model). The engine owns the page
tables; the models own the KV tensors and write where the slot mapping says.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from eagle_serve.core.processors import LogitsProcessors


class KVLost(RuntimeError):
    """A model process lost its KV cache (it restarted); every running request recomputes."""


class ModelUnavailable(RuntimeError):
    """A model process is stuck (a call did not return in time) or dead: the engine cannot go
    on until the server restarts."""


@dataclass
class RaggedBatch:
    """New tokens of several requests in one flat batch, against a paged KV cache.

    Request b owns rows cu_seqlens[b]:cu_seqlens[b+1]; they are stored at its positions
    seq_lens[b] - n_b .. seq_lens[b] - 1 (slot_mapping). `positions` are the RoPE positions:
    the same for a chain, the prefix length + depth for draft-tree nodes. With `tree_mask`,
    row i of request b sees its new row j only where tree_mask[b, i, j] (its ancestors and
    itself); None = causal.
    """
    input_ids: torch.Tensor     # [T] int64
    positions: torch.Tensor     # [T] int64: RoPE positions
    cu_seqlens: torch.Tensor    # [B+1] int64
    seq_lens: torch.Tensor      # [B] int64: context length after this forward
    block_tables: torch.Tensor  # [B, P] int64, -1 padded
    slot_mapping: torch.Tensor  # [T] int64: page * page_size + offset
    tree_mask: torch.Tensor | None = None  # [B, Qt, Qt] bool, Qt >= every n_b; None = causal
    max_query_len: int | None = None  # the largest n_b, known on the host (None: read from
    #                                   cu_seqlens where needed, a host sync on a GPU)
    plans: dict = field(default_factory=dict, repr=False, compare=False)  # what the attention
    #                                   kernels plan from the fields above at a forward's first
    #                                   layer, for the others (fields are never changed)

    @classmethod
    def staged(cls, fields: dict[str, torch.Tensor], max_query_len: int) -> "RaggedBatch":
        """From eagle_serve.core.staging's views: input_ids, positions, cu_seqlens, seq_lens,
        block_tables, slot_mapping (and tree_mask, if staged)."""
        return cls(fields["input_ids"], fields["positions"], fields["cu_seqlens"],
                   fields["seq_lens"], fields["block_tables"], fields["slot_mapping"],
                   tree_mask=fields.get("tree_mask"), max_query_len=max_query_len)


@dataclass
class RowSampling:
    """Sampling parameters per row (a row is a request in drafting, a position in verifying)."""
    temperature: torch.Tensor  # [R] float32; 0 = greedy
    top_k: torch.Tensor        # [R] int64; 0 = off
    top_p: torch.Tensor        # [R] float32
    seeds: torch.Tensor        # [R] int64
    sampled_rows: torch.Tensor | None = None  # [S] int64: the rows with temperature > 0, as
    #                            the host knew them (None: found from temperature, a host sync)

    @property
    def sampled(self) -> torch.Tensor:  # [R] bool
        return self.temperature > 0

    def sampled_indices(self) -> torch.Tensor:
        """[S] int64 the sampled rows (S = 0: none; the shape is known on the host)."""
        if self.sampled_rows is not None:
            return self.sampled_rows
        return self.sampled.nonzero().squeeze(1)

    @classmethod
    def staged(cls, fields: dict[str, torch.Tensor]) -> "RowSampling":
        """From eagle_serve.core.staging's views of verify.sampling_fields."""
        return cls(*(fields[f] for f in ("temperature", "top_k", "top_p", "seeds", "sampled_rows")))

    def select(self, rows: torch.Tensor) -> "RowSampling":
        return RowSampling(self.temperature[rows], self.top_k[rows], self.top_p[rows],
                           self.seeds[rows])


@dataclass
class DraftShapes:
    """What each request of a drafter call drafts (the draft policy's decision), per row [B]."""
    num_drafts: torch.Tensor   # int64: nodes to propose (a chain: its length)
    topk: torch.Tensor         # int64: children per tree node; 1 = a chain (rejection-sampled rows: 1)
    depth: torch.Tensor        # int64: tree levels
    min_prob: torch.Tensor     # float32: greedy drafts below this path probability are dropped
    #                            (the first is always kept; sampled chains: the product of their
    #                            q's top probabilities, the first included); 0 = off
    expand_prob: torch.Tensor  # float32: draft a deeper level only while a draft of the level
    #                            reaches this; 0 = off
    coupled: torch.Tensor | None = None  # bool: sampled rows that draft as greedy rows do, by
    #                            the target's own sampling race (kernels.sampling.coupled_scores)
    #                            instead of drawing from q; None = no such row

    def coupled_rows(self) -> torch.Tensor:
        """[B] bool: `coupled`, all False where it is None."""
        if self.coupled is None:
            return torch.zeros_like(self.num_drafts, dtype=torch.bool)
        return self.coupled

    @classmethod
    def chains(cls, num_drafts: torch.Tensor) -> "DraftShapes":
        zeros = torch.zeros_like(num_drafts, dtype=torch.float32)
        return cls(num_drafts, torch.ones_like(num_drafts), num_drafts.clone(), zeros, zeros.clone())


@dataclass
class TargetOutput:
    hidden: torch.Tensor  # [T, F]: the features the drafter reads (F = H, or 3H for EAGLE-3)
    argmax: torch.Tensor  # [R] int64: target argmax at each requested row
    probs: torch.Tensor   # [R_sampled, V]: processed probabilities of the sampled rows, in order
    logprobs: torch.Tensor | None = None  # [L, V] log-softmax of the processors' logprob rows


@dataclass
class DraftOutput:
    """Drafts of each request as a tree in topological order (a chain: parents -1, 0, 1, ...)."""
    tokens: torch.Tensor  # [B, max_k] int64 target-vocabulary ids, -1 padded
    probs: torch.Tensor   # [N_sampled, V] draft probabilities q of sampled requests' drafts,
    #                       request-major, draft order (sampled requests draft chains)
    parents: torch.Tensor | None = None  # [B, max_k] int64: index of the parent node in the
    #                       same row, -1 = the root (the last verified token), -1 padded;
    #                       None = every row is a chain
    scores: torch.Tensor | None = None   # [B, max_k] cumulative draft log-probability of tree
    #                       nodes (in-process only; tests and diagnostics)


def tree_depths(parents: list[int]) -> list[int]:
    """Depth (1-based) of each node of a topologically ordered tree."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def ancestor_mask(parents: list[int]) -> np.ndarray:
    """[N, N] bool (host): node i sees node j where j is i or one of its ancestors."""
    mask = np.eye(len(parents), dtype=np.bool_)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


class TargetRunner(Protocol):
    feature_size: int
    vocab_size: int

    def forward(self, batch: RaggedBatch, logit_rows: torch.Tensor, sampling: RowSampling,
                kv_moves: tuple[torch.Tensor, torch.Tensor] | None = None,
                processors: LogitsProcessors | None = None) -> TargetOutput:
        """kv_moves: (src_slots [M], dst_slots [M]) int64: copy every layer's K/V from src to
        dst before the forward writes anything (the accepted path of a draft tree); processors:
        what the requests' parameters do to the scored rows' logits (eagle_serve.core.processors)."""
        ...


class DrafterRunner(Protocol):
    def propose(self, batch: RaggedBatch, features: torch.Tensor, shapes: DraftShapes,
                sampling: RowSampling) -> DraftOutput:
        """Catch up on the batch's rows (features [T, F]) and draft for each request as its row
        of `shapes` says: a chain, or (greedy, topk > 1) an EAGLE-2 dynamic tree."""
        ...
