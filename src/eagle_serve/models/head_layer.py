"""A head's decoder-layer shape and the two small modules its layers share, RMSNorm and RoPE, in
transformers' Llama arithmetic (LlamaConfig's defaults, LlamaRMSNorm, LlamaRotaryEmbedding).

Ours rather than transformers' because importing transformers' configuration or modeling code
brings torch._dynamo and torch.distributed with it, which would make that import most of a
drafter process's start-up work for no more than a config and a cosine table. RoPE kinds other
than the default still come from transformers (`ROPE_INIT_FUNCTIONS` through
LlamaRotaryEmbedding), imported when a head uses one.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch
from torch import nn


def _default_rope() -> dict:
    return {"rope_type": "default", "rope_theta": 10000.0}


@dataclass(frozen=True, eq=False)  # eq=False: hashable by identity despite its dict field
class HeadLayer:
    """Shape of a head's decoder layers, under a Llama config.json's names and defaults."""
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: num_attention_heads
    head_dim: int | None = None             # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    vocab_size: int = 32000
    rope_parameters: dict = field(default_factory=_default_rope)  # rope_type, rope_theta, scaling
    hidden_act: str = "silu"

    def __post_init__(self):
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    @classmethod
    def from_config(cls, raw: dict) -> HeadLayer:
        """The layer fields of a config.json; the legacy `rope_theta` / `rope_scaling` (with
        `type` for `rope_type`) become `rope_parameters`, as transformers reads them."""
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope.setdefault("rope_theta", float(raw.get("rope_theta", 10000.0)))
        names = {f.name for f in fields(cls)} - {"rope_parameters"}
        return cls(**{k: raw[k] for k in names if raw.get(k) is not None}, rope_parameters=rope)

    def to_dict(self) -> dict:
        """config.json fields (a Llama layer's)."""
        return {"model_type": "llama", **asdict(self), "rope_theta": self.rope_parameters["rope_theta"]}


class RMSNorm(nn.Module):
    """LlamaRMSNorm: x [..., H] -> weight * x / rms(x), the rms taken in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """positions [1, T] -> cos, sin [1, T, head_dim] in x's dtype, computed in float32 as
    LlamaRotaryEmbedding computes them."""

    def __init__(self, layer: HeadLayer):
        super().__init__()
        self.rope_type = layer.rope_parameters.get("rope_type", "default")
        self.scaled = None
        if self.rope_type != "default":
            from transformers import LlamaConfig
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            self.scaled = LlamaRotaryEmbedding(LlamaConfig(**asdict(layer)))
            return
        dim, base = layer.head_dim, layer.rope_parameters["rope_theta"]
        self.inv_freq = nn.Buffer(1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)),
                                  persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scaled is not None:
            return self.scaled(x, positions)
        freqs = positions[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)
