"""A call's metadata in one host buffer, moved to the device in one copy.

The engine builds each model call's small tensors (token ids, positions, slots, block tables,
tree masks, sampling rows) on the host. Copied one by one, each would be a blocking
host-to-device copy on a GPU; here they are laid side by side in one byte buffer (pinned
memory on CUDA, so the copy does not block the host), moved with one `to(device)`, and handed
out as views of the device copy. On a CPU the "copy" returns the buffer itself.
"""
from __future__ import annotations

import numpy as np
import torch

_ALIGN = 16  # bytes: every field starts 16-byte aligned, as Triton's kernels are specialised
#              (and compiled at warm-up) for pointers divisible by 16
_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32,
          np.dtype(np.float64): torch.float64, np.dtype(np.bool_): torch.bool}


def to_device(fields: dict[str, np.ndarray], device) -> dict[str, torch.Tensor]:
    """{name: host array (int64, float32, float64 or bool)} -> {name: tensor of the same shape and dtype
    on `device`}, every one a view of one buffer copied once."""
    offsets, size = {}, 0
    for name, array in fields.items():
        if array.dtype not in _TORCH:
            raise TypeError(f"{name}: {array.dtype} cannot be staged (int64, float32, float64 or bool)")
        offsets[name] = size
        size += -(-array.nbytes // _ALIGN) * _ALIGN
    device = torch.device(device)
    raw = np.zeros(max(size, _ALIGN) + _ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGN
    flat = raw[start:start + max(size, _ALIGN)]  # the buffer itself aligned (a CPU uses it as is)
    views = {}  # each field's typed view of the buffer, filled
    for name, array in fields.items():
        views[name] = flat[offsets[name]:offsets[name] + array.nbytes].view(array.dtype).reshape(array.shape)
        views[name][...] = array
    host = torch.from_numpy(flat)
    host = host.pin_memory() if device.type == "cuda" else host
    moved = host.to(device, non_blocking=True)  # the one copy (on a CPU: `host` itself)
    if moved is host:  # the fields are numpy's views of it: a third of the cost of torch's
        return {name: torch.from_numpy(view) for name, view in views.items()}
    return {name: moved[offsets[name]:offsets[name] + array.nbytes].view(_TORCH[array.dtype]).view(array.shape)
            for name, array in fields.items()}


def int64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def float32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).reshape(-1)


def padded(rows: list[list[int]], fill: int = -1) -> np.ndarray:
    """Ragged int rows -> [len(rows), max(1, longest)] int64, padded with `fill`."""
    width = max(1, max((len(r) for r in rows), default=0))
    out = np.full((len(rows), width), fill, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out
