"""The target LLM: a decoder-only causal LM run over ragged batches against a paged KV cache.

Weights, configs and the small modules (norms, MLPs, RoPE tables, scaled embeddings) come from
transformers (`AutoConfig`, `AutoModelForCausalLM`); the forward is ours, so that one call
serves prefill, decode and verification of many requests at once and reads/writes the paged
cache the engine schedules. It returns the features EAGLE needs: the final (post-norm) hidden
state for EAGLE-1, or the inputs of chosen layers for EAGLE-3. Architectures differ only in the
quirks declared in `ARCHITECTURES`; anything else is refused at load with the list of supported
ones. Knows nothing about requests, page allocation or sampling policy.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from eagle_serve.core.interfaces import RaggedBatch, RowSampling, TargetOutput
from eagle_serve.core.processors import LogitsProcessors, apply_processors, min_p_mask
from eagle_serve.cpu.argmax import SCREEN_ROWS, ScreenedArgmax, screenable
from eagle_serve.cpu.matmul import (
    CpuLinear,
    find_block_weights,
    fuse_linears,
    use_amx_tiles,
    use_cpu_linears,
    use_int8_activations,
)
from eagle_serve.cpu.norm import use_cpu_norms
from eagle_serve.cpu.quant import int8_activations_run
from eagle_serve.kernels import on
from eagle_serve.kernels.cpu import amx_tiles
from eagle_serve.kernels.layer_ops import add_rms_norm, fused_layers_run, silu_mul
from eagle_serve.kernels.sampling import compute_probs
from eagle_serve.models.cpu_stack import CpuDecoderStack, StackLayer, StackShape, is_silu
from eagle_serve.models.graphs import TargetGraphs, graphable
from eagle_serve.models.paged import PagedKVCache, paged_attention_step
from eagle_serve.settings import TARGET_ACTIVATIONS, model_config


@dataclass(frozen=True)
class Architecture:
    """How one HF model type departs from a Llama block (values are read from its config)."""
    windows: str = "none"        # sliding layers: "none"; "all" (config.sliding_window, if set);
    #                              "layer_types" (config.sliding_window on "sliding_attention" layers)
    qk_norm: bool = False        # RMSNorm on each head's q and k before RoPE
    fused_qkv: bool = False      # HF's checkpoint has one qkv_proj and one gate_up_proj
    sandwich_norms: bool = False  # norm after attention; pre- and post-FFN norms
    softcaps: bool = False       # config attn_logit_softcapping / final_logit_softcapping
    query_scalar: bool = False   # attention scale query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5)
    rope_per_layer_type: bool = False  # sliding layers rotate with their own RoPE table
    norm_plus_one: bool = False  # RMSNorm scales by 1 + weight
    moe: bool = False            # the MLP is HF's routed mixture-of-experts block
    # Not listed because HF's modules and weights carry them: Gemma's embedding scale
    # (x sqrt(hidden) in its embedding module), Qwen2's q/k/v bias, Phi-3's partial rotary.


GEMMA = dict(windows="layer_types", sandwich_norms=True, softcaps=True, query_scalar=True,
             norm_plus_one=True)
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(),                                   # Llama 2, 3.x; SmolLM2
    "mistral": Architecture(windows="all"),
    "qwen2": Architecture(windows="layer_types"),              # Qwen2, Qwen2.5 (qkv bias)
    "qwen3": Architecture(windows="layer_types", qk_norm=True),
    "gemma2": Architecture(**GEMMA),
    "gemma3_text": Architecture(**GEMMA, qk_norm=True, rope_per_layer_type=True),
    "phi3": Architecture(windows="all", fused_qkv=True),       # Phi-3, Phi-3.5, Phi-4
    "mixtral": Architecture(windows="all", moe=True),
    "qwen3_moe": Architecture(windows="all", qk_norm=True, moe=True),
}


class UnsupportedArchitecture(ValueError):
    """A target whose model type is not in ARCHITECTURES."""


def architecture_of(config) -> Architecture:
    arch = ARCHITECTURES.get(config.model_type)
    if arch is None:
        names = ", ".join(getattr(config, "architectures", None) or [])
        raise UnsupportedArchitecture(
            f"target model type '{config.model_type}'{f' ({names})' if names else ''} is not supported; "
            f"supported model types: {', '.join(ARCHITECTURES)}")
    return arch


def load_target_config(folder: str | Path):
    """The target's HF config, checked against ARCHITECTURES."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder))
    architecture_of(config)
    return config


