"""In-process timings of the CPU linears and the target forward (no server):

    eagle-serve bench forward [--linears-only | --target-only] [--context N]
                                    [--kernels-from REV] [--rows 1 2 3 ...] [--repeats N]

Prints the time of one pass through the linears of SmolLM2-135M's 30 layers + LM head for 1 to
64 rows (torch's nn.Linear; CpuLinear's oneDNN packed fp32, its fp32 row kernel on dense weights
and on GGUF blocks where this CPU has AVX2, the Q4_1 blocks on AMX tiles where it has them,
those blocks on 8-bit activations, and its bf16 where oneDNN runs it),
then the default target's forward in the server's `auto` dtype (fp32 where the CPU kernels build:
the target is GGUF blocks) for 1 to 16 new tokens (--rows) of one request at context 200, its linears
reading oneDNN's packed weights or the dense ones, or running the fp32 row kernel on the dense
weights or on the exact Q4_1/Q8_0 blocks of a GGUF target, layer by layer or all layers in one
C++ call (eagle_serve.models.cpu_stack, the server's path), and, on CPUs with native bf16, the same
target in bf16 (oneDNN's linears; what `auto` runs for dense targets there), the one call
on 8-bit activations (`target_activations` int8) and, where the Q4_1 layers run on AMX tiles,
the one call with them on the FMA kernels instead (EAGLE_CPU_AMX=0) (interleaved).
--kernels-from REV adds the one-call forward on the C++ kernels of git revision REV, built
beside this tree's (an A/B of a kernel change, interleaved in one process).
docs/performance.md quotes it.
"""
from __future__ import annotations

import argparse
import functools
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from eagle_serve import paths
from eagle_serve.bench.profile import decode_batch
from eagle_serve.cpu.matmul import CpuLinear, onednn_bf16
from eagle_serve.cpu.quant import block_form, int8_activations_run
from eagle_serve.kernels import cpu as cpu_module
from eagle_serve.kernels.cpu import amx_tiles, build, cpu_kernels, without_amx_tiles
from eagle_serve.machine import native_bf16
from eagle_serve.models import cpu_stack
from eagle_serve.models.dtypes import torch_dtype
from eagle_serve.models.target import TargetModel
from eagle_serve.testing import gguf_weight


