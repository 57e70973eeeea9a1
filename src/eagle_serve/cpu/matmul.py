"""Linear layers for the small row counts of decoding and verification on CPU.

torch's default fp32 GEMM (MKL, what nn.Linear runs) is slow for the 2-9 rows a verify pass
feeds per request; oneDNN's inner product called on dense tensors
(`torch.ops.mkldnn._linear_pointwise`, the op torch.compile's CPU backend emits for linears) is
fast for any row count, in fp32 and bf16 (`eagle-serve bench forward` measures both;
docs/performance.md has the figures). `CpuLinear` runs that op for fp32 and bf16 (other dtypes,
e.g. the float64 of the exactness tests, fall back to nn.functional.linear). Outputs equal
nn.Linear's up to float rounding. GPU modules are left alone.

Weights are reordered once into oneDNN's blocked layout (what torch.compile's weight
prepacking does): a bf16 decode step's linears read them ~30% faster than the plain layout,
with the same bits, and fp32 verify rows cost a few percent each instead of 1.6x a decode step
for the second row (AVX2). The dense weight is kept beside it (a tied LM head is also the
embedding, and HF's modules keep views of it), so linear weights take twice their size in
memory on CPU. oneDNN runs bf16 only on CPUs with AVX512 (or AVX-NE-CONVERT): elsewhere bf16
linears are nn.functional.linear's, and `auto` picks fp32 there.

bf16 row invariance: the bf16 inner product gives a row the same result whatever the other rows
for 2+ rows, but a single row takes another kernel whose sums differ, so `CpuLinear` pads a
single bf16 row with a zero row; with the row-invariant attention of kernels.paged_attention a
verify pass then reproduces one-token decoding bitwise.

fp32 on CPUs with AVX2 and FMA (the CPUs where `auto` picks fp32) runs our own kernel,
eagle_serve/kernels/cpu.cpp's `linear`: every output element is summed by the same instruction sequence
whatever the other rows, so fp32 rows are row-invariant by construction. It reads the dense
weight directly (fp32 weights are held once, not packed beside), at the machine's memory
bandwidth for a decode step: the linears of the default target take 24 ms against oneDNN's
33 ms for one row, and 35 against 53 ms for five (docs/performance.md). Without AVX2/FMA or a
compiler, oneDNN's packed fp32 runs (not row-invariant: float rounding only).

A GGUF target's fp32 weights are exactly block-quantized values (eagle_serve.cpu.quant): where a
weight's Q4_1 or Q8_0 blocks are found, cpu.cpp's `linear_q4_1`/`linear_q8_0` run on them, with
`linear`'s bits from a fifth of the bytes (on AVX2 up to 12 rows, past which the dense weight is
faster; on AVX-512 any number). On CPUs with AMX tiles a target's Q4_1 blocks run on them
instead (`use_amx_tiles`, eagle_serve/kernels/cpu_amx.cpp): fp32 with exact products in another summation
order, the cost of a verify row a fraction of the FMA kernels'.
"""
from __future__ import annotations

import functools
import threading

import torch
from torch import nn

from eagle_serve.cpu.quant import BlockWeight, block_form, round_to_q8_0
from eagle_serve.kernels.cpu import cpu_kernels

# The row count oneDNN lays packed weights out for. fp32 packed for 1 row (or dense) runs 2+ rows
# on a slow kernel (on an AVX2 CPU the linears of 2 rows cost 1.6x one's); packed for 8, 2 rows
# cost 1.03x and 16 rows 2.2x. bf16 keeps the layout its row-invariance was tested with.
PACK_ROWS = {torch.float32: 8, torch.bfloat16: 2}


