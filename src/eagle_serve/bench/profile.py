"""Where a target forward goes, in process (no server), with torch.profiler:

    eagle-serve bench profile [--dtype bfloat16] [--rows 1,5] [--context 200] [--steps 20]
                                      [--threads N]

For the default target, one request at `context`, a forward of `rows` new tokens (1 = a decode
step, k + 1 = a verify pass): the operator calls per forward (all, and the matmul kinds), then
the share of the forward's wall time spent in the linears, attention (RoPE, KV write,
attention), norms, and the rest (other ops, Python and dispatch). The share table wraps those
parts in profiler labels, which adds a little time of its own to "rest".
"""
from __future__ import annotations

import argparse
import collections
import functools
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from eagle_serve import paths
from eagle_serve.core.interfaces import RaggedBatch
from eagle_serve.core.kv_pages import PagePool
from eagle_serve.cpu.matmul import CpuLinear
from eagle_serve.models import target as target_module
from eagle_serve.models.target import TargetModel

MATMULS = ("mkldnn::_linear_pointwise", "aten::linear", "aten::mm", "aten::addmm", "aten::bmm",
           "aten::matmul", "aten::scaled_dot_product_attention")


def decode_batch(rows: int, context: int) -> RaggedBatch:
    pool, table = PagePool(64, 16), []
    pool.grow(table, context + rows)
    pos = list(range(context, context + rows))
    return RaggedBatch(torch.randint(0, 1000, (rows,)), torch.tensor(pos), torch.tensor([0, rows]),
                       torch.tensor([context + rows]), torch.tensor([table]),
                       torch.tensor([pool.slot(table, p) for p in pos]))


def op_counts(model: TargetModel, batch: RaggedBatch, steps: int) -> collections.Counter:
    """-> operator name: calls per forward (top-level and nested)"""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            model.logits(batch, torch.arange(batch.input_ids.shape[0]))
    return collections.Counter({e.key: e.count // steps for e in prof.key_averages()})


def _labelled(label, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)
    return run


def shares(model: TargetModel, batch: RaggedBatch, steps: int) -> dict[str, float]:
    """-> part: percent of the forward's wall time (parts labelled by wrapping them)"""
    norm_type = type(model.hf.model.layers[0].input_layernorm)
    patches = [(CpuLinear, "forward", "linears"), (norm_type, "forward", "norms"),
               (target_module, "paged_attention_step", "attention")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, label in patches:
        setattr(owner, name, _labelled(label, getattr(owner, name)))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                model.logits(batch, torch.arange(batch.input_ids.shape[0]))
            wall = (time.perf_counter() - start) * 1e6
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    totals = {e.key: e.cpu_time_total for e in prof.key_averages() if e.key in ("linears", "norms", "attention")}
    parts = {k: 100 * totals.get(k, 0.0) / wall for k in ("linears", "attention", "norms")}
    parts["rest"] = 100 - sum(parts.values())
    parts["ms per forward"] = wall / steps / 1e3
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="1,5")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    model = TargetModel(paths.default_target_dir(), dtype=getattr(torch, args.dtype), num_pages=64)
    for rows in [int(r) for r in args.rows.split(",")]:
        batch = decode_batch(rows, args.context)
        for _ in range(3):  # warm up
            model.logits(batch, torch.arange(rows))
        counts = op_counts(model, batch, args.steps)
        print(f"{args.dtype}, {rows} new token(s) at context {args.context}, per forward:")
        print(f"  operator calls: {sum(counts.values())}")
        for name in MATMULS:
            if counts.get(name):
                print(f"  {name}: {counts[name]}")
        print("  top operators: " + ", ".join(f"{n} {c}" for n, c in counts.most_common(12)))
        for part, value in shares(model, batch, args.steps).items():
            print(f"  {part}: {value:.1f}" + ("" if part.startswith("ms") else " %"))


if __name__ == "__main__":
    main()