@dataclass(frozen=True)
class TargetShape:
    """What a head is checked and shaped against, read from the target's config.json alone: a
    drafter process needs no more of the target, nor transformers' config machinery."""
    model_type: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    architectures: tuple[str, ...] = ()


def read_target_shape(folder: str | Path) -> TargetShape:
    """TargetShape of the target in `folder`, checked against ARCHITECTURES."""
    raw = model_config(folder)
    missing = [k for k in ("model_type", "hidden_size", "vocab_size", "num_hidden_layers") if k not in raw]
    if missing:
        raise ValueError(f"{Path(folder) / 'config.json'}: no {', '.join(missing)}")
    shape = TargetShape(raw["model_type"], raw["hidden_size"], raw["vocab_size"], raw["num_hidden_layers"],
                        tuple(raw.get("architectures") or ()))
    architecture_of(shape)
    return shape


@dataclass(frozen=True)
class _LayerPlan:
    window: int            # 0 = full attention
    rope: str | None       # key of the layer's RoPE table
    qkv: nn.Module         # x [T, H] -> [T, q_width + 2 kv_width]: q, k, v side by side
    gate_up: nn.Module | None  # x [T, H] -> [T, 2 I]: gate, up side by side; None: HF's MoE block
    act: Callable | None   # the MLP's activation (on gate)


