"""Row-invariant C++ kernels for CPUs with AVX2 and FMA (SOURCES): the fp32 linear that
eagle_serve.cpu.matmul runs (cpu.cpp: on dense weights, or on exact Q4_1/Q8_0 blocks of them:
see eagle_serve.cpu.quant; cpu_i8.cpp: those blocks on 8-bit activations; cpu_amx.cpp: Q4_1
blocks on AMX tiles, where the CPU has them), the attention of
each verify/decode query over exactly its own keys that paged_attention_rowwise runs
(cpu_attention.cpp), and, for fp32, the RMSNorm of eagle_serve.cpu.norm and
the RoPE + KV cache write of eagle_serve.models.paged in one call each (PyTorch runs each as several
small ops, each paying its dispatch). Each output element is computed by one instruction
sequence whatever the other rows and threads, so a verify row gets its decode step's bits by
construction (no library offers that on CPU: MKL and oneDNN choose their kernel by row count,
SDPA by shape). cpu_stack.cpp strings them, and the ATen ops between them, into a Llama-like
layer stack in one call (eagle_serve.models.cpu_stack); cpu_random.cpp draws kernels.sampling's keyed
noise and runs its exponential race in one pass; cpu_lookup.cpp walks eagle_serve.spec.lookup's
corpus index. Compiled once per machine by
torch.utils.cpp_extension into torch's extension cache (TORCH_EXTENSIONS_DIR; `make setup` does
it, in under a minute), loaded from there after; on CPUs with AVX512F/DQ built for AVX-512 (unless
EAGLE_CPU_ISA=avx2), whose linears sum 16 lanes at a time (other bits than the AVX2 build's,
row-invariant alike).
"""
from __future__ import annotations

import contextlib
import functools
import os
import time
import warnings
from pathlib import Path

import torch

from eagle_serve.machine import cpu_flags


def wide_linears() -> bool:
    """Whether the kernels are built for AVX-512 here (AVX512F and DQ, unless the environment sets
    EAGLE_CPU_ISA=avx2): cpu.cpp's linears then sum 16 lanes at a time, halving the FMAs of a
    verify row (docs/performance.md)."""
    return {"avx512f", "avx512dq"} <= cpu_flags() and os.environ.get("EAGLE_CPU_ISA") != "avx2"


def amx_tiles() -> bool:
    """Whether Q4_1 linears run on AMX tiles here (cpu_amx.cpp: fp32 with exact products and
    another summation order, their cost nearly flat in the row count): the kernels built for
    AVX-512 on a CPU with AMX-BF16 whose kernel grants the tile state, unless the environment
    sets EAGLE_CPU_AMX=0 (then cpu.cpp's FMAs run them, with the dense fp32 linear's bits)."""
    kernels = cpu_kernels()
    return (kernels is not None and wide_linears() and bool(getattr(kernels, "amx", False))
            and os.environ.get("EAGLE_CPU_AMX") != "0")


@contextlib.contextmanager
def without_amx_tiles():
    """While inside, what loads runs its Q4_1 linears on cpu.cpp's FMA kernels (EAGLE_CPU_AMX=0,
    as `amx_tiles` reads it); the variable is as before afterwards (benchmarks' baselines)."""
    before = os.environ.get("EAGLE_CPU_AMX")
    os.environ["EAGLE_CPU_AMX"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["EAGLE_CPU_AMX"]
        else:
            os.environ["EAGLE_CPU_AMX"] = before


@functools.cache
def cpu_kernels():
    """The compiled SOURCES (`linear`, `attend`, `race`, `linear_i8`, ...), or None where this CPU
    lacks AVX2/FMA or the build fails (warned once; callers then take their PyTorch paths)."""
    if not {"avx2", "fma"} <= cpu_flags():
        return None
    try:
        return build(Path(__file__).parent)
    except Exception as e:  # no compiler, no ninja, ...: the PyTorch paths still work
        warnings.warn(f"the CPU kernels (eagle_serve/kernels/cpu.cpp) did not build, using PyTorch's: {e}")
        return None


SOURCES = ("cpu_bind.cpp", "cpu.cpp", "cpu_attention.cpp", "cpu_stack.cpp", "cpu_random.cpp", "cpu_i8.cpp",
           "cpu_lookup.cpp", "cpu_amx.cpp")


STALE_LOCK_S = 600.0  # a build takes under a minute: a lock this old outlived its builder


def clear_stale_lock(name: str) -> bool:
    """Remove the build lock of extension `name` if it is older than STALE_LOCK_S (-> whether it
    did). torch's loader waits on that file until its builder deletes it, so a builder killed
    mid-build (a stopped server's first start) would leave every later start waiting forever."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, False)) / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
            return True
    except OSError:  # no lock, or its builder finished meanwhile
        pass
    return False


def build(folder: Path, suffix: str = ""):
    """Compile (or load from the extension cache) the kernels in `folder` (this one's, or
    another revision's for an A/B: eagle-serve bench forward --kernels-from) for this CPU."""
    from torch.utils.cpp_extension import load

    name, isa = ("eagle_cpu_kernels_avx512", ["-mavx512f", "-mavx512dq"]) if wide_linears() else ("eagle_cpu_kernels", [])
    sources = [str(folder / f) for f in SOURCES if (folder / f).exists()]  # an older revision's: fewer
    if clear_stale_lock(name + suffix):
        warnings.warn(f"removed the stale build lock of {name + suffix} (a build killed mid-way)")
    return load(name + suffix, sources,
                extra_cflags=["-O3", "-mavx2", "-mfma", *isa, "-ffp-contract=off", "-fopenmp"],
                extra_ldflags=["-fopenmp"])


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
           starts: torch.Tensor, window: int, softcap: float) -> torch.Tensor:
    """q [T, Hq, D] fp32 (scaled); caches [num_pages, page_size, Hkv, D] fp32 or bf16; query t
    attends over slots[starts[t]:starts[t + 1]] in order (window > 0: the last `window`)
    -> [T, Hq, D] fp32"""
    flat = [c.view(-1, *c.shape[2:]) for c in (k_cache, v_cache)]
    return cpu_kernels().attend(q, *flat, slots, starts, window, softcap)


def rope_write_kv_fits(q: torch.Tensor, k_cache: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether cpu.cpp's `rope_write_kv` runs this step: fp32 on CPU, the kernels built."""
    return (q.dtype == k_cache.dtype == cos.dtype == torch.float32 and q.device.type == "cpu"
            and k_cache.device.type == "cpu" and cpu_kernels() is not None)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> torch.Tensor:
    """HF's RoPE on q [T, Hq, D] and k [T, Hkv, D] (cos, sin [T, R]: the first R dims rotate),
    k and v [T, Hkv, D] written to caches [num_pages, page_size, Hkv, D] at slot_mapping [T]
    (-1: skipped), in one call -> the rotated q [T, Hq, D]"""
    flat = [c.view(-1, *c.shape[2:]) for c in (k_cache, v_cache)]
    return cpu_kernels().rope_write_kv(q, k, v, cos, sin, *flat, slot_mapping.to(torch.int64))
