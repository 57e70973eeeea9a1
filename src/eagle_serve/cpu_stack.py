"""The target's layer stack in one C++ call on CPU (fp32): kernels/cpu_stack.cpp runs the same
kernels and ATen ops as TargetModel's Python loop over the layers, in the same order, so each
output is bitwise the loop's; it saves PyTorch's Python dispatch of the ~20 ops a layer (about
half of a fp32 decode step of a 135M model on a 2-core CPU, docs/performance.md).

It runs where every layer is what it implements: Llama-like layers (pre-norms, no q/k norms,
one RoPE table, a SiLU-gated MLP; Llama, Mistral, Qwen2, Phi-3 qualify), fp32 on CPU with
cpu.cpp's linears and norms, and a batch whose attention the row-invariant kernel plans (no
long prefill). Anything else takes the Python loop, which stays the reference.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.activations import SiLUActivation

from eagle_serve.cpu_matmul import CpuLinear
from eagle_serve.cpu_norm import CpuRMSNorm
from eagle_serve.interfaces import RaggedBatch
from kernels.cpu import cpu_kernels
from kernels.paged_attention import cpu_rope_write_kv_runs
from kernels.rowwise_attention import attention_plan

_NONE = torch.empty(0)


class CpuDecoderStack:
    """Built once per target (`build`); each forward calls it, and takes the Python loop where
    it returns None."""

    def __init__(self, target, tensors: list[torch.Tensor], windows: list[int], eps: float):
        self.target, self.tensors, self.windows, self.eps = target, tensors, windows, eps

    @classmethod
    def build(cls, target) -> "CpuDecoderStack | None":
        """-> the stack for a TargetModel (after its block weights are found), or None where a
        layer or the setting is not one it implements."""
        arch, layers = target.arch, target.hf.model.layers
        if (target.dtype != torch.float32 or target.device.type != "cpu" or cpu_kernels() is None
                or arch.qk_norm or arch.sandwich_norms or arch.moe
                or len({p.rope for p in target.layers}) != 1 or target.head_dim % 8):
            return None
        tensors, eps = [], set()
        for i, (layer, plan) in enumerate(zip(layers, target.layers)):
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            linears = (plan.qkv, layer.self_attn.o_proj, plan.gate_up, layer.mlp.down_proj)
            if not (all(isinstance(n, CpuRMSNorm) and not n.plus_one for n in norms)
                    and all(isinstance(m, CpuLinear) and m.cpu_kernel for m in linears)
                    and isinstance(plan.act, (SiLUActivation, nn.SiLU))):
                return None
            eps |= {n.eps for n in norms}
            flat = [c.view(-1, *c.shape[2:]) for c in (target.cache.keys[i], target.cache.values[i])]
            tensors += [n.weight for n in norms] + flat
            for m in linears:
                blocks = m.blocks
                tensors += [m.weight, blocks.q if blocks else _NONE, blocks.scales if blocks else _NONE,
                            _NONE if m.bias is None else m.bias]
        if len(eps) != 1:
            return None
        return cls(target, tensors, [p.window for p in target.layers], eps.pop())

    def __call__(self, h: torch.Tensor, rope: dict, batch: RaggedBatch,
                 feature_layers: tuple[int, ...]) -> tuple[torch.Tensor, dict] | None:
        """h [T, H] embedded tokens; rope {key: (cos, sin) [T, R]}, one table (TargetModel._rope)
        -> (h after the last layer [T, H], {feature layer: its input [T, H]}), or None where the
        batch needs the Python loop (a prefill the batched reference attends, or the kernels
        dispatched elsewhere)."""
        t, cache = self.target, self.target.cache
        (cos, sin), = rope.values()
        if not cpu_rope_write_kv_runs(h, cache.keys[0], cos):  # the layers' kernels are not cpu.cpp's
            return None
        plan = attention_plan(batch.cu_seqlens, batch.seq_lens, batch.block_tables, batch.tree_mask,
                              cache.keys[0], batch.plans)
        if plan.slots is None or plan.prefills:
            return None
        wanted = sorted(set(feature_layers))
        out = cpu_kernels().decoder_stack(
            h, self.tensors, self.windows, cos, sin, batch.slot_mapping.to(torch.int64), plan.slots,
            plan.starts, t.config.num_attention_heads, t.config.num_key_value_heads, t.head_dim,
            self.eps, t.scale, t.attn_softcap, wanted)
        return out[0], dict(zip(wanted, out[1:]))
