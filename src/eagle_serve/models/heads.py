"""EAGLE head kinds: the trainable part of a drafter, one class per kind behind one interface.

A head runs its decoder layers over rows (token embedding, feature) and returns an output
feature [T, H], which is both what its logits read and what the next draft step feeds back.

- `Eagle1Head` (EAGLE-1/EAGLE-2 checkpoints): the feature is the target's final hidden state;
  x = fc(cat(emb, feature)) enters layer 0, which has no input norm; logits come from the
  target's LM head over the whole vocabulary.
- `Eagle3Head`: the feature is the concatenated inputs of chosen target layers, fused by fc;
  layer 0 attends over cat(input_layernorm(emb), hidden_norm(h)) (2H wide) and adds it to h
  (or to hidden_norm(h) with `norm_before_residual`); further layers are plain pre-norm layers
  (multi-layer heads, as vLLM runs them); logits = lm_head(norm(feature)) over a draft
  vocabulary with target id = draft id + d2t[draft id], or the target's LM head if the head
  has none.

Parameter names follow the published layouts (`fc`, `layers.{i}.*`, `norm`, `lm_head`, `d2t`).
Each kind also reads and writes its own fields of a published config and names what in its
weights does not fit a target; checkpoints.py does the file work and the checks every kind
shares. Knows nothing about files, requests or drafting policy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from eagle_serve.core.interfaces import RaggedBatch
from eagle_serve.cpu.matmul import fuse_linears
from eagle_serve.kernels.layer_ops import add_rms_norm, fused_layers_run, silu_mul
from eagle_serve.models import head_layer
from eagle_serve.models.head_layer import HeadLayer, Rotary
from eagle_serve.models.paged import PagedKVCache, paged_attention_step


@dataclass(frozen=True)
class HeadSpec:
    """What a head is: read from its config.json and weight shapes."""
    layer: HeadLayer                  # shape of its decoder layers (hidden, heads, MLP, RoPE, eps)
    target_hidden_size: int
    draft_vocab_size: int             # == the target's vocabulary for EAGLE-1 / heads without d2t
    num_layers: int = 1
    fc_bias: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False             # RMSNorm on each head's q and k (Qwen3-style layers)
    norm_before_residual: bool = False  # EAGLE-3: layer 0 adds its output to hidden_norm(h)
    feature_layers: tuple[int, ...] | None = None  # EAGLE-3: target layers whose inputs it fuses
    own_lm_head: bool = True          # False = logits through the target's LM head (always for EAGLE-1)

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def head_dim(self) -> int:
        return getattr(self.layer, "head_dim", None) or self.hidden_size // self.layer.num_attention_heads


class _Attention(nn.Module):
    def __init__(self, spec: HeadSpec, in_features: int):
        super().__init__()
        cfg, d = spec.layer, spec.head_dim
        q_out, kv_out = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        self.q_proj = nn.Linear(in_features, q_out, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(in_features, kv_out, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(in_features, kv_out, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.head_dim, self.qk_norm = d, spec.qk_norm

    def forward(self, x, cos, sin, batch: RaggedBatch, k_cache, v_cache) -> torch.Tensor:
        """x: [T, in_features] -> [T, H]"""
        t, d = x.shape[0], self.head_dim
        q, k, v = (p(x).view(t, -1, d) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = paged_attention_step(q, k, v, cos, sin, batch, k_cache, v_cache, scale=d ** -0.5)
        return self.o_proj(out)


def _on_kernels(x: torch.Tensor) -> bool:
    """The GPU path's fused kernels (eagle_serve.kernels.layer_ops) serve drafting; training
    (gradients on) keeps PyTorch's ops, which the kernels have no backward for."""
    return fused_layers_run(x) and not torch.is_grad_enabled()


