"""What this machine's CPU can do, read from /proc/cpuinfo without importing torch: Triton's
auto-complete stubs ask it which dtype `auto` means (eagle_serve.models.dtypes) at every server
start, and the CPU kernels which instructions to build for (eagle_serve.kernels.cpu)."""
from __future__ import annotations


def cpu_flags() -> set[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        return set(next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split())
    except OSError:
        return set()


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX): then bf16 is the faster
    CPU dtype for dense weights; elsewhere oneDNN emulates it and fp32 is faster."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
