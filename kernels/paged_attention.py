"""Paged KV cache: write new keys/values into their slots, and attend over a ragged batch.

Layout: one cache tensor per layer for keys and one for values, [num_pages, page_size,
kv_heads, head_dim]. A request's block table lists its pages in order; token position t lives
in slot block_table[t // page_size] * page_size + t % page_size. Slot -1 means "do not write"
(padding). Queries of request b are its last n_b positions (seq_len_b - n_b .. seq_len_b - 1),
causal among themselves: one query for decode, k + 1 for verification, the prompt for prefill.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v: [T, kv_heads, head_dim]; caches: [num_pages, page_size, kv_heads, head_dim];
    slot_mapping: [T] int64 (-1 = skip)."""
    assert k.shape == v.shape and k.shape[0] == slot_mapping.shape[0]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    valid = slot_mapping >= 0
    if bool(valid.all()):
        flat_k.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        flat_v.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    else:
        flat_k.index_copy_(0, slot_mapping[valid], k[valid].to(k_cache.dtype))
        flat_v.index_copy_(0, slot_mapping[valid], v[valid].to(v_cache.dtype))


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of each request's queries over its cached context (GQA).

    q: [T, q_heads, D]; k_cache, v_cache: [num_pages, page_size, kv_heads, D];
    block_tables: [B, P] int64 (-1 padded); cu_seqlens_q: [B+1]; seq_lens: [B] -> [T, q_heads, D]
    """
    num_req = block_tables.shape[0]
    page_size, kv_heads, head_dim = k_cache.shape[1:]
    n_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]  # [B]
    max_q, max_ctx = int(n_q.max()), int(seq_lens.max())
    pages_needed = -(-max_ctx // page_size)
    tables = block_tables[:, :pages_needed].clamp(min=0)
    keys = k_cache[tables].reshape(num_req, -1, kv_heads, head_dim)[:, :max_ctx]  # [B, C, Hkv, D]
    values = v_cache[tables].reshape(num_req, -1, kv_heads, head_dim)[:, :max_ctx]

    # Padded query layout: row i of request b is token cu[b] + i.
    i = torch.arange(max_q, device=q.device)
    q_valid = i.unsqueeze(0) < n_q.unsqueeze(1)  # [B, Q]
    q_index = (cu_seqlens_q[:-1].unsqueeze(1) + i).clamp(max=q.shape[0] - 1)  # [B, Q]
    q_pad = q[q_index]  # [B, Q, Hq, D]
    q_pos = seq_lens.unsqueeze(1) - n_q.unsqueeze(1) + i  # [B, Q]
    k_pos = torch.arange(max_ctx, device=q.device)
    # Valid rows have q_pos < seq_len, so this also hides keys past the context; padded rows
    # see at least key 0 (no NaN) and are dropped below.
    mask = k_pos.view(1, 1, -1) <= q_pos.unsqueeze(2)  # [B, Q, C]
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
        attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=True)  # [B, Hq, Q, D]
    return out.transpose(1, 2)[q_valid]  # [T, Hq, D]


def write_kv(k, v, k_cache, v_cache, slot_mapping, impl: str | None = None):
    return write_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                    impl: str | None = None):
    return paged_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