class RMSNorm(head_layer.RMSNorm):
    """LlamaRMSNorm's weight and arithmetic: one launch on the GPU path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _on_kernels(x):
            return super().forward(x)
        rows = x.reshape(-1, x.shape[-1])  # [N, H]: q/k norms normalise each head's row
        return add_rms_norm(rows, None, self.weight, self.variance_epsilon)[0].view(x.shape)


class _MLP(nn.Module):
    def __init__(self, spec: HeadSpec):
        super().__init__()
        h, i, bias = spec.hidden_size, spec.layer.intermediate_size, spec.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self._gate_up = None  # the GPU path's fused gate/up projection, built at first use

    def forward(self, x):
        if _on_kernels(x):  # gate and up in one GEMM, SiLU-and-mul in one launch
            if self._gate_up is None:  # not a submodule: the published weights stay gate's and up's
                object.__setattr__(self, "_gate_up", fuse_linears([self.gate_proj, self.up_proj]))
            return self.down_proj(silu_mul(self._gate_up(x)))
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    """A decoder layer; `input_norm` False for EAGLE-1's first layer, `fused` True for
    EAGLE-3's first layer (2H-wide attention input and a norm for the fed-back hidden)."""

    def __init__(self, spec: HeadSpec, input_norm: bool = True, fused: bool = False):
        super().__init__()
        h, eps = spec.hidden_size, spec.layer.rms_norm_eps
        self.self_attn = _Attention(spec, 2 * h if fused else h)
        self.mlp = _MLP(spec)
        self.post_attention_layernorm = RMSNorm(h, eps=eps)
        if input_norm:
            self.input_layernorm = RMSNorm(h, eps=eps)
        if fused:
            self.hidden_norm = RMSNorm(h, eps=eps)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleHead(nn.Module):
    """The interface every head kind implements (see the module docstring), including how the
    kind reads and writes its own fields of a published config (checkpoints.py reads files)."""
    version = 0
    architecture = ""               # the `architectures` entry of a saved config
    single_layer_name = "layers.0"  # published name of a one-layer head's layer
    unused_keys: tuple[str, ...] = ()  # published weights the head does not load
    fc: nn.Linear
    layers: nn.ModuleList

    @classmethod
    def kind_fields(cls, raw: dict, state: dict, target) -> dict:
        """This kind's HeadSpec fields from a published config `raw` and weights (our names);
        raises ValueError naming what does not fit."""
        raise NotImplementedError

    @classmethod
    def default_fields(cls, target, draft_vocab_size: int | None, feature_layers) -> dict:
        """This kind's HeadSpec fields for a new head shaped for `target`."""
        raise NotImplementedError

    @classmethod
    def fit_problems(cls, spec: HeadSpec, state: dict, target) -> list[str]:
        """What about these weights does not fit the target (vocabulary, hidden size)."""
        return []

    def published(self, vocab_maps: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
        """-> weights under their published names, this kind's config fields"""
        return {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, {}

    def load_published(self, state: dict[str, torch.Tensor]) -> tuple[list, list]:
        """Load weights read from a published checkpoint -> (missing, unexpected) keys"""
        return self.load_state_dict(state, strict=False)

    def __init__(self, spec: HeadSpec):
        super().__init__()
        self.spec = spec
        self.head_dim = spec.head_dim
        self.rotary = Rotary(spec.layer)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layer(self) -> _Layer:
        """The first layer (the one that fuses embedding and feature)."""
        return self.layers[0]

    @property
    def uses_target_lm_head(self) -> bool:
        return True

    def fuse(self, emb: torch.Tensor, hidden: torch.Tensor, from_target: bool) -> tuple:
        """emb: [T, H]; hidden: [T, F] -> (residual [T, H], first layer's attention input)"""
        raise NotImplementedError

    def logits(self, feature: torch.Tensor, target_lm_head: torch.Tensor | None) -> torch.Tensor:
        """feature: [R, H]; target_lm_head: [V, H] or None -> [R, V_draft]"""
        raise NotImplementedError

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def to_target_probs(self, q: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """q: [R, V_draft] -> [R, V] (zero outside the draft vocabulary)"""
        return q

    def step(self, emb, hidden, from_target, batch: RaggedBatch, cache: PagedKVCache):
        """Every layer over ragged rows. emb: [T, H]; hidden: [T, F] -> output feature [T, H]"""
        return self.layers_over(*self.inputs(emb, hidden, from_target, batch), batch, cache)

    def inputs(self, emb, hidden, from_target, batch: RaggedBatch):
        """-> residual [T, H], the first layer's attention input [T, H or 2H], cos, sin [T, head_dim]"""
        residual, x = self.fuse(emb, hidden, from_target)
        cos, sin = self.rotary(residual, batch.positions.unsqueeze(0))
        return residual, x, cos[0], sin[0]

    def layers_over(self, residual, x, cos, sin, batch: RaggedBatch, cache: PagedKVCache):
        """The layers from `inputs`' outputs -> output feature [T, H]"""
        first = self.layers[0]
        h = residual + first.self_attn(x, cos, sin, batch, cache.keys[0], cache.values[0])
        h = first.feed_forward(h)
        for i, layer in enumerate(self.layers[1:], start=1):
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, batch, cache.keys[i], cache.values[i])
            h = layer.feed_forward(h)
        return h


class Eagle1Head(EagleHead):
    version = 1
    architecture = "LlamaForCausalLM"
    unused_keys = ("lm_head.weight", "t2d")  # logits come through the target's LM head

    @classmethod
    def kind_fields(cls, raw, state, target):
        return cls.default_fields(target, None, None)

    @classmethod
    def default_fields(cls, target, draft_vocab_size, feature_layers):
        return dict(draft_vocab_size=target.vocab_size, own_lm_head=False, feature_layers=None)

    @classmethod
    def fit_problems(cls, spec, state, target):
        if spec.hidden_size == target.hidden_size:
            return []
        return [f"EAGLE-1 fc.weight {tuple(state['fc.weight'].shape)} does not fit target hidden size "
                f"{target.hidden_size}"]

    def __init__(self, spec: HeadSpec):
        super().__init__(spec)
        h = spec.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=spec.fc_bias)
        self.layers = nn.ModuleList([_Layer(spec, input_norm=i > 0) for i in range(spec.num_layers)])

    def fuse(self, emb, hidden, from_target):
        x = self.fc(torch.cat([emb, hidden], dim=-1))
        return x, x

    def logits(self, feature, target_lm_head):
        return feature @ target_lm_head.T


class Eagle3Head(EagleHead):
    version = 3
    architecture = "LlamaForCausalLMEagle3"
    single_layer_name = "midlayer"
    unused_keys = ("t2d",)  # d2t says the same

    @classmethod
    def kind_fields(cls, raw, state, target):
        layers = cls.feature_layers_of(raw, target.num_hidden_layers)
        t_hidden = raw.get("target_hidden_size") or target.hidden_size
        if state["fc.weight"].shape[1] != len(layers) * t_hidden:
            raise ValueError(f"fc.weight is {tuple(state['fc.weight'].shape)} but fuses {len(layers)} "
                             f"target layers of hidden size {t_hidden}")
        own = "lm_head.weight" in state
        vocab = state["lm_head.weight"].shape[0] if own else target.vocab_size
        if own and raw.get("draft_vocab_size", vocab) != vocab:
            raise ValueError(f"config draft_vocab_size {raw['draft_vocab_size']} != lm_head.weight rows {vocab}")
        return dict(feature_layers=layers, own_lm_head=own, draft_vocab_size=vocab)

    @staticmethod
    def feature_layers_of(raw: dict, num_target_layers: int) -> tuple[int, ...]:
        """Inputs of which target layers the head fuses, as its config says."""
        if raw.get("eagle_aux_hidden_state_layer_ids"):  # vLLM, speculators: layer inputs
            return tuple(raw["eagle_aux_hidden_state_layer_ids"])
        nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if nested:  # SpecForge, SGLang: layer outputs = the next layers' inputs
            return tuple(i + 1 for i in nested)
        return eagle3_feature_layers(num_target_layers)

    @classmethod
    def default_fields(cls, target, draft_vocab_size, feature_layers):
        layers = tuple(feature_layers or eagle3_feature_layers(target.num_hidden_layers))
        return dict(feature_layers=layers, draft_vocab_size=draft_vocab_size or target.vocab_size,
                    own_lm_head=True)

    @classmethod
    def fit_problems(cls, spec, state, target):
        vocab, draft_vocab, d2t, t2d = target.vocab_size, spec.draft_vocab_size, state.get("d2t"), state.get("t2d")
        problems = []
        if d2t is None and draft_vocab != vocab:
            problems.append(f"draft vocab {draft_vocab} != target vocab {vocab} and no d2t map")
        if d2t is not None and (d2t.shape[0] != draft_vocab
                                or int((torch.arange(draft_vocab) + d2t.long()).max()) >= vocab):
            problems.append(f"d2t ({d2t.shape[0]} ids) does not map a draft vocab of {draft_vocab} "
                            f"into the target vocab of {vocab}")
        if t2d is not None and t2d.shape[0] != vocab:
            problems.append(f"t2d covers {t2d.shape[0]} target ids, the target vocab has {vocab}")
        return problems

    def published(self, vocab_maps=True):
        state, spec = super().published()[0], self.spec
        if not vocab_maps:
            state.pop("d2t")
        else:
            t2d = torch.zeros(spec.layer.vocab_size, dtype=torch.bool)
            t2d[torch.arange(spec.draft_vocab_size) + state["d2t"]] = True
            state["t2d"] = t2d
        return state, {"draft_vocab_size": spec.draft_vocab_size, "norm_before_residual": spec.norm_before_residual,
                       "eagle_aux_hidden_state_layer_ids": list(spec.feature_layers)}

    def load_published(self, state):
        state = {"d2t": torch.zeros(self.spec.draft_vocab_size, dtype=torch.int64)} | state  # none: identity
        return super().load_published(state)

    def __init__(self, spec: HeadSpec):
        super().__init__(spec)
        h = spec.hidden_size
        fc_in = len(spec.feature_layers) * spec.target_hidden_size
        self.fc = nn.Linear(fc_in, h, bias=spec.fc_bias)
        self.layers = nn.ModuleList([_Layer(spec, fused=i == 0) for i in range(spec.num_layers)])
        self.norm = RMSNorm(h, eps=spec.layer.rms_norm_eps)
        self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False) if spec.own_lm_head else None
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.int64))

    @property
    def uses_target_lm_head(self) -> bool:
        return self.lm_head is None

    def fuse(self, emb, hidden, from_target):
        if from_target:
            hidden = self.fc(hidden)
        first = self.layers[0]
        normed = first.hidden_norm(hidden)
        residual = normed if self.spec.norm_before_residual else hidden
        return residual, torch.cat([first.input_layernorm(emb), normed], dim=-1)

    def logits(self, feature, target_lm_head):
        normed = self.norm(feature)
        return self.lm_head(normed) if self.lm_head is not None else normed @ target_lm_head.T

    def to_target_ids(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]

    def to_target_probs(self, q, vocab_size):
        out = q.new_zeros((q.shape[0], vocab_size))
        return out.index_copy_(1, self.to_target_ids(torch.arange(q.shape[1], device=q.device)), q)


