"""CUDA graphs for the target's decode and verify forwards: one launch from the host instead
of a few hundred, which on a GPU is most of a small model's step.

A graph replays fixed kernels on fixed buffers, so batches are padded into buckets: B
requests into the next of BATCH_BUCKETS, each with at most Q new tokens (Q = the batch's
largest n_b: 1 for decode, k + 1 or a tree's size for verification), laid out in T = B * Q
token rows. Padding is written nowhere and changes no real row:

  - padded tokens (rows past the batch's T) have slot -1 (the KV write skips them) and belong
    to no request, so attention never reads them; their rows of every other op are their own;
  - padded requests have no new tokens and a context of 0: attention does nothing for them.

Rows are independent through the forward (the norms and RoPE run one program per row, the
linears are row-wise products), so a padded batch's real rows hold what the unpadded
forward computes, up to the GEMM's choice of algorithm for the padded height (bitwise on
the row-invariant CPU path: tests/models/test_graphs.py).

Graphs are captured at a bucket's first use (a few forwards' time, once) and share one memory
pool. Prefill (more than MAX_QUERIES new tokens for a request) and larger batches run eagerly.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from eagle_serve.core.interfaces import RaggedBatch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
MAX_QUERIES = 16  # new tokens of one request that a graph takes (verification of k <= 15)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # RoPE tables that never change


def graphable(rotary) -> bool:
    """Whether a model's RoPE module computes its tables without host logic (HF's dynamic
    kinds grow theirs with the sequence: not replayable)."""
    return getattr(rotary, "rope_type", "default") in STATIC_ROPE


@dataclass(frozen=True)
class Bucket:
    requests: int   # padded B
    queries: int    # Q: the most new tokens of a request
    tree: bool      # a draft-tree mask is passed

    @property
    def tokens(self) -> int:
        return self.requests * self.queries


def bucket_of(batch: RaggedBatch) -> Bucket | None:
    """The bucket that holds this batch, or None (prefill, or more requests than any bucket)."""
    requests, queries = batch.seq_lens.shape[0], batch.max_query_len
    if queries is None or not 0 < queries <= MAX_QUERIES or requests > BATCH_BUCKETS[-1]:
        return None
    padded = next(b for b in BATCH_BUCKETS if b >= requests)
    return Bucket(padded, queries, batch.tree_mask is not None)


class StaticBatch:
    """The buffers one bucket's graph reads, and the copy of a batch into them."""

    def __init__(self, bucket: Bucket, max_pages: int, device: torch.device):
        b, t, q = bucket.requests, bucket.tokens, bucket.queries
        i64 = dict(dtype=torch.int64, device=device)
        self.bucket = bucket
        self.batch = RaggedBatch(
            input_ids=torch.zeros(t, **i64), positions=torch.zeros(t, **i64),
            cu_seqlens=torch.zeros(b + 1, **i64), seq_lens=torch.zeros(b, **i64),
            block_tables=torch.zeros((b, max_pages), **i64),
            slot_mapping=torch.full((t,), -1, **i64),
            tree_mask=torch.zeros((b, q, q), dtype=torch.bool, device=device) if bucket.tree else None,
            max_query_len=q)

    def fill(self, batch: RaggedBatch) -> None:
        """Copy `batch` in (its requests first, its tokens first) and pad the rest."""
        s, n, t = self.batch, batch.seq_lens.shape[0], batch.input_ids.shape[0]
        pages, q = batch.block_tables.shape[1], self.bucket.queries
        assert pages <= s.block_tables.shape[1], "a request has more pages than the graphs hold"
        s.input_ids[:t].copy_(batch.input_ids)
        s.positions[:t].copy_(batch.positions)
        s.slot_mapping[:t].copy_(batch.slot_mapping)
        s.slot_mapping[t:].fill_(-1)
        s.cu_seqlens[:n + 1].copy_(batch.cu_seqlens)
        s.cu_seqlens[n + 1:].fill_(t)
        s.seq_lens[:n].copy_(batch.seq_lens)
        s.seq_lens[n:].zero_()
        s.block_tables[:n, :pages].copy_(batch.block_tables)  # columns past a request's pages: unread
        if s.tree_mask is not None:
            s.tree_mask[:n].copy_(batch.tree_mask[:, :q, :q])


class TargetGraphs:
    """The target's hidden_states over padded buckets, captured as CUDA graphs where `capture`
    (a GPU), else run eagerly on the same padded buffers (the CPU tests of padding)."""

    def __init__(self, forward, max_pages: int, device: torch.device, capture: bool):
        """forward(batch) -> (final [T, H], features [T, F]): the eager forward to replay."""
        self.forward, self.max_pages, self.device, self.capture = forward, max_pages, device, capture
        self.graphs: dict[Bucket, tuple] = {}  # bucket -> (graph or None, static batch, outputs)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.failed: str | None = None  # why a capture failed: every forward is eager since

    def __call__(self, batch: RaggedBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """-> (final [T, H], features [T, F]) of the batch's T tokens, or None: not a bucket's."""
        bucket = bucket_of(batch)
        if bucket is None or self.failed or batch.block_tables.shape[1] > self.max_pages:
            return None
        entry = self.graphs.get(bucket)
        if entry is None:
            static = StaticBatch(bucket, self.max_pages, self.device)
            static.fill(batch)
            try:
                entry = self.graphs[bucket] = self._record(static)
            except RuntimeError as error:  # a capture this GPU or driver refuses: eager from now on
                self.failed = f"{type(error).__name__}: {error}"
                logging.getLogger(__name__).warning("CUDA graphs off: %s", self.failed)
                return None
        graph, static, outputs = entry
        static.fill(batch)
        if graph is None:
            outputs = self.forward(static.batch)
        else:
            graph.replay()
        t = batch.input_ids.shape[0]
        # copies: the next replay overwrites the graph's outputs, and callers keep features
        return outputs[0][:t].clone(), outputs[1][:t].clone()

    def verified(self) -> bool:
        """Whether a replay equals the eager forward bitwise on a probe decode step (the same
        kernels on the same shapes; its KV write skipped): where this GPU's replay differs, the
        caller runs eagerly."""
        device = self.device
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        probe = RaggedBatch(zero, zero, torch.tensor([0, 1], device=device), zero + 1,
                            zero.view(1, 1), zero - 1, max_query_len=1)
        replayed, eager = self(probe), self.forward(probe)
        return replayed is not None and all(torch.equal(a, b) for a, b in zip(replayed, eager))

    def _record(self, static: StaticBatch) -> tuple:
        if not self.capture:
            return None, static, None
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compiles and allocates outside the capture
            for _ in range(2):
                self.forward(static.batch)  # writes the same K/V to the same slots each time
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.forward(static.batch)
        return graph, static, outputs
