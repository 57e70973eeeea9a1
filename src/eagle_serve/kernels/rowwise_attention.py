"""Row-invariant paged attention on CPU: each decode/verify query attends alone over exactly the
keys it sees, so a verify pass reproduces one-token decode steps bitwise (kernels.paged_attention
dispatches CPU bf16/fp16, and fp32 where eagle_serve/kernels/cpu.cpp runs, here). Layout, trees and
windows as kernels.paged_attention's docstring says.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from eagle_serve.kernels.cpu import attend as cpu_attend
from eagle_serve.kernels.cpu import cpu_kernels


def paged_attention_rowwise(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float,
                            tree_mask: torch.Tensor | None = None, window: int = 0,
                            softcap: float = 0.0, positions: torch.Tensor | None = None,
                            plans: dict | None = None) -> torch.Tensor:
    """As kernels.attention_ref.paged_attention_ref, but each query attends alone, unmasked, over
    exactly the keys it sees (its context, then its ancestors in depth order for a tree).
    plans: where the forward's layers share what they plan from the call's metadata (see
    RaggedBatch.plans; None: planned for this call alone).

    A batched call's result for a query depends on the other queries and masked keys of the call
    (measured on CPU with SDPA: 36/40 fp32 and 8/40 bf16 results change when masked keys are
    appended), so a batched verify pass would not reproduce the one-token decode step bitwise.
    Here the query of a verified position gets exactly the computation a one-token decode step
    at that position makes, so the result does not depend on the batch. The math runs in fp32:
    on CPUs with AVX2, one call of eagle_serve/kernels/cpu_attention.cpp's `attend` for all queries of a
    layer (each query walks its own list of key slots, planned once per forward:
    `attention_plan`); elsewhere
    `_attend_in_python`, per query. Prefills too: a position's KV then does not depend on how
    its prompt was split into forwards (whole, in chunks, or after a prefix cache hit), at
    ~1.15x the batched reference's cost for a 1,600-token prompt. A query's keys run along the sequence ([context, path] is
    positions 0 .. its own), so a sliding window keeps the last `window` of them: what a decode
    step there keeps. Shapes as paged_attention_ref.
    """
    plan = attention_plan(cu_seqlens_q, seq_lens, block_tables, tree_mask, k_cache, plans)
    q32 = (q.float() * scale).contiguous()  # [T, Hq, D]
    if plan.slots is not None:
        out32 = cpu_attend(q32, k_cache, v_cache, plan.slots, plan.starts, window, softcap)
    else:
        out32 = _attend_in_python(q32, k_cache, v_cache, block_tables, plan.cu, plan.lens,
                                  plan.queries, window, softcap)
    return out32.to(q.dtype)


def cpu_attend_fits(k_cache: torch.Tensor) -> bool:
    """Whether eagle_serve/kernels/cpu_attention.cpp's `attend` runs these caches: built here, fp32 or
    bf16, D % 8 == 0."""
    return (cpu_kernels() is not None and k_cache.shape[-1] % 8 == 0
            and k_cache.dtype in (torch.float32, torch.bfloat16))


def _attend_in_python(q32, k_cache, v_cache, block_tables, cu, lens, queries, window, softcap):
    """paged_attention_rowwise's math without the C++ kernel: keys and values laid out
    [Hkv, L, D], two small bmms and a softmax per query on one thread (~22 us against ~90 us for
    SDPA on one query; small ops lose time to a second thread). -> [T, Hq, D] fp32"""
    page_size, kv_heads, head_dim = k_cache.shape[1:]
    q32 = q32.view(q32.shape[0], kv_heads, -1, head_dim)  # [T, Hkv, G, D]
    out32 = torch.zeros_like(q32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for b, ctx_len in enumerate(lens):
            if not queries[b]:  # no new tokens
                continue
            start = cu[b]
            pages = block_tables[b, :-(-ctx_len // page_size)]
            keys = _heads_first(k_cache, pages, ctx_len)  # [Hkv, C, D] fp32
            values = _heads_first(v_cache, pages, ctx_len)
            keys_t = keys.transpose(1, 2)  # [Hkv, D, C]
            for i, length, gather in queries[b]:
                first = max(0, length - window) if window > 0 else 0  # keys [first, length)
                if gather is None:
                    k_t, v = keys_t[:, :, first:length], values[:, first:length]
                else:
                    gather = gather[first:]
                    k_t = keys.index_select(1, gather).transpose(1, 2)
                    v = values.index_select(1, gather)  # [Hkv, L, D]
                scores = torch.bmm(q32[start + i], k_t)  # [Hkv, G, L]
                if softcap > 0:
                    scores = torch.tanh(scores / softcap) * softcap
                torch.bmm(torch.softmax(scores, dim=-1), v, out=out32[start + i])  # [Hkv, G, D]
    finally:
        torch.set_num_threads(threads)
    return out32.view(q32.shape[0], -1, head_dim)


@dataclass(frozen=True)
class _Plan:
    """What every layer of one forward shares, built from the call's metadata once."""
    cu: list[int]                  # cu_seqlens_q
    lens: list[int]                # seq_lens
    queries: list                  # _rowwise_queries'
    slots: torch.Tensor | None     # C++ `attend`: query t's keys are the cache slots
    starts: torch.Tensor | None    # slots[starts[t]:starts[t + 1]] ([S], [T + 1]); None: not run


