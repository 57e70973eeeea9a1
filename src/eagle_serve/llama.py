"""The target LLM: a Llama-family causal LM run over ragged batches against a paged KV cache.

Weights and checkpoint formats come from transformers (`AutoModelForCausalLM`); the forward is
ours, so that one call serves prefill, decode and verification of many requests at once and
reads/writes the paged cache the engine schedules. It returns the features EAGLE needs:
the final (post-norm) hidden state for EAGLE-1, or the inputs of three layers for EAGLE-3.
Knows nothing about requests, pages allocation or sampling policy.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from eagle_serve.cpu_matmul import use_cpu_linears
from eagle_serve.interfaces import RaggedBatch, RowSampling, TargetOutput
from kernels.paged_attention import paged_attention, write_kv
from kernels.sampling import compute_probs


def eagle3_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3 reads the inputs of layers 2, L//2 and L-3 (in that order)."""
    return (2, num_layers // 2, num_layers - 3)


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


def paged_self_attention(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         batch: RaggedBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         head_dim: int) -> torch.Tensor:
    """Attention block of an HF-style attention module over the paged cache.

    x: [T, in_features]; cos, sin: [T, head_dim] -> [T, hidden]
    """
    num_tokens = x.shape[0]
    q = attn.q_proj(x).view(num_tokens, -1, head_dim)
    k = attn.k_proj(x).view(num_tokens, -1, head_dim)
    v = attn.v_proj(x).view(num_tokens, -1, head_dim)
    if hasattr(attn, "q_norm"):  # Qwen3-style per-head norms
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
    out = paged_attention(q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens,
                          batch.seq_lens, head_dim ** -0.5, tree_mask=batch.tree_mask)
    return attn.o_proj(out.reshape(num_tokens, -1))


class TargetModel:
    """In-process target runner (implements `TargetRunner`)."""

    def __init__(self, folder: str | Path, *, dtype=torch.float32, device="cpu",
                 num_pages: int = 256, page_size: int = 16,
                 feature_layers: tuple[int, ...] | None = None):
        self.hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
        if self.hf.device.type == "cpu":
            use_cpu_linears(self.hf)  # see cpu_matmul: MKL is slow for 2+ rows here
        self.config = cfg = self.hf.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.dtype, self.device = dtype, torch.device(device)
        self.vocab_size = cfg.vocab_size
        self.num_layers = cfg.num_hidden_layers
        self.feature_layers = tuple(feature_layers) if feature_layers else None
        self.feature_size = cfg.hidden_size * (len(self.feature_layers) if self.feature_layers else 1)
        self.cache = PagedKVCache(self.num_layers, num_pages, page_size, cfg.num_key_value_heads,
                                  self.head_dim, dtype, device)

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self.hf.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.hf.get_output_embeddings()

    @torch.inference_mode()
    def hidden_states(self, batch: RaggedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> final post-norm hidden [T, H], features [T, F]"""
        model = self.hf.model
        h = model.embed_tokens(batch.input_ids)  # [T, H]
        cos, sin = model.rotary_emb(h, batch.positions.unsqueeze(0))
        cos, sin = cos[0], sin[0]  # [T, head_dim]
        aux = []
        for idx, layer in enumerate(model.layers):
            if self.feature_layers and idx in self.feature_layers:
                aux.append(h)
            h = h + paged_self_attention(layer.self_attn, layer.input_layernorm(h), cos, sin,
                                         batch, self.cache.keys[idx], self.cache.values[idx],
                                         self.head_dim)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        final = model.norm(h)
        if self.feature_layers:
            order = sorted(self.feature_layers)
            features = torch.cat([aux[order.index(i)] for i in self.feature_layers], dim=-1)
        else:
            features = final
        return final, features

    @torch.inference_mode()
    def forward(self, batch: RaggedBatch, logit_rows: torch.Tensor, sampling: RowSampling,
                kv_moves: tuple[torch.Tensor, torch.Tensor] | None = None) -> TargetOutput:
        """logit_rows: [R] rows of the batch to score; sampling: per row; kv_moves: (src [M],
        dst [M]) slots copied first -> TargetOutput"""
        if kv_moves is not None:
            self.cache.move(*(m.to(self.device) for m in kv_moves))
        final, features = self.hidden_states(batch)
        logits = self.lm_head(final[logit_rows])  # [R, V]
        sampled = sampling.sampled
        probs = logits.new_zeros((0, logits.shape[1]), dtype=torch.float32)
        if bool(sampled.any()):
            rows = sampled.nonzero().squeeze(1)
            s = sampling.select(rows)
            probs = compute_probs(logits[rows], s.temperature, s.top_k, s.top_p)
        # argmax of bf16 rows on CPU takes ~160 us per 49k-wide row, of fp32 ~35 us (same result)
        return TargetOutput(hidden=features, argmax=logits.float().argmax(dim=-1), probs=probs)

    @torch.inference_mode()
    def logits(self, batch: RaggedBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        """Raw logits [R, V] (tests and training)."""
        final, _ = self.hidden_states(batch)
        return self.lm_head(final[logit_rows])
