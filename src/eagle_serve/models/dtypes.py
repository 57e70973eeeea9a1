"""The model dtype a settings name means on this machine. Light to import (torch and the CPU
flags, no transformers): Triton's auto-complete stubs read it before the models load
(eagle_serve.triton_backend.features)."""
from __future__ import annotations

from pathlib import Path

import torch

from eagle_serve.cpu import matmul as cpu_matmul
from eagle_serve.cpu import quant as cpu_quant
from eagle_serve.settings import DTYPE_NAMES


def torch_dtype(name: str, on_gpu: bool = False, target_dir: Path | None = None):
    """A dtype name of the settings -> torch dtype. auto: on a GPU bfloat16, float16 below sm80
    (a T4 or V100 has no bfloat16 arithmetic; without a visible GPU, bfloat16); on CPU bfloat16 where
    the CPU computes it natively (AVX512-BF16/AMX), unless the target's weights are exact GGUF
    blocks (`cpu.quant.holds_blocks`), else float32. float32 runs the CPU kernels on those blocks
    and the layers in one C++ call: the default target's decode step took 15.6 ms in fp32 against
    50.1 ms in bf16 on an AMX Xeon, while a dense ~1B target ran 160 ms in fp32 against 124 in
    bf16 (docs/performance.md)."""
    if name == "auto":
        if on_gpu:
            old_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0)
            return torch.float16 if old_gpu else torch.bfloat16
        blocks = target_dir is not None and cpu_quant.holds_blocks(target_dir)
        return torch.bfloat16 if cpu_matmul.native_bf16() and not blocks else torch.float32
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {name!r}")
    if on_gpu and name == "float64":  # the attention kernel accumulates in float32
        raise ValueError("dtype float64 runs on CPU instances only; on a GPU use auto "
                         "(bfloat16; float16 below sm80), float16 or float32")
    return getattr(torch, name)


def settings_dtype(settings, on_gpu: bool, repo_dir: Path):
    """The model dtype of a worker of the repository at `repo_dir` with these ServingSettings."""
    return torch_dtype(settings.model.dtype, on_gpu, settings.model_dirs(repo_dir)[0])