def _onednn_ok() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN runs bf16 inner products here (it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT;
    AVX2-only CPUs refuse them, and bf16 linears there are nn.functional.linear's, with no
    row-invariance promise)."""
    if not _onednn_ok():
        return False
    try:
        x = torch.zeros(2, 8, dtype=torch.bfloat16)
        torch.ops.mkldnn._linear_pointwise(x, torch.zeros(4, 8, dtype=torch.bfloat16), None,
                                           "none", [], "")
        return True
    except RuntimeError:
        return False


class CpuLinear(nn.Module):
    """Inference-only drop-in for an nn.Linear on CPU: x [..., in] -> [..., out]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().contiguous(), requires_grad=False)  # [out, in]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.onednn = (self.weight.dtype == torch.float32 and _onednn_ok()
                       or self.weight.dtype == torch.bfloat16 and onednn_bf16())
        self.cpu_kernel = (self.weight.dtype == torch.float32 and self.in_features % 8 == 0  # runs
                           and self.weight.device.type == "cpu" and cpu_kernels() is not None)  # cpu.cpp
        self._packed: torch.Tensor | None = None  # oneDNN's blocked copy, made on first use
        self.blocks: BlockWeight | None = None  # the exact Q4_1/Q8_0 form, once found (cpu_quant)

    def _weight(self) -> torch.Tensor:
        """The weight the inner product reads: oneDNN's blocked layout of it (packed on first
        use, so parts fused into one linear and never called are never packed)."""
        if self._packed is None:
            self._packed = _packed(self.weight.detach())
        return self._packed

    def find_blocks(self) -> BlockWeight | None:
        """Look for the weight's exact block-quantized form (not in forward: it takes host
        syncs and, for a large weight, some 10 ms) -> it, or None."""
        self.blocks = block_form(self.weight) if self.cpu_kernel else None
        return self.blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernel and x.dtype == torch.float32 and not x.requires_grad:  # eagle_serve/kernels/cpu.cpp
            if self.blocks is not None and self.blocks.runs(x.shape[:-1].numel()):
                return self.blocks.linear(x, self.bias)  # the same bits from fewer bytes
            return cpu_kernels().linear(x, self.weight, self.bias)
        if not (self.onednn and x.dtype == self.weight.dtype and x.device.type == "cpu"):
            return nn.functional.linear(x, self.weight, self.bias)
        if x.dtype == torch.bfloat16 and x.shape[:-1].numel() == 1:  # the row-invariant kernel
            if x.requires_grad:
                padded = torch.cat([x.reshape(1, -1), x.new_zeros(1, self.in_features)])
            else:
                padded = _padded_row(self.in_features)  # [2, in]: x, then zeros
                padded[0].copy_(x.reshape(-1))
            out = torch.ops.mkldnn._linear_pointwise(padded, self._weight(), self.bias, "none", [], "")
            return out[:1].view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self._weight(), self.bias, "none", [], "")


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a weight, laid out for PACK_ROWS rows (fp32 falls back to the
    dense weight where oneDNN will not reorder it)."""
    with torch.inference_mode(False):
        try:
            return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS[weight.dtype])
        except RuntimeError:
            if weight.dtype == torch.bfloat16:
                raise
            return weight


_PADDED: dict[tuple[int, int], torch.Tensor] = {}


def _padded_row(width: int) -> torch.Tensor:
    """-> [2, width] bf16 whose second row stays zero: one per thread and width, reused by every
    single-row call (the first row is written just before the GEMM reads it)."""
    key = (threading.get_ident(), width)
    buffer = _PADDED.get(key)
    if buffer is None:
        with torch.inference_mode(False):  # writable in and out of inference mode
            buffer = _PADDED[key] = torch.zeros(2, width, dtype=torch.bfloat16)
    return buffer


def use_cpu_linears(model: nn.Module) -> nn.Module:
    """Replace every CPU nn.Linear inside `model` by a CpuLinear (in place) -> model.

    Tied weights (an LM head sharing the embedding) stay shared: no weight is copied."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu":
                setattr(module, name, CpuLinear(child))
    return model


