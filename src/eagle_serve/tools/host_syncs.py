"""Counting the places where a round would wait for the GPU, on any device (a CPU included).

On a GPU the host runs ahead of the device until it needs a value the device computes (a
device-to-host read), a copy from pageable host memory, or an operation whose output size
depends on device data. Each such call stalls the host until the device queue drains, so a
round's cost grows with their number. `count_host_syncs()` counts them through a torch-function
mode while code runs on CPU tensors, by what the call would do on a GPU:

  read      - a tensor's value reaches Python: item, tolist, bool/int/float/index, numpy, cpu;
  copy      - Python data becomes a device tensor, or a tensor is moved: tensor and as_tensor
              with a device, new_tensor, to(<device>), cuda;
  shape     - an output whose size depends on the data: nonzero, masked_select, unique,
              argwhere, boolean-mask indexing, repeat_interleave without output_size,
              one-argument where.

The convention that makes this meaningful on a CPU: in the hot path torch tensors are device
tensors, and host-side bookkeeping is Python (lists, ints) or numpy. Calls made while a Triton
kernel is launched (the interpreter copies its arguments about) are not counted: on a GPU a
launch queues work and waits for nothing.
"""
from __future__ import annotations

import collections
import contextlib
import sys
import threading

import torch
from torch.overrides import TorchFunctionMode

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}
COPIES = {"new_tensor", "cuda"}
SHAPES = {"nonzero", "masked_select", "unique", "unique_consecutive", "argwhere"}

_launching = threading.local()


def _kind(name: str, args: tuple, kwargs: dict) -> str | None:
    if name in READS:
        return "read"
    if name in ("tensor", "as_tensor"):  # host data to the device named (none: a host tensor)
        return "copy" if kwargs.get("device") is not None else None
    if name in COPIES:
        return "copy"
    if name == "to":
        moves = any(isinstance(a, (torch.device, str)) for a in args[1:]) or "device" in kwargs
        return "copy" if moves else None
    if name in SHAPES:
        return "shape"
    if name == "repeat_interleave":
        return None if kwargs.get("output_size") is not None else "shape"
    if name == "where":
        return "shape" if len(args) == 1 and not kwargs else None
    if name in ("__getitem__", "__setitem__"):
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        return "shape" if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool
                              for p in parts) else None
    return None


class HostSyncCounter(TorchFunctionMode):
    """Counts (kind, function name, caller's file:line) of the calls that would synchronise
    with a GPU."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not getattr(_launching, "depth", 0):
            name = getattr(func, "__name__", str(func))
            kind = _kind(name, args, kwargs)
            if kind is not None:
                self.calls[(kind, name, _caller())] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def report(self) -> str:
        return "\n".join(f"{n:4d}  {kind:5s} {name:18s} {site}"
                         for (kind, name, site), n in self.calls.most_common())


def _caller() -> str:
    """The first frame outside torch and this module: file:line."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or "/torch/" in frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "?"
    parts = frame.f_code.co_filename.rsplit("/", 2)
    return f"{'/'.join(parts[-2:])}:{frame.f_lineno}"


@contextlib.contextmanager
def kernel_launches_not_counted(on_launch=None):
    """While active, nothing inside a Triton kernel launch is counted (see the module doc);
    on_launch(): called once per launch."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def quiet(run):
        def wrapped(*args, **kwargs):
            if on_launch is not None and not getattr(_launching, "depth", 0) and not kwargs.get("warmup"):
                on_launch()
            _launching.depth = getattr(_launching, "depth", 0) + 1
            try:
                return run(*args, **kwargs)
            finally:
                _launching.depth -= 1
        return wrapped

    originals = [(cls, cls.run) for cls in (JITFunction, InterpretedFunction)]
    for cls, run in originals:
        cls.run = quiet(run)
    try:
        yield
    finally:
        for cls, run in originals:
            cls.run = run


@contextlib.contextmanager
def count_host_syncs():
    """-> a HostSyncCounter counting the calls made inside the block (this thread)."""
    counter = HostSyncCounter()
    with kernel_launches_not_counted(), counter:
        yield counter