def _add_norm(delta: torch.Tensor | None, h: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(h + delta), h + delta) in one launch (delta None: h alone)"""
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps")
    return add_rms_norm(h, None, norm.weight, eps) if delta is None else add_rms_norm(delta, h, norm.weight, eps)


class TargetModel:
    """In-process target runner (implements `TargetRunner`)."""

    def __init__(self, folder: str | Path, *, dtype=torch.float32, device="cpu",
                 num_pages: int = 256, page_size: int = 16,
                 feature_layers: tuple[int, ...] | None = None, activations: str = "fp32",
                 cuda_graphs: bool = False):
        """activations: "fp32", or "int8": the linears that hold GGUF blocks take their inputs
        rounded to 8 bits per block of 32 (llama.cpp's arithmetic, cpu_i8.cpp: ~1.5x faster
        on a CPU with AVX512-VNNI; another model's bits: not the fp32 forward's);
        cuda_graphs: on a GPU, decode and verify forwards replay CUDA graphs (models.graphs)."""
        if activations not in TARGET_ACTIVATIONS:
            raise ValueError(f"target activations must be one of {TARGET_ACTIVATIONS}, got {activations!r}")
        self.config = cfg = load_target_config(folder)
        self.arch = arch = architecture_of(cfg)
        moe = {"experts_implementation": "eager"} if arch.moe else {}  # any dtype, any device
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **moe).to(device).eval()
        # Llama-like norms (weight * normed, one before each sublayer): the GPU runs the fused
        # layer kernels (eagle_serve.kernels.layer_ops)
        self.fusable = not (arch.sandwich_norms or arch.norm_plus_one)
        # the CPU's own kernels, unless the layers run on the GPU path's (tests force it on CPU)
        cpu = self.hf.device.type == "cpu" and not (self.fusable and fused_layers_run(self.hf.lm_head.weight))
        if cpu:
            use_cpu_linears(self.hf)  # see cpu_matmul: MKL is slow for 2+ rows here
            use_cpu_norms(self.hf, plus_one=arch.norm_plus_one)  # one call a norm, not six ops
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.dtype, self.device = dtype, torch.device(device)
        self.vocab_size = cfg.vocab_size
        self.num_layers = cfg.num_hidden_layers
        if feature_layers and not all(0 <= i < self.num_layers for i in feature_layers):
            raise ValueError(f"feature layers {tuple(feature_layers)} outside the target's "
                             f"{self.num_layers} layers")
        self.feature_layers = tuple(feature_layers) if feature_layers else None
        self.feature_size = cfg.hidden_size * (len(self.feature_layers) if self.feature_layers else 1)
        self.cache = PagedKVCache(self.num_layers, num_pages, page_size, cfg.num_key_value_heads,
                                  self.head_dim, dtype, device)
        self.scale = (cfg.query_pre_attn_scalar if arch.query_scalar else self.head_dim) ** -0.5
        self.attn_softcap = (getattr(cfg, "attn_logit_softcapping", None) or 0.0) if arch.softcaps else 0.0
        self.final_softcap = (getattr(cfg, "final_logit_softcapping", None) or 0.0) if arch.softcaps else 0.0
        self.q_width = cfg.num_attention_heads * self.head_dim
        self.kv_width = cfg.num_key_value_heads * self.head_dim
        self.layers = [self._plan(i) for i in range(self.num_layers)]
        if cpu:
            # a GGUF target's linears then read a fifth of the bytes (see cpu_quant)
            find_block_weights(self.hf, self.fused_linears())
        if activations == "int8":
            if not (cpu and int8_activations_run()):
                raise ValueError("target activations int8 run on a CPU with AVX2 and FMA, the CPU "
                                 "kernels built (eagle_serve/kernels/cpu_i8.cpp)")
            if not use_int8_activations(self.cpu_linears()):
                raise ValueError(f"target activations int8: {folder} holds no GGUF block weights "
                                 f"(in float32)")
        elif cpu and amx_tiles():
            use_amx_tiles(self.cpu_linears())  # fp32 still: verify rows cost a fraction (cpu_amx)
        self.stack = self.cpu_stack() if cpu else None  # None: hidden_states runs the Python loop
        # greedy rows' tokens from a few fp32 logits (None: every logit; see cpu_argmax; a soft
        # cap saturates, so capped logits may tie where the raw ones do not)
        self.screen = (ScreenedArgmax(self.hf.lm_head)
                       if cpu and screenable(self.hf.lm_head) and not self.final_softcap else None)
        self.graphs = None  # last: its probe runs the forward
        if cuda_graphs and self.device.type == "cuda" and self.fusable and graphable(self.hf.model.rotary_emb):
            self.graphs = TargetGraphs(self._hidden_states, num_pages, self.device, capture=True)
            if not self.graphs.verified():  # this GPU replays them differently: eager
                logging.getLogger(__name__).warning("CUDA graphs off: %s", self.graphs.failed or
                                                    "a replay differs from the eager forward")
                self.graphs = None

    def fused_linears(self) -> list[nn.Module]:
        """Each layer's fused q/k/v and gate/up linears (not among the HF model's modules)."""
        return [m for p in self.layers for m in (p.qkv, p.gate_up)]

    def cpu_linears(self) -> list[CpuLinear]:
        """Every CpuLinear the model holds: its modules' and the fused ones."""
        every = dict.fromkeys([*self.hf.modules(), *self.fused_linears()])
        return [m for m in every if isinstance(m, CpuLinear)]

    def cpu_stack(self) -> CpuDecoderStack | None:
        """The layers in one C++ call (eagle_serve.models.cpu_stack), where they are Llama-like (built at
        load; again where a linear's weight or block form changes)."""
        arch, cfg = self.arch, self.config
        if arch.qk_norm or arch.sandwich_norms or arch.moe or len({p.rope for p in self.layers}) != 1:
            return None
        layers = [StackLayer(layer.input_layernorm, layer.post_attention_layernorm, plan.qkv,
                             layer.self_attn.o_proj, plan.gate_up, layer.mlp.down_proj, plan.act, plan.window)
                  for layer, plan in zip(self.hf.model.layers, self.layers)]
        shape = StackShape(cfg.num_attention_heads, cfg.num_key_value_heads, self.head_dim, self.scale,
                           self.attn_softcap)
        return CpuDecoderStack.build(layers, self.cache, shape)

    def _plan(self, idx: int) -> _LayerPlan:
        """The layer's window and RoPE table, and its projections fused: q/k/v into one linear,
        gate/up into one (one GEMM each per layer)."""
        cfg, arch = self.config, self.arch
        kind = cfg.layer_types[idx] if getattr(cfg, "layer_types", None) else "full_attention"
        sliding = {"none": False, "all": True, "layer_types": kind == "sliding_attention"}[arch.windows]
        window = (getattr(cfg, "sliding_window", None) or 0) if sliding else 0
        layer = self.hf.model.layers[idx]
        attn, mlp = layer.self_attn, layer.mlp
        if arch.fused_qkv:
            qkv, gate_up = attn.qkv_proj, mlp.gate_up_proj
        else:
            qkv = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up = None if arch.moe else fuse_linears([mlp.gate_proj, mlp.up_proj])
        act = None if arch.moe else getattr(mlp, "act_fn", None) or mlp.activation_fn
        return _LayerPlan(window=window, rope=kind if arch.rope_per_layer_type else None,
                          qkv=qkv, gate_up=gate_up, act=act)

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self.hf.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.hf.get_output_embeddings()

    def final_norm_scale(self) -> torch.Tensor:
        """[H] the effective per-channel scale of the final RMSNorm."""
        weight = self.hf.model.norm.weight.detach()
        return weight + 1 if self.arch.norm_plus_one else weight

    def _rope(self, h: torch.Tensor, positions: torch.Tensor) -> dict:
        """-> {rope key: (cos [T, R], sin [T, R])}"""
        rotary, pos = self.hf.model.rotary_emb, positions.unsqueeze(0)
        tables = {}
        for key in {plan.rope for plan in self.layers}:
            cos, sin = rotary(h, pos) if key is None else rotary(h, pos, key)
            tables[key] = (cos[0], sin[0])
        return tables

    def _attention(self, idx: int, attn, x: torch.Tensor, rope: tuple, batch: RaggedBatch) -> torch.Tensor:
        """x: [T, H] (normed) -> [T, H]"""
        num_tokens, d, plan = x.shape[0], self.head_dim, self.layers[idx]
        q, k, v = plan.qkv(x).split([self.q_width, self.kv_width, self.kv_width], dim=-1)
        q, k, v = (t.reshape(num_tokens, -1, d) for t in (q, k, v))  # [T, heads, D]
        if self.arch.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        out = paged_attention_step(q, k, v, *rope, batch, self.cache.keys[idx], self.cache.values[idx],
                                   scale=self.scale, window=plan.window, softcap=self.attn_softcap)
        return attn.o_proj(out)

    def _mlp(self, plan: _LayerPlan, mlp, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] (normed) -> [T, H]: down(act(gate) * up), HF's arithmetic"""
        if plan.gate_up is None:
            out = mlp(x.unsqueeze(0))  # HF's MoE blocks take [B, S, H]
            return (out[0] if isinstance(out, tuple) else out)[0]
        gate, up = plan.gate_up(x).chunk(2, dim=-1)  # [T, I] each
        return mlp.down_proj(plan.act(gate) * up)

    @torch.inference_mode()
    def hidden_states(self, batch: RaggedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> final post-norm hidden [T, H], features [T, F]"""
        replayed = self.graphs(batch) if self.graphs is not None else None
        return replayed if replayed is not None else self._hidden_states(batch)

    def _hidden_states(self, batch: RaggedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.hf.model
        h = model.embed_tokens(batch.input_ids)  # [T, H]
        rope = self._rope(h, batch.positions)
        if self.fusable and fused_layers_run(h):  # on a GPU: few launches a layer
            final, aux = self._fused_layers(h, rope, batch)
        else:
            stacked = None
            if self.stack is not None:  # on a CPU: the same ops in one C++ call
                cos, sin = next(iter(rope.values()))  # its layers share one RoPE table
                stacked = self.stack(h, cos, sin, batch, self.feature_layers or ())
            h, aux = stacked if stacked is not None else self._layers(h, rope, batch)
            final = model.norm(h)
        features = torch.cat([aux[i] for i in self.feature_layers], dim=-1) if self.feature_layers else final
        return final, features

    def _layers(self, h: torch.Tensor, rope: dict, batch: RaggedBatch) -> tuple[torch.Tensor, dict]:
        """Every layer over h [T, H] -> (h [T, H], {feature layer: its input [T, H]})"""
        model = self.hf.model
        wanted, aux = set(self.feature_layers or ()), {}
        for idx, (layer, plan) in enumerate(zip(model.layers, self.layers)):
            if idx in wanted:
                aux[idx] = h
            a = self._attention(idx, layer.self_attn, layer.input_layernorm(h), rope[plan.rope], batch)
            if self.arch.sandwich_norms:
                h = h + layer.post_attention_layernorm(a)
                h = h + layer.post_feedforward_layernorm(self._mlp(plan, layer.mlp, layer.pre_feedforward_layernorm(h)))
            else:
                h = h + a
                h = h + self._mlp(plan, layer.mlp, layer.post_attention_layernorm(h))
        return h, aux

    def _fused_layers(self, h: torch.Tensor, rope: dict, batch: RaggedBatch) -> tuple[torch.Tensor, dict]:
        """_layers and the final norm on the GPU's fused kernels (eagle_serve.kernels.layer_ops:
        each residual add fused with the norm after it) -> (final [T, H], {feature layer: its input})"""
        model = self.hf.model
        wanted, aux = set(self.feature_layers or ()), {}
        delta = None  # [T, H] the last block's output, not yet added to h
        for idx, (layer, plan) in enumerate(zip(model.layers, self.layers)):
            x, h = _add_norm(delta, h, layer.input_layernorm)
            if idx in wanted:
                aux[idx] = h
            delta = self._attention(idx, layer.self_attn, x, rope[plan.rope], batch)
            x, h = _add_norm(delta, h, layer.post_attention_layernorm)
            if plan.gate_up is not None and is_silu(plan.act):
                delta = layer.mlp.down_proj(silu_mul(plan.gate_up(x)))
            else:
                delta = self._mlp(plan, layer.mlp, x)
        final, _ = _add_norm(delta, h, model.norm)
        return final, aux

    def _logits(self, final: torch.Tensor) -> torch.Tensor:
        """final: [R, H] -> [R, V] (soft-capped where the architecture caps them)"""
        logits = self.lm_head(final)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    @torch.inference_mode()
    def forward(self, batch: RaggedBatch, logit_rows: torch.Tensor, sampling: RowSampling,
                kv_moves: tuple[torch.Tensor, torch.Tensor] | None = None,
                processors: LogitsProcessors | None = None) -> TargetOutput:
        """logit_rows: [R] rows of the batch to score; sampling: per row; kv_moves: (src [M],
        dst [M]) slots copied first; processors: applied to the R rows' logits before the
        argmax and the probabilities (eagle_serve.core.processors) -> TargetOutput"""
        if kv_moves is not None:
            self.cache.move(*(on(m, self.device, torch.int64) for m in kv_moves))
        final, features = self.hidden_states(batch)
        sampled = sampling.sampled_indices()
        if (self.screen is not None and processors is None and sampled.numel() == 0
                and logit_rows.numel() <= SCREEN_ROWS):  # greedy rows only
            return TargetOutput(hidden=features, argmax=self.screen(final[logit_rows]),
                                probs=torch.zeros((0, self.vocab_size)))
        logits = self._logits(final[logit_rows])  # [R, V]
        logprobs = apply_processors(logits, processors) if processors is not None else None
        probs = logits.new_zeros((0, logits.shape[1]), dtype=torch.float32)
        if sampled.numel():
            s = sampling.select(sampled)
            rows = logits[sampled]
            if processors is not None and processors.min_p.numel():
                rows = min_p_mask(rows, processors.min_p.to(rows.device)[sampled], s.temperature.to(rows.device))
            probs = compute_probs(rows, s.temperature, s.top_k, s.top_p)
        # on a CPU the argmax of bf16 rows is several times slower than of fp32 ones (the same result)
        argmax = (logits if logits.is_cuda else logits.float()).argmax(dim=-1)  # one launch on a GPU
        return TargetOutput(hidden=features, argmax=argmax, probs=probs, logprobs=logprobs)

    @torch.inference_mode()
    def logits(self, batch: RaggedBatch, logit_rows: torch.Tensor) -> torch.Tensor:
        """The logits [R, V] as HF computes them (tests and training)."""
        final, _ = self.hidden_states(batch)
        return self._logits(final[logit_rows])