HEAD_KINDS: dict[int, type[EagleHead]] = {1: Eagle1Head, 3: Eagle3Head}


def eagle3_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default: the inputs of target layers 2, L//2 and L-3 (in that order)."""
    return (2, num_layers // 2, num_layers - 3)


def layer_config(target_config, **overrides) -> HeadLayer:
    """A head layer config shaped like the target's layers (Llama layers, the target's sizes)."""
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size")
    values = {k: getattr(target_config, k) for k in keep if getattr(target_config, k, None) is not None}
    values["rope_parameters"] = {"rope_type": "default", "rope_theta": _rope_theta(target_config)}
    return HeadLayer(**(values | overrides))


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" not in params and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # per-layer-type tables (Gemma 3)
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def random_head(target_config, version: int, draft_vocab_size: int | None = None,
                fc_bias: bool = False, seed: int = 0, d2t: torch.Tensor | None = None,
                feature_layers: tuple[int, ...] | None = None, random_norms: bool = False,
                **spec_fields) -> EagleHead:
    """A seeded random head shaped for `target_config` (tests, and the start of training).
    feature_layers: the target layers (inputs of) an EAGLE-3 head fuses; default 2, L//2, L-3;
    random_norms: norm weights drawn from [0.5, 1.5] rather than ones (a dropped norm shows);
    spec_fields: other HeadSpec fields (layer, num_layers, biases, qk_norm, ...)."""
    torch.manual_seed(seed)
    kind = HEAD_KINDS[version]
    fields = kind.default_fields(target_config, draft_vocab_size, feature_layers) | spec_fields
    fields.setdefault("layer", layer_config(target_config))
    head = kind(HeadSpec(target_hidden_size=target_config.hidden_size, fc_bias=fc_bias, **fields))
    for name, p in head.named_parameters():
        if p.ndim == 2:
            torch.nn.init.normal_(p, std=0.02)
        elif random_norms and name.endswith("norm.weight"):
            torch.nn.init.uniform_(p, 0.5, 1.5)
    if d2t is not None:
        head.d2t.copy_(d2t)
    return head
