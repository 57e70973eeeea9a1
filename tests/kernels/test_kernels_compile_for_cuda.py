"""Every kernel variant the launchers can pick (every tile; the attention's flags on one, see specs)
compiles for sm_90 (H100), and for sm_80 (A100) where the two lower it differently, no GPU needed:
catches what the interpreter lets by (loop-carried types, dot shapes, casts), all of which Triton
checks on its way to PTX. One variant of each kernel per dtype goes on through Triton's bundled
ptxas to a cubin (which catches instructions the architecture lacks) for those two and for sm_75
(T4: float16 and float32, no bfloat16), sm_86 (A10, RTX 30), sm_89 (L4, L40S) and sm_100 (B200).
The variants are those eagle_serve/kernels/warmup.py enumerates (through the launchers' own tile
functions) for two served shapes: SmolLM2-135M (9 q / 3 kv heads, head_dim 64) and a Llama-3.1-8B
(32 / 8, head_dim 128), in bfloat16 and float32 (the two attention precisions), with float16 spot
checks. The Triton version must be the GPU image's (requirements-gpu.txt). Runs in a subprocess,
since the test process's triton was imported with TRITON_INTERPRET=1."""
from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
I32, I64, F32 = "i32", "*i64", "*fp32"
TARGETS = (80, 90)  # variants to PTX (`on_targets`)
SPOT_TARGETS = (75, 86, 89, 100)  # one variant per kernel and dtype (those also on TARGETS) to a cubin
MODELS = {"SmolLM2-135M": dict(q_heads=9, kv_heads=3, head_dim=64, page_size=16, hidden=576, inter=1536),
          "Llama-3.1-8B": dict(q_heads=32, kv_heads=8, head_dim=128, page_size=16, hidden=4096, inter=14336)}
VOCABS = (8192, 49152, 128256)  # draft and target vocabularies of the two models


def specs():
    """{(kernel name, types, constexprs): (kernel, types of its runtime arguments, constexprs)}
    for every variant, deduplicated."""
    from eagle_serve.kernels import layer_ops, rejection, sampling, workspace
    from eagle_serve.kernels import paged_attention as pa
    from eagle_serve.kernels.warmup import MAX_QUERIES, MAX_ROWS, smallest_inputs

    found = {}

    def add(kernel, types, constexprs):
        found[(kernel.__name__, tuple(types), tuple(sorted(constexprs.items())))] = (
            kernel, types, constexprs)

    rows = range(1, MAX_ROWS + 1)
    for shape in MODELS.values():
        group = shape["q_heads"] // shape["kv_heads"]
        for dtype in ("bf16", "fp32", "fp16"):
            tiles = smallest_inputs(lambda q: pa.attention_tile(group, q), range(1, MAX_QUERIES + 1))
            # The flags (tree mask, window, soft-cap) act on the float32 score tile [BLOCK_M,
            # BLOCK_N] with elementwise code (the tree mask's load too), the same whatever the
            # input dtype and the head size, which change only the loads and the dots, whose
            # lowering depends on the tile. So: every tile without flags in bfloat16 (served on
            # GPUs) and float32, float16 (sm_75) on one; every combination of the flags (trees;
            # Mistral's, Qwen2's and Gemma's windows and soft-caps) on one bfloat16 tile of the
            # Llama-3.1-8B shape, whose heads those models share.
            flagged = dtype == "bf16" and shape["head_dim"] == 128
            for i, (block_m, block_q) in enumerate(list(tiles)[:1] if dtype == "fp16" else tiles):
                combos = itertools.product((False, True), repeat=3) if flagged and i == 0 else [(False,) * 3]
                for tree, window, softcap in combos:
                    add(pa._paged_attention_kernel,
                        [f"*{dtype}"] * 3 + [I64] * 3 + ["*i8", I64, f"*{dtype}", "fp32", I32, "fp32"]
                        + [I32] * 13,
                        dict(GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=64,
                             BLOCK_D=max(16, 1 << (shape["head_dim"] - 1).bit_length()),
                             HEAD_DIM=shape["head_dim"], PAGE_SIZE=shape["page_size"],
                             HAS_TREE=tree, HAS_WINDOW=window, HAS_SOFTCAP=softcap,
                             PRECISION="ieee" if dtype == "fp32" else "tf32"))
            for residual in (True, False):
                add(layer_ops._add_rms_norm_kernel, [f"*{dtype}"] * 5 + [I32, "fp32", I32, I32],
                    dict(HAS_RESIDUAL=residual, BLOCK_H=layer_ops.norm_block(shape["hidden"])))
            block_h = 1 << (max(shape["q_heads"], shape["kv_heads"]) - 1).bit_length()
            add(layer_ops._rope_write_kv_kernel, [f"*{dtype}"] * 5 + [I64] + [f"*{dtype}"] * 3 + [I32] * 7,
                dict(Q_HEADS=shape["q_heads"], KV_HEADS=shape["kv_heads"], HEAD_DIM=shape["head_dim"],
                     ROTARY=shape["head_dim"], BLOCK_H=block_h,
                     BLOCK_D=1 << (shape["head_dim"] - 1).bit_length()))
            add(layer_ops._silu_mul_kernel, [f"*{dtype}"] * 2 + [I32] * 2, dict(BLOCK=layer_ops.SILU_BLOCK))
    for vocab in VOCABS:
        for dtype in ("bf16", "fp32", "fp16"):
            add(sampling._probs_kernel, [f"*{dtype}", F32, I64, F32, F32] + [I32] * 3,
                dict(BLOCK_V=sampling.probs_block(vocab)))
        for block_r, block_v in smallest_inputs(lambda r: sampling.vocab_row_tile(r, vocab), rows):
            add(sampling._sample_kernel, [F32, I64, I64] + [I32] * 3,
                dict(BLOCK_R=block_r, BLOCK_V=block_v))
            add(rejection._recover_kernel, [F32, F32, I64, I64, I64] + [I32] * 4,
                dict(BLOCK_R=block_r, BLOCK_V=block_v))
        for block_n, block_d in smallest_inputs(lambda n: workspace.row_tile(n, vocab), rows):
            for kernel in (workspace._scatter_rows_kernel, workspace._gather_rows_kernel):
                add(kernel, [F32, I64, F32] + [I32] * 5, dict(BLOCK_N=block_n, BLOCK_D=block_d))
    for block_b in smallest_inputs(rejection.request_block, rows):
        add(rejection._greedy_accept_kernel, [I64] * 5 + [I32] * 3, dict(BLOCK_B=block_b))
        add(rejection._random_accept_kernel, [I64, I64, F32, F32] + [I64] * 4 + [I32] * 6,
            dict(BLOCK_B=block_b))
    return found


