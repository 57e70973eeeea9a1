"""The PyTorch reference of paged attention (kernels.paged_attention's semantics: its module
docstring has the cache layout, draft-tree masks, sliding windows and soft-capping): the batch
gathered from the pages into padded [B, Q, C] form and attended by SDPA. kernels.paged_attention
dispatches to it (float64, and where no kernel runs) and kernels.rowwise_attention uses it for
prefills.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float,
                        tree_mask: torch.Tensor | None = None, window: int = 0,
                        softcap: float = 0.0, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each request's queries over its cached context (GQA).

    q: [T, q_heads, D]; k_cache, v_cache: [num_pages, page_size, kv_heads, D];
    block_tables: [B, P] int64 (-1 padded); cu_seqlens_q: [B+1]; seq_lens: [B];
    tree_mask: None or [B, Qt, Qt] bool; window, softcap: 0 = off; positions: None (= the
    stored positions) or [T] (see kernels.paged_attention's docstring) -> [T, q_heads, D]
    """
    num_req = block_tables.shape[0]
    page_size, kv_heads, head_dim = k_cache.shape[1:]
    plan = _batch_plan(q.shape[0], page_size, block_tables, cu_seqlens_q, seq_lens, tree_mask,
                       window, positions)
    mask = plan.mask
    max_ctx = mask.shape[2]
    keys = torch.index_select(k_cache, 0, plan.flat).reshape(num_req, -1, kv_heads, head_dim)[:, :max_ctx]  # [B, C, Hkv, D]
    values = torch.index_select(v_cache, 0, plan.flat).reshape(num_req, -1, kv_heads, head_dim)[:, :max_ctx]
    # [B, Q, Hq, D]; where every request has Q queries, a view
    q_pad = q.reshape(num_req, -1, *q.shape[1:]) if plan.all_valid else q[plan.q_index]
    q_t, k_t, v_t = (x.transpose(1, 2).to(q.dtype) for x in (q_pad, keys, values))
    if softcap > 0:  # SDPA has no soft-capping: the same math written out
        group = q.shape[1] // kv_heads
        scores = q_t @ k_t.repeat_interleave(group, 1).transpose(2, 3) * scale  # [B, Hq, Q, C]
        scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~mask.unsqueeze(1), float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v_t.repeat_interleave(group, 1)  # [B, Hq, Q, D]
    else:
        out = F.scaled_dot_product_attention(q_t, k_t, v_t, scale=scale, enable_gqa=True,
                                             attn_mask=None if plan.unmasked else mask.unsqueeze(1))  # [B, Hq, Q, D]
    if plan.all_valid:
        return out.transpose(1, 2).reshape(q.shape)
    return out.transpose(1, 2)[plan.q_valid]  # [T, Hq, D]


@dataclass(frozen=True)
class BatchPlan:
    flat: torch.Tensor        # [B * P] page index (index_select: much faster than indexing
    #                           with the table on CPU)
    q_valid: torch.Tensor     # [B, Q] bool
    q_index: torch.Tensor     # [B, Q]: row i of request b is token cu[b] + i
    mask: torch.Tensor        # [B, Q, C] bool
    all_valid: bool           # every request has Q queries (the padded layout is a view)
    unmasked: bool            # every query sees every key (a decode step)


_BATCH_PLAN: list = [None]  # [(key, plan)]: every layer of a forward asks for the same plan


def _batch_plan(num_tokens, page_size, block_tables, cu_seqlens_q, seq_lens, tree_mask, window,
                positions):
    """What paged_attention_ref's batch needs besides the tensors of a layer, built once per
    forward (every layer asks the same; the key holds the contents, so a reused tensor cannot
    alias) -> BatchPlan."""
    on_cpu = block_tables.device.type == "cpu"
    key = None
    if on_cpu:  # (elsewhere the key would cost a device sync per layer)
        key = tuple(x.numpy().tobytes() if x is not None else None
                    for x in (block_tables, cu_seqlens_q, seq_lens, tree_mask,
                              positions if window > 0 else None)) + (num_tokens, window)
        cached = _BATCH_PLAN[0]  # one read: another thread may replace it
        if cached is not None and cached[0] == key:
            return cached[1]
    n_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]  # [B]
    max_q, max_ctx = int(n_q.max()), int(seq_lens.max())
    flat = block_tables[:, :-(-max_ctx // page_size)].clamp(min=0).reshape(-1)
    i = torch.arange(max_q, device=cu_seqlens_q.device)
    q_valid = i.unsqueeze(0) < n_q.unsqueeze(1)  # [B, Q]
    q_index = (cu_seqlens_q[:-1].unsqueeze(1) + i).clamp(max=num_tokens - 1)  # [B, Q]
    q_pos = seq_lens.unsqueeze(1) - n_q.unsqueeze(1) + i  # [B, Q]
    k_pos = torch.arange(max_ctx, device=cu_seqlens_q.device)
    # Valid rows have q_pos < seq_len, so this also hides keys past the context; padded rows
    # see at least key 0 (no NaN) and are dropped below.
    mask = k_pos.view(1, 1, -1) <= q_pos.unsqueeze(2)  # [B, Q, C]
    if tree_mask is not None:
        tree = _tree_visible(tree_mask, n_q, seq_lens, max_q, max_ctx)  # [B, Q, C]
        mask = mask & (tree | ~q_valid.unsqueeze(2))
    if window > 0:
        mask = mask & (_in_window(positions, cu_seqlens_q, n_q, seq_lens, q_index, q_pos, max_ctx,
                                  window) | ~q_valid.unsqueeze(2))
    plan = BatchPlan(flat, q_valid, q_index, mask, bool(q_valid.all()), bool(mask.all()))
    if on_cpu:
        _BATCH_PLAN[0] = (key, plan)
    return plan


def _in_window(positions, cu_seqlens_q, n_q, seq_lens, q_index, q_pos, max_ctx, window):
    """-> [B, Q, C] bool: key c lies less than `window` positions behind query i (positions
    along the sequence: a context key's is its index, a new token's is `positions`)."""
    prefix = (seq_lens - n_q).unsqueeze(1)  # [B, 1]
    k_pos = torch.arange(max_ctx, device=q_pos.device).expand(seq_lens.shape[0], max_ctx)  # [B, C]
    if positions is not None:
        q_pos = positions[q_index]  # [B, Q]
        new = k_pos - prefix  # index among the new tokens, < 0 for context
        own = (cu_seqlens_q[:-1].unsqueeze(1) + new.clamp(min=0)).clamp(max=positions.shape[0] - 1)
        k_pos = torch.where(new >= 0, positions[own], k_pos)
    return (q_pos.unsqueeze(2) - k_pos.unsqueeze(1)) < window


def _tree_visible(tree_mask: torch.Tensor, n_q: torch.Tensor, seq_lens: torch.Tensor,
                  max_q: int, max_ctx: int) -> torch.Tensor:
    """-> [B, Q, C] bool: key c is context, or a new token the tree lets query i see."""
    num_req, width = tree_mask.shape[0], tree_mask.shape[2]
    assert tree_mask.shape == (num_req, width, width) and width >= max_q
    new = torch.arange(max_ctx, device=n_q.device) - (seq_lens - n_q).unsqueeze(1)  # [B, C]
    cols = new.clamp(0, width - 1).unsqueeze(1).expand(num_req, max_q, max_ctx)
    allowed = tree_mask[:, :max_q].to(torch.bool).gather(2, cols)  # [B, Q, C]
    return allowed | (new < 0).unsqueeze(1)
