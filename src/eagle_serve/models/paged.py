"""Paged-attention building blocks shared by the target and the drafter: the KV cache tensors
and one attention step over them (RoPE, KV write, attention over a ragged batch).

Knows nothing about a model's weight layout: callers project q, k, v and apply their output
projection; the kernels (kernels.paged_attention) do the paging.
"""
from __future__ import annotations

import torch

from eagle_serve.core.interfaces import RaggedBatch
from eagle_serve.kernels import layer_ops
from eagle_serve.kernels.cpu import rope_write_kv
from eagle_serve.kernels.paged_attention import cpu_rope_write_kv_runs, paged_attention


class PagedKVCache:
    """Key and value tensors per layer: [num_pages, page_size, kv_heads, head_dim]."""

    def __init__(self, num_layers, num_pages, page_size, kv_heads, head_dim, dtype, device):
        shape = (num_pages, page_size, kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_pages, self.page_size = num_pages, page_size

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V at slots src [M] to slots dst [M] (all read before any write)."""
        for cache in self.keys + self.values:
            flat = cache.view(-1, *cache.shape[2:])  # [num_pages * page_size, kv_heads, head_dim]
            flat[dst] = flat[src]


def paged_attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, batch: RaggedBatch, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, *, scale: float, window: int = 0,
                         softcap: float = 0.0) -> torch.Tensor:
    """RoPE, write the new keys/values into their slots, attend (causal or draft tree).

    q: [T, Hq, D]; k, v: [T, Hkv, D]; cos, sin: [T, R]; window, softcap: 0 = off
    -> [T, Hq * D]
    """
    if cpu_rope_write_kv_runs(q, k_cache, cos):  # fp32 on CPU: one C++ call (eagle_serve/kernels/cpu.cpp)
        q = rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, batch.slot_mapping)
    else:  # on a GPU one launch; else PyTorch's RoPE and KV write (eagle_serve.kernels.layer_ops)
        q = layer_ops.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, batch.slot_mapping)
    out = paged_attention(q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens, batch.seq_lens,
                          scale, tree_mask=batch.tree_mask, window=window, softcap=softcap,
                          positions=batch.positions if window > 0 else None,
                          max_q=batch.max_query_len, plans=batch.plans)
    return out.reshape(q.shape[0], -1)
