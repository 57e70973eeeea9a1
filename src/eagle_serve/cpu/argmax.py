"""Greedy tokens from a block-quantized LM head without computing every logit in fp32.

A greedy row's token is the argmax of the LM head's fp32 logits (cpu_quant: bitwise the dense
kernel's, first index on ties). On a small target the LM head is the largest linear (SmolLM2-135M:
49152 x 576 Q8_0, ~1.3 ms in a loop on 2 cores, a decode step ~6.5 ms), while eagle_serve/kernels/cpu_i8.cpp
runs it on 8-bit activations in ~0.4 ms (in a forward, where both read the head's 28 MB from
memory, a plain greedy step gains 3-8%: docs/performance.md). `ScreenedArgmax` computes every
logit so, each within a bound B_v of its fp32 value, keeps the tokens that could still be a
row's argmax (approx_v + B_v >= max_u (approx_u - B_u): every token whose fp32 logit may be the
largest), computes their fp32 logits with the dense kernel on their weight rows alone (bitwise
the full head's: a logit's sum does not depend on which others are computed) and takes the
argmax among them, the lowest id on ties: the full head's argmax, bit for bit, from a few dozen
fp32 rows instead of 49152 (8 a row at the median along held-out greedy answers; where logits
are flat and too many are kept, the full head runs instead). The 8-bit logits, their bounds and
the kept tokens come from one C++ call (cpu_i8.cpp's screen_i8, on AVX512-VNNI or AVX2: ~0.45
ms less a call for one row on a 2-core Xeon, ~0.5 ms on a 2-core AVX2 EPYC, than
`ScreenedArgmax.kept`, its PyTorch reference).

The bound, per block b of 32 inputs of a row x (amax_b = max |x| there; the 8-bit form rounds
x_j to da_b * qa_j, da_b = amax_b / 127, |x_j - da_b qa_j| <= da_b / 2 up to fp32 rounding):
    |approx_v - fp32_v|
        <= sum_b amax_b * (A_vb * (0.5 / 127 + 2 K 2^-24) + (255 |d_vb| + |m_vb|) * 2^-16)
with A_vb = sum_j |w_vbj|: the activations' rounding, then both sums' fp32 accumulation over K
inputs (K 2^-24 of sum |w x| each), then the fp32 rounding of the 8-bit kernel's block sums
(integers up to 255 * 127 * 32, scaled by d and offset by m); it is used twice over, so a wrong
token can only be kept, never the right one dropped (tests/cpu/test_cpu_argmax.py checks the
result against the full head's argmax, near ties and exact ties included).
"""
from __future__ import annotations

import torch

from eagle_serve.cpu.matmul import CpuLinear
from eagle_serve.cpu.quant import BLOCK, int8_activations_run
from eagle_serve.kernels.cpu import cpu_kernels

ACTIVATION_ROUNDING = 0.5 / 127 * 1.001  # per unit of A_vb * amax_b (the 1.001: fp32's own)
KERNEL_ROUNDING = 2.0 ** -16  # per unit of (255 |d| + |m|) * amax_b: the 8-bit block sums
MARGIN = 2.0                  # the bound is used this many times over
MAX_CANDIDATES = 1024         # more kept tokens (in all rows) than this: the full head instead
#                               (flat logits, e.g. a forward on random tokens, keep hundreds a row)
FLAT_SMOOTHING = 0.1          # weight of a call in the moving share of calls that kept too many;
SKIP_CALLS = 64               # over half: the next this many calls compute every logit (a screen
#                               that keeps too many costs its 8-bit pass on top of the full head)
SCREEN_ROWS = 8               # the most rows screened (in a loop here, in ms, for 1 / 2 / 4 / 8
#                               rows: the full head 1.27 / 1.30 / 1.54 / 1.98, screened 0.71 / 0.96
#                               / 1.20 / 1.76; past 8 rows the 8-bit pass gains little)