def fuse_linears(parts: list[nn.Module]) -> nn.Module:
    """One linear for several that read the same input: x [..., in] -> [..., sum of outs], the
    parts' outputs side by side in order. The parts are left as views of the fused weight (no
    weight is held twice). CpuLinear parts give a CpuLinear, so a row's result still does not
    depend on the other rows (see cpu_matmul), on their block forms side by side where every
    part has one of one kind."""
    weights = [p.weight.detach() for p in parts]  # [out_i, in]
    biases = [None if p.bias is None else p.bias.detach() for p in parts]
    if len({b is None for b in biases}) != 1 or len({w.shape[1] for w in weights}) != 1:
        raise ValueError("fused linears need one input width and all or no biases")
    fused = nn.Linear(weights[0].shape[1], sum(w.shape[0] for w in weights),
                      bias=biases[0] is not None, device="meta")
    fused.weight = nn.Parameter(torch.cat(weights), requires_grad=False)  # [sum out_i, in]
    if biases[0] is not None:
        fused.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    fused = CpuLinear(fused) if isinstance(parts[0], CpuLinear) else fused
    blocks = [getattr(p, "blocks", None) for p in parts]
    if isinstance(fused, CpuLinear) and all(blocks) and len({b.kind for b in blocks}) == 1:
        outputs = 1 if blocks[0].kind.endswith("_amx") else 0  # the dim of output groups
        fused.blocks = BlockWeight(blocks[0].kind, torch.cat([b.q for b in blocks], outputs),  # rows apart
                                   torch.cat([b.scales for b in blocks], outputs))
    start = 0
    for part, w in zip(parts, weights):
        part.weight = nn.Parameter(fused.weight[start:start + w.shape[0]], requires_grad=False)
        if fused.bias is not None:
            part.bias = nn.Parameter(fused.bias[start:start + w.shape[0]], requires_grad=False)
        start += w.shape[0]
    return fused


def find_block_weights(model: nn.Module, fused: list[nn.Module]) -> int:
    """Look now (a few seconds for a GGUF target), not at the first decode step, for the exact
    block-quantized form of each CpuLinear that runs: the `fused` ones (see fuse_linears)
    and the model's own, except the parts whose weight a fused one holds -> how many were found."""
    fused = [m for m in fused if isinstance(m, CpuLinear)]
    held = {m.weight.untyped_storage().data_ptr() for m in fused}
    own = [m for m in model.modules()
           if isinstance(m, CpuLinear) and m.weight.untyped_storage().data_ptr() not in held]
    return sum(m.find_blocks() is not None for m in fused + own)


def use_int8_activations(modules) -> int:
    """Run every CpuLinear among `modules` that holds block weights (with a multiple of 16
    outputs) on 8-bit activations (cpu_quant.BlockWeight.int8_activations) -> how many. Lossy:
    llama.cpp's arithmetic, no longer the dense fp32 linear's bits."""
    done = 0
    for m in modules:
        if isinstance(m, CpuLinear) and m.blocks is not None and m.out_features % 16 == 0:
            m.blocks = m.blocks.int8_activations()
            done += 1
    return done


def use_amx_tiles(modules) -> int:
    """Run every CpuLinear among `modules` that holds Q4_1 blocks (with a multiple of 16
    outputs) on AMX tiles (cpu_quant.BlockWeight.amx; where kernels.cpu.amx_tiles) -> how many.
    fp32 still, with exact products: another summation order than the FMA kernels', so not the
    dense fp32 linear's bits, and rows still invariant."""
    done = 0
    for m in modules:
        if isinstance(m, CpuLinear) and m.blocks is not None and m.blocks.kind == "q4_1" \
                and m.out_features % 16 == 0:
            m.blocks = m.blocks.amx()
            done += 1
    return done


def round_linears_to_q8_0(model: nn.Module) -> int:
    """Round the weight of every CpuLinear inside `model` that runs the fp32 row kernel (input
    width a multiple of 32) to GGUF's Q8_0 and run it on those blocks (a quarter of the bytes)
    -> how many. Lossy: for a drafter, whose drafts the target verifies."""
    rounded = 0
    for m in model.modules():
        if isinstance(m, CpuLinear) and m.cpu_kernel and m.in_features % 32 == 0:
            with torch.no_grad():
                m.weight.copy_(round_to_q8_0(m.weight))
            rounded += m.find_blocks() is not None
    return rounded