def bench_linears(hidden: int = 576, inter: int = 1536, vocab: int = 49152, layers: int = 30,
                  repeats: int = 9, rows_list=(1, 2, 3, 5, 8, 16, 32, 64)) -> None:
    """Median time of one pass through the linears of `layers` Llama layers + an LM head: torch's
    nn.Linear, oneDNN's packed fp32, our row kernel on the dense weights and on GGUF blocks (the
    default target's layout: Q4_1 layers, a Q8_0 LM head; called directly, so at every row
    count: CpuLinear takes the dense weight past the build's max_block_rows), oneDNN's bf16."""
    shapes = [(hidden, hidden), (hidden // 3, hidden), (hidden // 3, hidden), (hidden, hidden),
              (inter, hidden), (inter, hidden), (hidden, inter)] * layers + [(vocab, hidden)]
    plain = [nn.Linear(i, o, bias=False) for o, i in shapes]
    onednn, kernel = [CpuLinear(m) for m in plain], [CpuLinear(m) for m in plain]
    for m in onednn:
        m.cpu_kernel = False
    ours_bf16 = [CpuLinear(m.to(torch.bfloat16)) for m in [nn.Linear(i, o, bias=False) for o, i in shapes]]
    names = ["nn.Linear", "oneDNN fp32"]
    configs = [([m.forward for m in plain], torch.float32), ([m.forward for m in onednn], torch.float32)]
    if cpu_kernels():
        distinct = {(o, i): block_form(gguf_weight("q8_0" if o == vocab else "q4_1", o, i))
                    for o, i in set(shapes)}
        names += ["row kernel fp32", "blocks fp32"]
        configs += [([m.forward for m in kernel], torch.float32),
                    ([functools.partial(distinct[s].linear, bias=None) for s in shapes], torch.float32)]
    if amx_tiles():  # the Q4_1 layers on AMX tiles (the Q8_0 LM head stays on the FMA kernel)
        tiles = {s: b.amx() if b.kind == "q4_1" else b for s, b in distinct.items()}
        names.append("blocks fp32 AMX tiles")
        configs.append(([functools.partial(tiles[s].linear, bias=None) for s in shapes], torch.float32))
    if int8_activations_run():
        packed = {s: b.int8_activations() for s, b in distinct.items()}
        names.append("blocks int8 activations")
        configs.append(([functools.partial(packed[s].linear, bias=None) for s in shapes], torch.float32))
    if onednn_bf16():
        names.append("oneDNN bf16")
        configs.append(([m.forward for m in ours_bf16], torch.bfloat16))
    widths = [i for _, i in shapes]
    print("rows  " + "  ".join(f"{n + ' ms':>18}" for n in names))
    with torch.inference_mode():
        for rows in rows_list:
            times = []
            for calls, dtype in configs:
                xs = {i: torch.randn(rows, i, dtype=dtype) for i in (hidden, inter)}
                runs = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    for call, width in zip(calls, widths):
                        call(xs[width])
                    runs.append(time.perf_counter() - start)
                times.append(sorted(runs)[repeats // 2] * 1e3)
            print(f"{rows:4d}  " + "  ".join(f"{t:18.1f}" for t in times), flush=True)


def kernels_at(rev: str):
    """The C++ kernels of git revision `rev`, built under their own name beside this tree's (where
    its sources are this tree's, this tree's build: the same sources compile to the same code)."""
    here = Path(cpu_module.__file__).parent
    folder = Path(tempfile.mkdtemp(prefix="kernels-"))
    git = lambda *args: subprocess.run(["git", *args], check=True, capture_output=True).stdout
    listed = git("ls-tree", "--name-only", rev, "src/eagle_serve/kernels/", "kernels/").decode().split()
    for path in listed:  # (kernels/ before the package layout)
        if path.endswith((".cpp", ".h")):  # SOURCES and their headers, as that revision has them
            (folder / Path(path).name).write_bytes(git("show", f"{rev}:{path}"))
    copied = sorted(f.name for f in folder.iterdir())
    if copied and all((here / name).exists() and (here / name).read_bytes() == (folder / name).read_bytes()
                      for name in copied) and len(copied) == len(list(here.glob("*.cpp")) + list(here.glob("*.h"))):
        return cpu_kernels()
    return build(folder, suffix="_" + git("rev-parse", "--short", rev).decode().strip())


TARGET_ROWS, TARGET_REPEATS = (1, 2, 3, 5, 8, 16), 7  # bench_target's defaults


def bench_target(rows_list=TARGET_ROWS, context: int = 200, repeats: int = TARGET_REPEATS,
                 kernels_from: str | None = None) -> None:
    """Median time of the default target's forward (+ LM head, `auto` dtype) for `rows` new
    tokens of one request at `context`, its linears reading oneDNN's packed weights, the dense
    ones, or (fp32 with AVX2) running the row kernel on the dense weights or on their exact
    Q4_1/Q8_0 blocks where found (eagle_serve.cpu.quant), layer by layer or in one call
    (eagle_serve.models.cpu_stack), and in bf16 where the CPU computes it natively (interleaved)."""
    dtype = torch_dtype("auto", target_dir=paths.default_target_dir())
    model = TargetModel(paths.default_target_dir(), dtype=dtype, num_pages=64)
    every = model.cpu_linears()
    kernel = [m.cpu_kernel for m in every]
    blocks = [m.blocks for m in every]  # exact Q4_1/Q8_0 forms (cpu_quant), where found
    stack, model.stack = model.stack, None  # the layers in one call (cpu_stack), where built
    for m in every:
        m.cpu_kernel = False
    model.logits(decode_batch(1, context), torch.arange(1))  # packs every linear it runs
    linears = [m for m in every if m._packed is not None]
    weights = {"dense": [m.weight.detach() for m in linears], "packed": [m._packed for m in linears]}
    names = list(weights) + (["row kernel"] if any(kernel) else [])
    names += ["block kernel"] if any(b is not None for b in blocks) else []
    names += ["one call"] if stack is not None else []
    other = kernels_at(kernels_from) if kernels_from and stack is not None else None
    names += [f"one call @{kernels_from}"] if other is not None else []
    bf16 = int8 = None
    if native_bf16() and dtype != torch.bfloat16:
        bf16 = TargetModel(paths.default_target_dir(), dtype=torch.bfloat16, num_pages=64)
        names.append("bf16")
    if stack is not None and int8_activations_run():
        int8 = TargetModel(paths.default_target_dir(), dtype=dtype, num_pages=64, activations="int8")
        names.append("int8 activations")
    fma = None
    if stack is not None and amx_tiles():  # the one call with the Q4_1 layers on the FMA kernels
        with without_amx_tiles():
            fma = TargetModel(paths.default_target_dir(), dtype=dtype, num_pages=64)
        names.append("FMA kernels")
    times: dict = {}
    for _ in range(repeats):
        for rows in rows_list:
            batch = decode_batch(rows, context)
            for name in names:
                for m, on, b in zip(every, kernel, blocks):
                    m.cpu_kernel = on and name.startswith(("row kernel", "block kernel", "one call"))
                    m.blocks = b if name.startswith(("block kernel", "one call")) else None
                model.stack = stack if name.startswith("one call") else None
                cpu_stack.cpu_kernels = (lambda: other) if name.startswith("one call @") else cpu_kernels
                for m, w in zip(linears, weights.get(name, weights["packed"])):
                    m._packed = w  # the inner product reads either layout
                start = time.perf_counter()
                {"bf16": bf16, "int8 activations": int8, "FMA kernels": fma}.get(name, model).logits(
                    batch, torch.arange(rows))
                times.setdefault((rows, name), []).append(time.perf_counter() - start)
    first = rows_list[0]  # the ratios' base (1 token unless --rows starts elsewhere)
    print(f"{dtype} target forward, 1 request at context {context}: new tokens, ms (x of {first} token"
          f"{'s' * (first != 1)})")
    for rows in rows_list:
        cells = []
        for name in names:
            t = sorted(times[(rows, name)])[repeats // 2] * 1e3
            t1 = sorted(times[(first, name)])[repeats // 2] * 1e3
            cells.append(f"{name} {t:6.1f} ({t / t1:.2f}x)")
        print(f"{rows:4d}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--linears-only", action="store_true")
    parser.add_argument("--target-only", action="store_true")
    parser.add_argument("--context", type=int, default=200, help="the request's context (target)")
    parser.add_argument("--kernels-from", metavar="REV", help="also time the kernels of this git revision")
    parser.add_argument("--rows", type=int, nargs="+", default=list(TARGET_ROWS),
                        help="the target's new tokens to time (ratios against the first)")
    parser.add_argument("--repeats", type=int, default=TARGET_REPEATS,
                        help="the target's forwards per cell (median)")
    args = parser.parse_args()
    if not args.target_only:
        bench_linears()
    if not args.linears_only:
        bench_target(tuple(args.rows), context=args.context, repeats=args.repeats,
                     kernels_from=args.kernels_from)
