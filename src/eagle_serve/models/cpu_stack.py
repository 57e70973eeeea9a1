"""Decoder layers in one C++ call on CPU (fp32): eagle_serve/kernels/cpu_stack.cpp runs the same kernels and
ATen ops as the Python loops over the layers (TargetModel's, an EAGLE head's), in the same order,
so each output is bitwise the loop's; it saves PyTorch's Python dispatch of the ~20 ops a layer
(about half of a fp32 decode step of a 135M model on a 2-core CPU, docs/performance.md).

It runs where every layer is what it implements: Llama-like layers (pre-norms, no q/k norms,
one RoPE table, a SiLU-gated MLP; Llama, Mistral, Qwen2, Phi-3 targets and EAGLE heads qualify),
fp32 on CPU with cpu.cpp's linears and norms, and a batch whose attention the row-invariant
kernel plans. Anything else takes the Python loop, which stays the reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from eagle_serve.core.interfaces import RaggedBatch
from eagle_serve.cpu.matmul import CpuLinear, fuse_linears
from eagle_serve.cpu.norm import CpuRMSNorm
from eagle_serve.kernels.cpu import cpu_kernels
from eagle_serve.kernels.paged_attention import cpu_rope_write_kv_runs
from eagle_serve.kernels.rowwise_attention import attention_plan
from eagle_serve.models.paged import PagedKVCache

_NONE = torch.empty(0)


def is_silu(act) -> bool:
    """transformers names its SiLU module SiLUActivation (5.2x) or uses torch's (earlier); by
    name, so that a drafter process need not import transformers' activations."""
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


@dataclass(frozen=True)
class StackLayer:
    """One layer as the stack runs it: h += o(attn(qkv(in_norm(h)))); h += down(silu(gate) * up)
    (gate, up = gate_up(post_norm(h)))."""
    in_norm: nn.Module | None  # None: the caller gives the first layer's attention input
    post_norm: nn.Module
    qkv: nn.Module             # q, k, v side by side
    o: nn.Module
    gate_up: nn.Module         # gate, up side by side
    down: nn.Module
    act: nn.Module
    window: int = 0


@dataclass(frozen=True)
class StackShape:
    q_heads: int
    kv_heads: int
    head_dim: int
    scale: float
    softcap: float = 0.0


class CpuDecoderStack:
    """`build` it once per model and KV cache; calling it returns None where the batch needs
    the Python loop."""

    def __init__(self, tensors: list[torch.Tensor], windows: list[int], eps: float,
                 shape: StackShape, cache: PagedKVCache):
        self.tensors, self.windows, self.eps, self.shape, self.cache = tensors, windows, eps, shape, cache

    @classmethod
    def build(cls, layers: list[StackLayer], cache: PagedKVCache, shape: StackShape
              ) -> "CpuDecoderStack | None":
        """-> the stack, or None where a layer, the dtype or the device is not what it runs."""
        if cpu_kernels() is None or shape.head_dim % 8 or cache.keys[0].dtype != torch.float32 \
                or cache.keys[0].device.type != "cpu":
            return None
        tensors, eps = [], set()
        for i, layer in enumerate(layers):
            norms = [n for n in (layer.in_norm, layer.post_norm) if n is not None]
            linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
            if not (all(isinstance(n, CpuRMSNorm) and not n.plus_one for n in norms)
                    and all(isinstance(m, CpuLinear) and m.cpu_kernel for m in linears)
                    and is_silu(layer.act)
                    and (layer.in_norm is not None or i == 0)):
                return None
            eps |= {n.eps for n in norms}
            flat = [c.view(-1, *c.shape[2:]) for c in (cache.keys[i], cache.values[i])]
            tensors += [_NONE if layer.in_norm is None else layer.in_norm.weight, layer.post_norm.weight]
            tensors += flat
            for m in linears:
                blocks = m.blocks
                tensors += [m.weight, blocks.q if blocks else _NONE, blocks.scales if blocks else _NONE,
                            _NONE if m.bias is None else m.bias]
        if len(eps) != 1:
            return None
        return cls(tensors, [layer.window for layer in layers], eps.pop(), shape, cache)

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: RaggedBatch,
                 feature_layers: tuple[int, ...] = (), first_input: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict] | None:
        """h [T, H] the first layer's input (residual); cos, sin [T, R]; first_input: the first
        layer's attention input (else in_norm(h)) -> (h after the last layer [T, H], {feature
        layer: its input [T, H]}), or None where the batch needs the Python loop (the kernels
        dispatched elsewhere)."""
        keys = self.cache.keys[0]
        if not cpu_rope_write_kv_runs(h, keys, cos):  # the layers' kernels are not cpu.cpp's
            return None
        plan = attention_plan(batch.cu_seqlens, batch.seq_lens, batch.block_tables, batch.tree_mask,
                              keys, batch.plans)
        if plan.slots is None:
            return None
        wanted, s = sorted(set(feature_layers)), self.shape
        out = cpu_kernels().decoder_stack(
            h, _NONE if first_input is None else first_input, self.tensors, self.windows, cos, sin,
            batch.slot_mapping.to(torch.int64), plan.slots, plan.starts, s.q_heads, s.kv_heads,
            s.head_dim, self.eps, s.scale, s.softcap, wanted)
        return out[0], dict(zip(wanted, out[1:]))


def head_stack(head: nn.Module, cache: PagedKVCache) -> CpuDecoderStack | None:
    """An EAGLE head's layers as a stack (its first layer's attention input comes from
    head.inputs). Fuses each layer's q/k/v and gate/up projections (the parts become views of
    the fused weights; Q8_0 blocks carry over): for inference."""
    linears = [m for m in head.layers.modules() if isinstance(m, nn.Linear | CpuLinear)]
    if head.spec.qk_norm or not all(isinstance(m, CpuLinear) and m.cpu_kernel for m in linears):
        return None
    layers = []
    for i, layer in enumerate(head.layers):
        attn, mlp = layer.self_attn, layer.mlp
        fused = [fuse_linears(parts) for parts in ([attn.q_proj, attn.k_proj, attn.v_proj],
                                                   [mlp.gate_proj, mlp.up_proj])]
        layers.append(StackLayer(None if i == 0 else layer.input_layernorm, layer.post_attention_layernorm,
                                 fused[0], attn.o_proj, fused[1], mlp.down_proj, nn.SiLU()))
    shape = StackShape(head.spec.layer.num_attention_heads, head.spec.layer.num_key_value_heads,
                       head.head_dim, head.head_dim ** -0.5)
    return CpuDecoderStack.build(layers, cache, shape)
