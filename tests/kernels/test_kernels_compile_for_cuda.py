"""Every kernel compiles for an sm_90 GPU (Triton's bundled ptxas, no GPU needed): catches what
the interpreter lets by (loop-carried types, dot shapes, casts). Runs in a subprocess, since
this session's triton was imported with TRITON_INTERPRET=1."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
I32, I64, F32 = "i32", "*i64", "*fp32"


def specs():
    """(kernel, types of its runtime arguments in order, constexprs) as the launchers use them."""
    from kernels import paged_attention as pa
    from kernels import prepare_inputs, rejection, sampling, workspace

    yield sampling._probs_kernel, ["*bf16", F32, I64, F32, F32] + [I32] * 3, {"BLOCK_V": 2048}
    yield sampling._sample_kernel, [F32, I64, I64] + [I32] * 3, {"BLOCK_R": 4, "BLOCK_V": 1024}
    yield rejection._greedy_accept_kernel, [I64] * 5 + [I32] * 3, {"BLOCK_B": 64}
    yield (rejection._recover_kernel, [F32, F32, I64, I64, I64] + [I32] * 4,
           {"BLOCK_R": 4, "BLOCK_V": 1024})
    yield (rejection._random_accept_kernel, [I64, I64, F32, F32] + [I64] * 4 + [I32] * 6,
           {"BLOCK_B": 64})
    for kernel in (workspace._scatter_rows_kernel, workspace._gather_rows_kernel):
        yield kernel, ["*bf16", I64, F32] + [I32] * 5, {"BLOCK_N": 4, "BLOCK_D": 1024}
    yield prepare_inputs._prepare_inputs_kernel, [I64] * 3, {"BLOCK": 1024}
    yield (pa._write_kv_kernel, [F32, F32, "*bf16", "*bf16", I64] + [I32] * 3,
           {"BLOCK_T": 4, "BLOCK_W": 1024})
    for dtype, extras, precision in [("fp32", True, "ieee"), ("bf16", False, "tf32")]:
        yield (pa._paged_attention_kernel,
               [f"*{dtype}"] * 3 + [I64] * 3 + ["*i8", I64, f"*{dtype}", "fp32", I32, "fp32"] + [I32] * 13,
               dict(GROUP=3, BLOCK_Q=5, BLOCK_M=16, BLOCK_N=64, BLOCK_D=64, HEAD_DIM=40,
                    PAGE_SIZE=5, HAS_TREE=extras, HAS_WINDOW=extras, HAS_SOFTCAP=extras,
                    PRECISION=precision))


def compile_all() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for kernel, types, constexprs in specs():
        runtime = [name for name in kernel.arg_names if name not in constexprs]
        assert len(runtime) == len(types), f"{kernel.__name__}: update its spec here"
        signature = dict(zip(runtime, types)) | {name: "constexpr" for name in constexprs}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        assert "cubin" in compiled.asm, kernel.__name__
        print("compiled", kernel.__name__)


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert done.stdout.count("compiled") == 11  # 10 kernels, attention with and without tree/window/softcap


if __name__ == "__main__":
    compile_all()
