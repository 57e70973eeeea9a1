"""Linear layers for the small row counts of decoding and verification on CPU.

Measured on this machine kind (AMD EPYC, 2 threads, fp32, the 211 linears of SmolLM2-135M
incl. its 49152 x 576 LM head; `python -m eagle_serve.cpu_matmul`): torch's default fp32 GEMM
(MKL, what nn.Linear runs) takes ~33 ms for 1 row and 50-63 ms for 2-3 rows, and the verify
pass of speculative decoding feeds exactly k + 1 = 2..9 rows per request. oneDNN's fp32 inner
product called on dense tensors (`torch.ops.mkldnn._linear_pointwise`, the op torch.compile's
CPU backend emits for linears) takes ~19.5 ms for 1 row and ~22.5 ms for 3 (a GEMV over the
transposed weight: 26 / 49 ms; oneDNN through `to_mkldnn()` tensors: 23 / 25.5 ms, of which the
layout conversions of the activations cost ~5 ms per forward). `CpuLinear` runs that op for
fp32 and bf16 (other dtypes, e.g. the float64 of the exactness tests, fall back to
nn.functional.linear). Outputs equal nn.Linear's up to float rounding. GPU modules are left alone.

bf16 (`python -m eagle_serve.cpu_matmul`; this CPU has avx512_bf16): the same linears take
~15-17 ms for any row count from 1 to 8, so verifying k drafts costs what one token costs. The
bf16 inner product is row-invariant (a row's result does not depend on the other rows) for 2+
rows, but a single row takes another kernel whose sums differ (measured: 1-5 of 9 rows differ
with the target's down_proj, 0 of 300 once padded), so `CpuLinear` pads a single bf16 row with a
zero row: free here, and with the row-invariant attention of kernels.paged_attention a verify
pass reproduces one-token decoding bitwise. fp32 is not row-invariant, and padding would cost
~20% of a decode step, so fp32 keeps the statistical exactness of float rounding.
"""
from __future__ import annotations

import time

import torch
from torch import nn


ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX): then bf16 is the faster
    CPU dtype (see above); elsewhere oneDNN emulates it and fp32 is faster."""
    try:
        flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))


def _onednn_ok() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class CpuLinear(nn.Module):
    """Inference-only drop-in for an nn.Linear on CPU: x [..., in] -> [..., out]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().contiguous(), requires_grad=False)  # [out, in]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.onednn = self.weight.dtype in ONEDNN_DTYPES and _onednn_ok()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.onednn and x.dtype == self.weight.dtype and x.device.type == "cpu"):
            return nn.functional.linear(x, self.weight, self.bias)
        if x.dtype == torch.bfloat16 and x.shape[:-1].numel() == 1:  # the row-invariant kernel
            padded = torch.cat([x.reshape(1, -1), x.new_zeros(1, self.in_features)])
            out = torch.ops.mkldnn._linear_pointwise(padded, self.weight, self.bias, "none", [], "")
            return out[:1].view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def use_cpu_linears(model: nn.Module) -> nn.Module:
    """Replace every CPU nn.Linear inside `model` by a CpuLinear (in place) -> model.

    Tied weights (an LM head sharing the embedding) stay shared: no weight is copied."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu":
                setattr(module, name, CpuLinear(child))
    return model


def _bench(hidden: int = 576, inter: int = 1536, vocab: int = 49152, layers: int = 30,
           repeats: int = 9) -> None:
    """Median time of one pass through the linears of `layers` Llama layers + an LM head."""
    shapes = [(hidden, hidden), (hidden // 3, hidden), (hidden // 3, hidden), (hidden, hidden),
              (inter, hidden), (inter, hidden), (hidden, inter)] * layers + [(vocab, hidden)]
    plain = [nn.Linear(i, o, bias=False) for o, i in shapes]
    ours = [CpuLinear(m) for m in plain]
    ours_bf16 = [CpuLinear(m.to(torch.bfloat16)) for m in [nn.Linear(i, o, bias=False) for o, i in shapes]]
    print("rows  nn.Linear ms  CpuLinear ms  CpuLinear bf16 ms")
    with torch.inference_mode():
        for rows in (1, 2, 3, 5, 8, 16):
            times = []
            for mods, dtype in ((plain, torch.float32), (ours, torch.float32), (ours_bf16, torch.bfloat16)):
                xs = {i: torch.randn(rows, i, dtype=dtype) for i in (hidden, inter)}
                runs = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    for m in mods:
                        m(xs[m.in_features])
                    runs.append(time.perf_counter() - start)
                times.append(sorted(runs)[repeats // 2] * 1e3)
            print(f"{rows:4d}  {times[0]:12.1f}  {times[1]:12.1f}  {times[2]:17.1f}", flush=True)


def _bench_target(rows_list=(1, 2, 3, 5, 8, 16), context: int = 200, repeats: int = 7) -> None:
    """Median time of the default target's forward (+ LM head) for `rows` new tokens of one
    request at `context`, with torch's nn.Linear and with CpuLinear (interleaved)."""
    from eagle_serve import paths
    from eagle_serve.interfaces import RaggedBatch
    from eagle_serve.kv_pages import PagePool
    from eagle_serve.target import TargetModel

    folder = paths.default_target_dir()
    ours = TargetModel(folder, num_pages=64)
    plain = TargetModel(folder, num_pages=64)
    plain.hf = type(plain.hf).from_pretrained(str(folder), dtype=torch.float32).eval()  # nn.Linear
    times: dict = {}
    for _ in range(repeats):
        for rows in rows_list:
            pool, table = PagePool(64, 16), []
            pool.grow(table, context + rows)
            pos = list(range(context, context + rows))
            batch = RaggedBatch(torch.randint(0, 1000, (rows,)), torch.tensor(pos), torch.tensor([0, rows]),
                                torch.tensor([context + rows]), torch.tensor([table]),
                                torch.tensor([pool.slot(table, p) for p in pos]))
            for name, model in (("nn.Linear", plain), ("CpuLinear", ours)):
                start = time.perf_counter()
                model.logits(batch, torch.arange(rows))
                times.setdefault((rows, name), []).append(time.perf_counter() - start)
    print(f"target forward, 1 request at context {context}: new tokens, ms (x of 1 token)")
    for rows in rows_list:
        cells = []
        for name in ("nn.Linear", "CpuLinear"):
            t = sorted(times[(rows, name)])[repeats // 2] * 1e3
            t1 = sorted(times[(1, name)])[repeats // 2] * 1e3
            cells.append(f"{name} {t:6.1f} ({t / t1:.2f}x)")
        print(f"{rows:4d}  " + "  ".join(cells))


if __name__ == "__main__":
    _bench()
    _bench_target()
