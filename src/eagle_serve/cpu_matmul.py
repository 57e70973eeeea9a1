"""Linear layers for the small row counts of decoding and verification on CPU.

Measured on this machine kind (AMD EPYC, 2 threads, fp32, SmolLM2-135M;
`python -m eagle_serve.cpu_matmul`): torch's default fp32 GEMM (MKL) makes the target forward
for 2 new tokens cost 1.72x one token, 3 tokens 1.80x, 5 tokens 1.40x, and its LM head
(49152 x 576) 2-3x more for 2-8 rows than for 1; the verify pass of speculative decoding feeds
exactly k + 1 = 2..9 rows per request. oneDNN's fp32 GEMM (what
`torch.utils.mkldnn.MkldnnLinear` runs) grows gently with rows, and for a single row a GEMV
over the transposed weight is fastest. `CpuLinear` keeps the weight transposed ([in, out]) for
1 row and an oneDNN copy for 2+ rows (fp32 only; other dtypes use the transposed weight for
every row count): one token 50.6 -> 44.8 ms, and 2 / 3 / 5 / 8 tokens 1.32x / 1.13x / 1.29x /
1.25x of one (noisy machine). Outputs equal nn.Linear's up to float rounding (the kernels sum
in different orders). The price is a second copy of each weight in memory (~0.5 GB here).
GPU modules are left alone.
"""
from __future__ import annotations

import time

import torch
from torch import nn


class CpuLinear(nn.Module):
    """Inference-only drop-in for an nn.Linear on CPU: x [..., in] -> [..., out]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.weight_t = nn.Parameter(weight.t().contiguous(), requires_grad=False)  # [in, out]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.onednn = None  # [out, in] oneDNN layout, fp32 only (not a parameter: never saved)
        if weight.dtype == torch.float32 and torch.backends.mkldnn.is_available():
            self.onednn = weight.contiguous().to_mkldnn()
            self.onednn_bias = None if self.bias is None else self.bias.detach().to_mkldnn()

    @property
    def weight(self) -> torch.Tensor:
        """[out, in] view, as nn.Linear's (for code that reads the weight)"""
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = lead.numel()
        x2 = x.reshape(rows, self.in_features)
        if rows > 1 and self.onednn is not None and x.dtype == torch.float32:
            out = torch._C._nn.mkldnn_linear(x2.to_mkldnn(), self.onednn, self.onednn_bias).to_dense()
        elif self.bias is None:
            out = torch.mm(x2, self.weight_t)
        else:
            out = torch.addmm(self.bias, x2, self.weight_t)
        return out.view(*lead, self.out_features)


def use_cpu_linears(model: nn.Module) -> nn.Module:
    """Replace every CPU nn.Linear inside `model` by a CpuLinear (in place) -> model.

    Tied weights (an LM head sharing the embedding) get their own copies."""
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
    print("rows  nn.Linear ms  CpuLinear ms")
    with torch.inference_mode():
        for rows in (1, 2, 3, 5, 8, 16):
            xs = {i: torch.randn(rows, i) for i in (hidden, inter)}
            times = []
            for mods in (plain, ours):
                runs = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    for m in mods:
                        m(xs[m.in_features])
                    runs.append(time.perf_counter() - start)
                times.append(sorted(runs)[repeats // 2] * 1e3)
            print(f"{rows:4d}  {times[0]:12.1f}  {times[1]:12.1f}", flush=True)


def _bench_target(rows_list=(1, 2, 3, 5, 8, 16), context: int = 200, repeats: int = 7) -> None:
    """Median time of the default target's forward (+ LM head) for `rows` new tokens of one
    request at `context`, with torch's nn.Linear and with CpuLinear (interleaved)."""
    from eagle_serve import paths
    from eagle_serve.interfaces import RaggedBatch
    from eagle_serve.kv_pages import PagePool
    from eagle_serve.llama import TargetModel

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