def tensor_core_dots(spec) -> bool:
    """Whether a variant's dots run on tensor cores, which sm_80 (mma) and sm_90 (wgmma) lower
    differently, with the score tile in each one's own layout: attention in bfloat16 or float16
    without flags, or with all three (the flags' elementwise code in sm_80's layout once). The
    other kernels have no dot, and float32 attention's ieee dots become the same FMAs on both."""
    kernel, types, constexprs = spec
    flags = {constexprs[f] for f in ("HAS_TREE", "HAS_WINDOW", "HAS_SOFTCAP")} if "HAS_TREE" in constexprs else set()
    return kernel.__name__ == "_paged_attention_kernel" and types[0] != "*fp32" and len(flags) == 1


def jobs() -> list[tuple[int, tuple, bool]]:
    """(GPU architecture, spec, to a cubin): every variant for sm_90 and those with tensor-core
    dots for sm_80 too, the first variant of each kernel and dtype to a cubin on all six
    (bfloat16 not on sm_75, which lacks it: float16 is served there)."""
    every = list(specs().values())
    spot = {}
    for spec in every:
        spot.setdefault((spec[0].__name__, spec[1][0]), spec)
    spot_ids = {id(spec) for spec in spot.values()}
    return [(arch, spec, id(spec) in spot_ids) for arch in TARGETS for spec in every
            if arch == 90 or id(spec) in spot_ids or tensor_core_dots(spec)] + [
        (arch, spec, True) for arch in SPOT_TARGETS for spec in spot.values()
        if not (arch == 75 and any("bf16" in t for t in spec[1]))]


class PtxReady(Exception):
    """Raised by the cubin stage of a PTX-only compile, carrying the PTX."""


def ptx_only(*args):
    """knobs.runtime.add_stages_inspection_hook: called bare for the cache key, then with the
    backend's stages, whose cubin step (ptxas) it replaces with one raising the PTX."""
    if not args:
        return "ptx-only", "ptx-only"

    def stop(ptx, metadata):
        raise PtxReady(ptx)
    args[1]["cubin"] = stop


def compile_all(part: int = 0, parts: int = 1) -> None:
    """Compile every `parts`-th job, from the `part`-th (LLVM and ptxas use one core)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for arch, (kernel, types, constexprs), binary in jobs()[part::parts]:
        runtime = [name for name in kernel.arg_names if name not in constexprs]
        assert len(runtime) == len(types), f"{kernel.__name__}: update its spec here"
        signature = dict(zip(runtime, types)) | {name: "constexpr" for name in constexprs}
        knobs.runtime.add_stages_inspection_hook = None if binary else ptx_only
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs),
                                      target=GPUTarget("cuda", arch, 32))
            assert binary and "cubin" in compiled.asm, kernel.__name__
        except PtxReady as ready:
            assert not binary and f".target sm_{arch}" in ready.args[0], kernel.__name__
        print("compiled", arch, kernel.__name__, constexprs, flush=True)


def image_pin(name: str) -> str:
    text = (ROOT / "requirements-gpu.txt").read_text()
    match = re.search(rf"^{name}==(\S+)", text, re.M)
    assert match, f"requirements-gpu.txt pins no {name}"
    return match[1]


def test_the_compiler_is_the_triton_of_the_gpu_image():
    import triton
    assert triton.__version__ == image_pin("triton")


def test_every_variant_family_is_compiled():
    from eagle_serve.kernels import layer_ops, paged_attention, rejection, sampling, workspace

    names = {key[0] for key in specs()}
    modules = (layer_ops, paged_attention, rejection, sampling, workspace)
    kernels = {name for m in modules for name in vars(m)
               if name.startswith("_") and name.endswith("_kernel")}
    assert names == kernels
    attention = [c for (name, _, c) in specs() if name == "_paged_attention_kernel"]
    assert {dict(c)["HEAD_DIM"] for c in attention} == {64, 128}
    assert {dict(c)["PRECISION"] for c in attention} == {"ieee", "tf32"}


@pytest.mark.slow
def test_every_kernel_variant_compiles_for_six_gpu_architectures(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    parts = max(1, min(4, os.cpu_count() or 1))  # one compiler process per core
    runs = [subprocess.Popen([sys.executable, __file__, str(part), str(parts)], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for part in range(parts)]
    outputs = [run.communicate(timeout=1800) for run in runs]
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, out[-2000:] + err[-4000:]
    assert sum(out.count("compiled") for out, _ in outputs) == len(jobs())
    assert {arch for arch, _, binary in jobs() if binary} == {75, 80, 86, 89, 90, 100}
    print(f"{len(specs())} variants, {len(jobs())} compiled, "
          f"{sum(binary for *_, binary in jobs())} of them to cubins")


if __name__ == "__main__":
    compile_all(*map(int, sys.argv[1:3]))