def attention_plan(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                   tree_mask: torch.Tensor | None, k_cache: torch.Tensor, plans: dict | None) -> _Plan:
    """The call's _Plan for caches like k_cache; `plans` (a batch's RaggedBatch.plans) keeps it
    for the other layers of the forward."""
    page_size, with_slots = k_cache.shape[1], cpu_attend_fits(k_cache)
    key = (page_size, with_slots)
    if plans is not None and key in plans:
        return plans[key]
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    queries = _rowwise_queries(cu, lens, tree_mask)
    slots = starts = None
    if with_slots:
        slots, starts = _query_slots(cu, lens, queries, block_tables, page_size)
    plan = _Plan(cu, lens, queries, slots, starts)
    if plans is not None:
        plans[key] = plan
    return plan


def _query_slots(cu: list[int], lens: list[int], queries: list, block_tables: torch.Tensor,
                 page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_rowwise_queries`' key lists as cache slots for C++ `attend`: slots [S] int64,
    starts [T + 1] (query t's keys are slots[starts[t]:starts[t + 1]], in order)."""
    tables, lists, lengths = block_tables.tolist(), [], [0] * cu[-1]
    for b, rows in enumerate(queries):
        if not rows:  # no new tokens
            continue
        pos = torch.arange(lens[b])
        request = torch.tensor(tables[b], dtype=torch.int64)[pos // page_size] * page_size + pos % page_size
        for i, length, gather in rows:  # a chain query's keys are a prefix of the request's
            lists.append(request[:length] if gather is None else request[gather])
            lengths[cu[b] + i] = length
    slots = torch.cat(lists) if lists else torch.zeros(0, dtype=torch.int64)
    starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
    return slots, starts


def _rowwise_queries(cu: list[int], lens: list[int], tree_mask: torch.Tensor | None) -> list:
    """Per request, (query i, key count L, gather) for each query: a chain query or a tree
    query whose path is new tokens 0..d-1 reads the first L keys in place (gather None); any
    other tree query reads [context, its path] through `gather`, a [L] index."""
    mask = None if tree_mask is None else tree_mask.to("cpu", torch.bool)
    plan = []
    for b, ctx_len in enumerate(lens):
        n = cu[b + 1] - cu[b]
        prefix, rows = ctx_len - n, []
        seen = None if mask is None else mask[b, :n, :n].tolist()
        for i in range(n):
            path = list(range(i + 1)) if seen is None else [j for j in range(i + 1) if seen[i][j]]
            gather = None
            if path != list(range(len(path))):
                gather = torch.tensor(list(range(prefix)) + [prefix + j for j in path])
            rows.append((i, prefix + len(path), gather))
        plan.append(rows)
    return plan


def _heads_first(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """cache: [num_pages, page_size, Hkv, D]; pages: [P] -> the first `length` positions of those
    pages as [Hkv, length, D] fp32 (index_select: ~7x faster than indexing with `pages` here)."""
    rows = torch.index_select(cache.reshape(cache.shape[0], -1), 0, pages)  # [P, page_size * Hkv * D]
    flat = rows.view(-1, *cache.shape[2:])[:length]  # [length, Hkv, D]
    return torch.empty((flat.shape[1], length, flat.shape[2])).copy_(flat.transpose(0, 1))
