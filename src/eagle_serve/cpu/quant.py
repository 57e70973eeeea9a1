"""Block-quantized copies of fp32 weights that are exactly representable so (GGUF's Q4_1, Q8_0).

A target dequantized from a GGUF file (the default one is SmolLM2's Q4_1 GGUF: every layer's
linears Q4_1, the embedding / tied LM head Q8_0) holds fp32 weights that are, block by block of
32 along the input dimension, d * q + m (Q4_1: q in 0..15, d and m fp16) or d * q (Q8_0: q in
-128..127, d fp16). `block_form` finds those d, m, q again and checks that they rebuild every
weight bitwise; eagle_serve/kernels/cpu.cpp's `linear_q4_1` / `linear_q8_0` then rebuild each block in
registers and run `linear`'s instruction sequence, so the output equals the dense fp32 linear's
bit for bit while a decode step reads 0.75 (Q4_1) or 1.125 (Q8_0) bytes per weight instead of 4:
on a 2-core CPU the default target's decode step is memory-bound, so this is most of its time.
Any weight that is not exactly representable (trained fp32 weights, tiny random test models)
keeps the dense kernel; nothing is approximated.

Not GGUF's file format reader (transformers + gguf dequantize the file): we recover the blocks
from the dense weights, so a GGUF-converted folder needs no extra files and any other loader's
fp32 weights are checked the same way.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_serve.kernels.cpu import cpu_kernels

BLOCK = 32
_SCALE_STEPS = (0, -1, 1, -2, 2)  # fp16 neighbours of the estimated scale that are tried
_LEVELS = {"q4_1": 15, "q8_0": 127}
CHUNK_BYTES = 1 << 19  # rows of a weight `block_form` checks at a time


def max_block_rows() -> int:
    """The most rows for which the block kernels beat the dense one (eagle_serve/kernels/cpu.h)."""
    return cpu_kernels().max_block_rows


def int8_activations_run() -> bool:
    """Whether eagle_serve/kernels/cpu_i8.cpp's `linear_i8` runs here: wherever the CPU kernels do (AVX2 and
    FMA; AVX512-VNNI where the CPU has it and the kernels are built for AVX-512)."""
    return cpu_kernels() is not None


@dataclass(frozen=True)
class BlockWeight:
    """q4_1: q [N, K/2] uint8 (byte j of a block: weight j low nibble, j + 16 high), scales
    [N, K/32, 2] fp32 (d, m); q8_0: q [N, K] int8, scales [N, K/32] fp32 (d); "q4_1_a8" and
    "q8_0_a8": the same weights packed for 8-bit activations (`int8_activations`):
    q [N/16, K/32, 4 or 8, 64] uint8 (q8_0_a8 without VNNI: int8), scales [N/16, K/32, 2, 16]
    (cpu_i8.cpp's layout); "q4_1_amx": packed for AMX tiles (`amx`): q [K/32, N/16, 256] uint8,
    scales [K/32, N/16, 2, 16] (cpu_amx.cpp's layout)."""
    kind: str
    q: torch.Tensor
    scales: torch.Tensor

    def runs(self, rows: int) -> bool:
        """Whether `linear` takes this many rows (the exact kinds give way to the dense weight
        past max_block_rows, which gives the same bits; the _a8 and _amx kinds run any number,
        as their arithmetic is their own)."""
        return self.kind.endswith(("_a8", "_amx")) or rows <= max_block_rows()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] fp32 -> [..., N]: bitwise the dense fp32 kernel's output, or (the _a8
        kinds) llama.cpp's arithmetic on x rounded to 8 bits per block of 32, or (q4_1_amx)
        fp32 on AMX tiles: exact products, another summation order"""
        k = cpu_kernels()
        op = {"q4_1": k.linear_q4_1, "q8_0": k.linear_q8_0, "q4_1_amx": k.linear_q4_1_amx}.get(self.kind, k.linear_i8)
        return op(x, self.q, self.scales, bias)

    def amx(self) -> "BlockWeight":
        """A Q4_1 weight in cpu_amx.cpp's layout (for `kernels.cpu.amx_tiles`): per block and
        group of 16 outputs, byte 32 c + i holds the weights of output i // 2 at k = 2 c + i % 2
        (low nibble) and k = 16 + 2 c + i % 2 (high), c = 0..7; scales (d, m) [K/32, N/16, 2, 16]."""
        n, blocks = self.q.shape[0], self.q.shape[1] // 16
        if self.kind != "q4_1" or n % 16:
            raise ValueError(f"AMX tiles take Q4_1 weights of a multiple of 16 outputs, not {self.kind} [{n}, ..]")
        b = self.q.view(n, blocks, 16)
        w = torch.stack([b & 15, b >> 4], dim=2)  # [N, B, 2, 16]: the weight at k = 16 h + j
        w = w.view(n // 16, 16, blocks, 2, 8, 2).permute(2, 0, 4, 1, 5, 3)  # [B, G, c, lane, k % 2, half]
        q = (w[..., 0] | (w[..., 1] << 4)).reshape(blocks, n // 16, 256)
        scales = self.scales.view(n // 16, 16, blocks, 2).permute(2, 0, 3, 1)  # [B, G, 2, lane]
        return BlockWeight("q4_1_amx", q.contiguous(), scales.contiguous())

    def int8_activations(self) -> "BlockWeight":
        """The same weights in cpu_i8.cpp's layout: groups of 16 weight rows, per block of 32
        chunks of 4 inputs x 16 rows (Q4_1: nibbles as GGUF packs them, low k = 4c + j, high
        k = 16 + 4c + j; Q8_0 with VNNI: q + 128 as unsigned bytes, offset -128 d; without: q)."""
        if self.kind.endswith("_a8"):
            return self
        n = self.q.shape[0]
        if n % 16:
            raise ValueError(f"8-bit activations need a multiple of 16 output features, not {n}")
        if self.kind == "q4_1":
            blocks, chunks, q, scales = self.q.shape[1] // 16, 4, self.q, self.scales  # [N, B, 2]
        elif cpu_kernels().i8_vnni:
            blocks, chunks = self.q.shape[1] // BLOCK, 8
            q = (self.q.to(torch.int16) + 128).to(torch.uint8)
            scales = torch.stack([self.scales, -128 * self.scales], dim=-1)
        else:
            blocks, chunks, q = self.q.shape[1] // BLOCK, 8, self.q
            scales = torch.stack([self.scales, torch.zeros_like(self.scales)], dim=-1)
        q = q.reshape(n // 16, 16, blocks, chunks, 4).permute(0, 2, 3, 1, 4)  # [G, B, C, lane, 4]
        scales = scales.reshape(n // 16, 16, blocks, 2).permute(0, 2, 3, 1)  # [G, B, 2, lane]
        return BlockWeight(self.kind + "_a8", q.reshape(n // 16, blocks, chunks, 64).contiguous(),
                           scales.contiguous())


def block_form(weight: torch.Tensor) -> BlockWeight | None:
    """weight [N, K] fp32 -> its exact Q4_1 or Q8_0 form, or None where it has none (or the CPU
    kernels are missing). A few rows are tried first, so a weight with no form costs microseconds."""
    if (weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK
            or weight.device.type != "cpu" or cpu_kernels() is None):
        return None
    w = weight.detach()
    for kind in _LEVELS:
        if _blocks(w[:4], kind) is not None:
            found = _blocks_by_rows(w, kind)
            if found is not None:
                return _pack(kind, *found)
    return None


def _blocks_by_rows(w: torch.Tensor, kind: str):
    """_blocks over slices of rows of ~CHUNK_BYTES each: the dozen passes it makes over a slice
    stay in the CPU's cache instead of streaming the whole weight from memory each time."""
    rows = max(1, CHUNK_BYTES // (w.shape[1] * w.element_size()))
    parts = []
    for start in range(0, w.shape[0], rows):
        part = _blocks(w[start:start + rows], kind)
        if part is None:
            return None
        parts.append(part)
    q, d, m = zip(*parts)
    return torch.cat(q), torch.cat(d), None if m[0] is None else torch.cat(m)


def holds_blocks(folder: str | Path) -> bool:
    """Whether an HF folder's weights are exact GGUF blocks (its first layer's first linear has a
    Q4_1/Q8_0 form, e.g. the default target), so float32 on the block kernels reads fewer bytes
    than bf16. Reads that one tensor; False where the CPU kernels are missing."""
    return _holds_blocks(str(Path(folder).resolve()))


@functools.cache
def _holds_blocks(folder: str) -> bool:
    from safetensors import safe_open

    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            key = next((k for k in f.keys() if ".layers.0." in k and k.endswith("proj.weight")), None)
            if key is not None:
                return block_form(f.get_tensor(key)) is not None
    return False


def _blocks(w: torch.Tensor, kind: str):
    """w [N, K] -> (q [N, K/32, 32] int, d [N, K/32], m [N, K/32] or None) rebuilding w bitwise
    (d * q exact in fp32, + m rounded once: what one FMA and the dequantizer's multiply-add
    both give), or None. The estimated scale is tried on every block at once; its fp16
    neighbours only on the blocks it missed."""
    b = w.reshape(w.shape[0], -1, BLOCK)  # [N, B, 32]
    m = b.amin(-1, keepdim=True) if kind == "q4_1" else None  # [N, B, 1]
    spread = b.amax(-1, keepdim=True) - m if m is not None else b.abs().amax(-1, keepdim=True)
    low, high = (0, 15) if kind == "q4_1" else (-128, 127)
    guess = (spread / _LEVELS[kind]).to(torch.float16).view(torch.int16)  # [N, B, 1]
    shifted = b - m if m is not None else b

    def attempt(scale, blocks, min_, original):
        """scale [..., 1] -> (q [..., 32], whether scale * q + min_ rebuilds each block [...])"""
        q = torch.where(scale > 0, blocks / scale, 0).round_().clamp_(low, high).add_(0.0)  # no -0
        rebuilt = scale * q + min_
        return q, (rebuilt.view(torch.int32) == original.view(torch.int32)).all(-1)

    scale = guess.view(torch.float16).float()
    q, found = attempt(scale, shifted, 0 if m is None else m, b)
    d = scale.squeeze(-1)  # [N, B]
    for step in _SCALE_STEPS[1:]:
        if found.all():
            break
        idx = (~found).nonzero(as_tuple=True)
        cand = (guess[idx] + step).view(torch.float16).float()  # [T, 1]
        qc, good = attempt(cand, shifted[idx], 0 if m is None else m[idx], b[idx])
        sel = tuple(i[good] for i in idx)
        q[sel], d[sel], found[sel] = qc[good], cand[good].squeeze(-1), True
    if not found.all():
        return None
    return q, d, None if m is None else m.squeeze(-1)


def _pack(kind: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> BlockWeight:
    n = q.shape[0]
    if kind == "q8_0":
        return BlockWeight(kind, q.to(torch.int8).reshape(n, -1).contiguous(), d.contiguous())
    q = q.to(torch.uint8)
    packed = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, -1).contiguous()  # [N, K/2]
    return BlockWeight(kind, packed, torch.stack([d, m], dim=-1).contiguous())


def round_to_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] fp32 (K a multiple of 32) -> the nearest Q8_0 weight as fp32, per block of 32:
    d = fp16(max |w| / 127), w = d * round(w / d) (what GGUF's Q8_0 keeps; `block_form` finds it)"""
    n, k = weight.shape
    b = weight.detach().reshape(n, k // BLOCK, BLOCK)
    d = (b.abs().amax(-1, keepdim=True) / 127).to(torch.float16).float()
    q = torch.where(d > 0, b / d, 0).round().clamp(-127, 127)
    return (d * q + 0.0).reshape(n, k)  # + 0.0: no -0, as the kernel rebuilds it
