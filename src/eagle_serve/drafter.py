"""The EAGLE drafter: one decoder layer over (token embedding, target feature) pairs.

Row (f_p, x_{p+1}) lives at drafter position p: the feature the target computed at position p
and the token that followed it. The output at a request's last row predicts the next token (the
first draft); each further draft step feeds the drafter's own output feature back with the
token it just drafted. EAGLE-1 fuses fc(cat(emb, f)) and reads logits through the target's LM
head; EAGLE-3 fuses three target layers with fc, runs a layer over cat(norm(emb), norm(h)),
and has its own norm, reduced-vocabulary LM head and d2t map (target_id = draft_id + d2t).

Drafts are sampled here: greedy requests take the argmax, sampled ones draw from q (their own
temperature/top-k/top-p) with a key (seed, position, DRAFT), and q goes back to the engine
for lossless verification.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from eagle_serve.interfaces import DraftOutput, RaggedBatch, RowSampling
from eagle_serve.llama import PagedKVCache, paged_self_attention
from kernels.sampling import DRAFT, compute_probs, sample


@dataclass(frozen=True)
class DrafterSpec:
    """What a checkpoint is: read from its config.json and weight shapes."""
    version: int                      # 1 or 3
    config: LlamaConfig               # the head's own layer config
    target_hidden_size: int
    draft_vocab_size: int             # == target vocab for EAGLE-1
    fc_bias: bool
    feature_layers: tuple[int, ...] | None  # target layers EAGLE-3 reads; None = final hidden


class _Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, in_features: int, head_dim: int):
        super().__init__()
        q_out, kv_out = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
        self.q_proj = nn.Linear(in_features, q_out, bias=False)
        self.k_proj = nn.Linear(in_features, kv_out, bias=False)
        self.v_proj = nn.Linear(in_features, kv_out, bias=False)
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    """EAGLE-1 layer (no input norm) or EAGLE-3 midlayer (norms on both inputs, 2H wide)."""

    def __init__(self, cfg: LlamaConfig, version: int, head_dim: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = _Attention(cfg, 2 * h if version == 3 else h, head_dim)
        self.mlp = _MLP(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        if version == 3:
            self.input_layernorm = LlamaRMSNorm(h, eps=eps)
            self.hidden_norm = LlamaRMSNorm(h, eps=eps)


class EagleHead(nn.Module):
    """The trainable part of an EAGLE drafter; parameter names follow the published layouts."""

    def __init__(self, spec: DrafterSpec):
        super().__init__()
        cfg, h = spec.config, spec.config.hidden_size
        self.spec, self.version = spec, spec.version
        self.head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
        fc_in = 3 * spec.target_hidden_size if spec.version == 3 else 2 * h
        self.fc = nn.Linear(fc_in, h, bias=spec.fc_bias)
        layer = _Layer(cfg, spec.version, self.head_dim)
        if spec.version == 3:
            self.midlayer = layer
            self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
            self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.int64))
        else:
            self.layers = nn.ModuleList([layer])
        self.rotary = LlamaRotaryEmbedding(cfg)

    @property
    def layer(self) -> _Layer:
        return self.midlayer if self.version == 3 else self.layers[0]

    def fuse(self, emb: torch.Tensor, hidden: torch.Tensor, from_target: bool) -> tuple:
        """-> (residual stream input [T, H], attention input [T, H or 2H])"""
        if self.version == 1:
            x = self.fc(torch.cat([emb, hidden], dim=-1))
            return x, x
        if from_target:
            hidden = self.fc(hidden)
        layer = self.layer
        return hidden, torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)

    def step(self, emb, hidden, from_target, batch: RaggedBatch, cache: PagedKVCache):
        """One layer over ragged rows. emb: [T, H]; hidden: [T, F] -> output feature [T, H]"""
        residual, x = self.fuse(emb, hidden, from_target)
        cos, sin = self.rotary(x, batch.positions.unsqueeze(0))
        layer = self.layer
        h = residual + paged_self_attention(layer.self_attn, x, cos[0], sin[0], batch,
                                            cache.keys[0], cache.values[0], self.head_dim)
        return h + layer.mlp(layer.post_attention_layernorm(h))


class Drafter:
    """In-process drafter runner (implements `DrafterRunner`)."""

    def __init__(self, head: EagleHead, embed_tokens: torch.Tensor, lm_head: torch.Tensor | None,
                 *, num_pages: int = 256, page_size: int = 16):
        """embed_tokens: [V, H] the target's; lm_head: [V, H] the target's (EAGLE-1 only)."""
        self.head = head.eval()
        p = next(head.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.embed_tokens = embed_tokens.to(self.dtype)
        self.lm_head = lm_head.to(self.dtype) if lm_head is not None else None
        self.vocab_size = embed_tokens.shape[0]
        cfg = head.spec.config
        self.cache = PagedKVCache(1, num_pages, page_size, cfg.num_key_value_heads,
                                  head.head_dim, self.dtype, self.device)
        self.page_size = page_size

    @property
    def feature_layers(self):
        return self.head.spec.feature_layers

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        """feature: [R, H] -> [R, V_draft]"""
        if self.head.version == 3:
            return self.head.lm_head(self.head.norm(feature))
        return feature @ self.lm_head.T

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.head.version == 3:
            return draft_ids + self.head.d2t[draft_ids]
        return draft_ids

    def to_target_probs(self, q: torch.Tensor) -> torch.Tensor:
        """q: [R, V_draft] -> [R, V] (zero outside the draft vocabulary)"""
        if self.head.version == 1:
            return q
        out = q.new_zeros((q.shape[0], self.vocab_size))
        return out.index_copy_(1, self.to_target_ids(torch.arange(q.shape[1], device=q.device)), q)

    @torch.inference_mode()
    def propose(self, batch: RaggedBatch, features: torch.Tensor, num_drafts: torch.Tensor,
                sampling: RowSampling) -> DraftOutput:
        """Catch up on the batch's rows, then draft num_drafts[b] tokens for each request.

        batch: rows (f_p, x_{p+1}) at drafter positions p; block tables must also cover the
        positions the draft steps write (seq_len .. seq_len + k - 2). features: [T, F];
        num_drafts: [B] int64 -> DraftOutput
        """
        emb = nn.functional.embedding(batch.input_ids, self.embed_tokens)
        out = self.head.step(emb, features.to(self.dtype), True, batch, self.cache)
        last = out[batch.cu_seqlens[1:] - 1]  # [B, H]
        ks = num_drafts.tolist()
        num_req, max_k = len(ks), max(ks, default=0)
        tokens = torch.full((num_req, max_k), -1, dtype=torch.int64, device=self.device)
        probs = [[] for _ in range(num_req)]
        active = torch.arange(num_req, device=self.device)
        seq_lens = batch.seq_lens.clone()
        for j in range(max_k):
            if j > 0:  # feed back (own feature, previous draft) at position seq_len + j - 1
                active = active[num_drafts[active] > j]
                step = self._single_token_batch(batch, active, tokens[active, j - 1], seq_lens[active] + j - 1)
                emb = nn.functional.embedding(step.input_ids, self.embed_tokens)
                last = last.clone()
                last[active] = self.head.step(emb, last[active], False, step, self.cache)
            drafted, q = self._sample(self.logits(last[active]), sampling.select(active),
                                      (seq_lens[active] + j + 1).tolist())
            tokens[active, j] = drafted
            for row, b in enumerate(active.tolist()):
                if q is not None and sampling.temperature[b] > 0:
                    probs[b].append(q[row])
        flat = [p for per_req in probs for p in per_req]
        q_all = torch.stack(flat) if flat else torch.zeros((0, self.vocab_size), device=self.device)
        return DraftOutput(tokens=tokens, probs=q_all.float())

    def _sample(self, logits: torch.Tensor, s: RowSampling, positions: list[int]):
        """-> target ids [R], target-vocabulary q [R, V] (None if all greedy)"""
        draft_ids = logits.argmax(dim=-1)
        if not bool(s.sampled.any()):
            return self.to_target_ids(draft_ids), None
        rows = s.sampled.nonzero().squeeze(1)
        rs = s.select(rows)
        q_draft = compute_probs(logits[rows], rs.temperature, rs.top_k, rs.top_p)
        q = self.to_target_probs(q_draft)
        draft_ids[rows] = sample(q_draft, rs.seeds.tolist(), [positions[r] for r in rows.tolist()], DRAFT)
        full_q = q.new_zeros((logits.shape[0], self.vocab_size))
        full_q[rows] = q
        return self.to_target_ids(draft_ids), full_q

    def _single_token_batch(self, batch: RaggedBatch, active: torch.Tensor, ids: torch.Tensor,
                            positions: torch.Tensor) -> RaggedBatch:
        tables = batch.block_tables[active]
        pages = tables.gather(1, (positions // self.page_size).unsqueeze(1)).squeeze(1)
        n = active.shape[0]
        return RaggedBatch(input_ids=ids, positions=positions,
                           cu_seqlens=torch.arange(n + 1, device=self.device),
                           seq_lens=positions + 1, block_tables=tables,
                           slot_mapping=pages * self.page_size + positions % self.page_size)