class ScreenedArgmax:
    def __init__(self, head: CpuLinear):
        """head: the LM head, with its exact Q4_1 / Q8_0 blocks found (CpuLinear.find_blocks)."""
        blocks = head.blocks
        assert screenable(head), "ScreenedArgmax needs a block-quantized CPU LM head without bias"
        self.head = head
        self.flat, self.skip = 0.0, 0  # share of recent calls that kept too many; calls to skip
        self.weight = head.weight.detach()  # [V, K] fp32: the rows whose fp32 logits are computed
        self.approx = blocks.int8_activations()
        v, k = self.weight.shape
        spread = self.weight.reshape(v, k // BLOCK, BLOCK).abs().sum(-1)  # [V, B] A_vb
        scales = blocks.scales.abs()  # q8_0 [V, B] |d|; q4_1 [V, B, 2] |d|, |m|
        offset = 255 * scales if scales.dim() == 2 else 255 * scales[..., 0] + scales[..., 1]
        # [B, V]: B_v = amax [R, B] @ this
        rounding = ACTIVATION_ROUNDING + 2 * k * 2.0 ** -24
        self.bound = (MARGIN * (rounding * spread + KERNEL_ROUNDING * offset)).t().contiguous()
        # the same, as cpu_i8.cpp's screen_i8 reads it beside the weights: [V/16, B, 16]
        self.packed_bound = self.bound.view(k // BLOCK, v // 16, 16).transpose(0, 1).contiguous()
        self.fused = True  # kept tokens from one C++ call (False: `kept` below, its reference)

    def kept(self, final: torch.Tensor) -> torch.Tensor:
        """final [R, K] -> the tokens whose logit may be their row's largest in some row, [C]
        ascending (those of approx + B_v >= max_u (approx_u - B_u)); what screen_i8 computes in
        one call, here in PyTorch (its reference)."""
        r, k = final.shape
        approx = self.approx.linear(final, None)  # [R, V]
        bound = final.reshape(r, k // BLOCK, BLOCK).abs().amax(-1) @ self.bound  # [R, V]
        floor = (approx - bound).amax(dim=-1, keepdim=True)  # [R, 1] the best sure lower bound
        return (approx.add_(bound) >= floor).any(dim=0).nonzero().squeeze(1)  # [C] ascending

    def __call__(self, final: torch.Tensor) -> torch.Tensor:
        """final [R, K] fp32 -> [R] int64: the argmax of head(final) per row."""
        if self.skip:  # the screen kept too many lately: every logit, for a while
            self.skip -= 1
            return self.head(final).argmax(dim=-1)
        if self.fused:  # empty where too many are kept or final is not finite
            kept = cpu_kernels().screen_i8(final, self.approx.q, self.approx.scales, self.packed_bound,
                                           MAX_CANDIDATES)
        else:
            kept = self.kept(final)
        flat = not 0 < len(kept) <= MAX_CANDIDATES  # flat (or NaN) logits: every logit
        self.flat += FLAT_SMOOTHING * (flat - self.flat)
        if flat:
            self.skip = SKIP_CALLS if self.flat > 0.5 else 0
            return self.head(final).argmax(dim=-1)
        # every row's argmax is among the kept, and no kept token's logit exceeds its row's
        # largest, so the first largest among them is the row's (the lowest id on ties)
        exact = cpu_kernels().linear(final, self.weight[kept], None)  # [R, C] the head's bits
        return kept[exact.argmax(dim=-1)]


def screenable(head) -> bool:
    """Whether `head` is a CPU LM head ScreenedArgmax takes: exact Q4_1 / Q8_0 blocks (a
    multiple of 16 outputs, as cpu_i8.cpp packs them), no bias, the 8-bit kernel present."""
    return (isinstance(head, CpuLinear) and head.blocks is not None and head.bias is None
            and head.blocks.kind in ("q4_1", "q8_0") and head.out_features % 16 == 0
            and int8_activations_run())
