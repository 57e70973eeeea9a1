"""Counting the kernels a piece of code launches, on any device (a CPU included).

On a GPU a decode step of a small model costs what the host takes to launch its kernels, so
their number is the budget the fused layer kernels (eagle_serve.kernels.layer_ops) keep down.
`count_launches()` counts, while code runs:

  torch  - every ATen operator that runs a kernel: all but views and aliases (view, reshape
           of contiguous data, split, slicing, transpose, detach), allocations (empty) and
           reads of a value (item): seen through a dispatch mode, so on CPU tensors the same
           operators are counted as on CUDA ones;
  triton - every launch of a Triton kernel (what runs inside one, as the interpreter copies
           its arguments about, is not counted).
"""
from __future__ import annotations

import collections
import contextlib

from torch.utils._python_dispatch import TorchDispatchMode

from eagle_serve.tools.host_syncs import _launching, kernel_launches_not_counted

NO_KERNEL = {"empty", "empty_like", "empty_strided", "_local_scalar_dense", "lift_fresh",
             "_unsafe_view", "set_", "resize_", "_reshape_alias", "detach", "alias"}


def _runs_kernel(func) -> bool:
    name = func._schema.name.split("::")[-1]
    if name in NO_KERNEL:
        return False
    returns = func._schema.returns
    # a view or alias returns its input's storage, unwritten (in-place ops write theirs)
    return not (returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns))


class LaunchCounter(TorchDispatchMode):
    """Counts the launches made inside the block, by (kind, operator or kernel name)."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not getattr(_launching, "depth", 0) and _runs_kernel(func):
            self.calls[("torch", func._schema.name.split("::")[-1])] += 1
        return func(*args, **(kwargs or {}))

    def triton_launch(self) -> None:
        self.calls[("triton", "kernel")] += 1

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def report(self) -> str:
        return "\n".join(f"{n:4d}  {kind:6s} {name}" for (kind, name), n in self.calls.most_common())


@contextlib.contextmanager
def count_launches():
    """-> a LaunchCounter counting the kernels launched inside the block (this thread)."""
    counter = LaunchCounter()
    with kernel_launches_not_counted(counter.triton_launch), counter:
        yield counter


@contextlib.contextmanager
def launches_per_call(owner, method: str):
    """While active, every call of `owner.method` (an instance's method) counts the kernels it
    launches: yields the list of totals, one per call."""
    counts, original = [], getattr(owner, method)

    def counted(*args, **kwargs):
        with count_launches() as counter:
            out = original(*args, **kwargs)
        counts.append(counter.total)
        return out
    setattr(owner, method, counted)
    try:
        yield counts
    finally:
        delattr(owner, method)  # the class's method again
