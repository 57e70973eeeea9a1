"""The model dtype a settings name means on this machine, read without importing torch where the
name or the CPU's flags decide it (a dtype named; auto on a CPU without native bfloat16): Triton's
auto-complete stubs of eagle_target and eagle_drafter read it before the models load
(eagle_serve.triton_backend.features) at every server start, where a torch import is a large
share of the CPU (docs/performance.md, "Start-up")."""
from __future__ import annotations

from pathlib import Path

from eagle_serve import machine
from eagle_serve.settings import DTYPE_NAMES


def dtype_name(name: str, on_gpu: bool = False, target_dir: Path | None = None) -> str:
    """A dtype name of the settings -> the torch dtype's name. auto: on a GPU bfloat16, float16
    below sm80 (a T4 or V100 has no bfloat16 arithmetic; without a visible GPU, bfloat16); on CPU
    bfloat16 where the CPU computes it natively (AVX512-BF16/AMX), unless the target's weights are
    exact GGUF blocks (`cpu.quant.holds_blocks`), else float32. float32 runs the CPU kernels on
    those blocks and the layers in one C++ call, which beats bf16 even with AMX for such a target,
    while a dense target runs faster in bf16 there (docs/performance.md, "bf16 on a CPU with
    native bf16")."""
    if name == "auto":
        if on_gpu:
            import torch

            old_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0)
            return "float16" if old_gpu else "bfloat16"
        if not machine.native_bf16():
            return "float32"
        from eagle_serve.cpu import quant  # reads a tensor of the target

        return "float32" if target_dir is not None and quant.holds_blocks(target_dir) else "bfloat16"
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {name!r}")
    if on_gpu and name == "float64":  # the attention kernel accumulates in float32
        raise ValueError("dtype float64 runs on CPU instances only; on a GPU use auto "
                         "(bfloat16; float16 below sm80), float16 or float32")
    return name


def torch_dtype(name: str, on_gpu: bool = False, target_dir: Path | None = None):
    """`dtype_name` as a torch dtype."""
    import torch

    return getattr(torch, dtype_name(name, on_gpu, target_dir))


def settings_dtype_name(settings, on_gpu: bool, repo_dir: Path) -> str:
    """The model dtype of a worker of the repository at `repo_dir` with these ServingSettings."""
    return dtype_name(settings.model.dtype, on_gpu, settings.model_dirs(repo_dir)[0])


def settings_dtype(settings, on_gpu: bool, repo_dir: Path):
    """`settings_dtype_name` as a torch dtype."""
    return torch_dtype(settings.model.dtype, on_gpu, settings.model_dirs(repo_dir)[0])
