"""Each kernel against its PyTorch reference on CUDA: `python -m eagle_serve.kernels.bench` prints one
row per hot path (milliseconds by triton.testing.do_bench, and the speed-up). Without a GPU it says
so and exits 0; tests/kernels/ checks the kernels themselves, under the interpreter.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch

from eagle_serve.kernels.layer_ops import add_rms_norm, rope_write_kv, silu_mul
from eagle_serve.kernels.paged_attention import paged_attention
from eagle_serve.kernels.rejection import greedy_accept, random_accept
from eagle_serve.kernels.sampling import DRAFT, compute_probs, sample
from eagle_serve.kernels.workspace import gather_rows, scatter_rows

# name -> call(impl); sizes: a Llama-3-8B-like target (vocab 128256, 32/8 heads of 128) with
# 64 requests drafting 4 tokens each. `small` shrinks everything for the interpreter.
Case = tuple[str, Callable[[str], object]]


def cases(device: str, small: bool = False) -> list[Case]:
    gen = torch.Generator(device=device).manual_seed(0)
    reqs, k = (3, 2) if small else (64, 4)
    vocab = 111 if small else 128256
    dtype = torch.float32 if small else torch.bfloat16

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    logits = randn(reqs, vocab)
    temperature = torch.full((reqs,), 0.8, device=device)
    top_k = torch.full((reqs,), 50, device=device, dtype=torch.int64)
    top_p = torch.full((reqs,), 0.9, device=device)
    no_k, no_p = torch.zeros_like(top_k), torch.ones_like(top_p)
    probs = torch.softmax(logits, dim=1)
    seeds, positions = list(range(reqs)), [100] * reqs

    n_drafts = reqs * k
    cu = torch.arange(0, n_drafts + 1, k)
    target_probs = torch.softmax(randn(n_drafts + reqs, vocab), dim=1)
    draft_probs = torch.softmax(randn(n_drafts, vocab), dim=1)
    drafts = sample(draft_probs, [0] * n_drafts, list(range(n_drafts)), DRAFT, impl="ref")
    argmax = target_probs.argmax(dim=1)
    flat = torch.arange(n_drafts, device=device)
    drafts_greedy = argmax[flat + flat // k]  # every draft matches: the longest walk
    store = torch.zeros(2 * n_drafts, vocab, device=device)
    slots = torch.randperm(2 * n_drafts, generator=gen, device=device)[:n_drafts]

    q_heads, kv_heads, head_dim, page = (6, 2, 40, 5) if small else (32, 8, 128, 16)
    context = 37 if small else 2048
    pages = -(-(context + k + 1) // page)
    k_cache = randn(reqs * pages, page, kv_heads, head_dim, dtype=dtype)
    v_cache = randn(reqs * pages, page, kv_heads, head_dim, dtype=dtype)
    tables = torch.randperm(reqs * pages, generator=gen, device=device).view(reqs, pages)
    lens = torch.full((reqs,), context + k + 1, device=device)
    new_k = randn(reqs * (k + 1), kv_heads, head_dim, dtype=dtype)
    new_slots = (tables[:, -1:] * page + torch.arange(k + 1, device=device)).flatten()
    new_slots[::3] = -1  # padding
    new_q = randn(reqs * (k + 1), q_heads, head_dim, dtype=dtype)
    cos, sin = randn(reqs * (k + 1), head_dim, dtype=dtype), randn(reqs * (k + 1), head_dim, dtype=dtype)
    hidden, inter = (72, 200) if small else (4096, 14336)
    x, residual = randn(reqs * (k + 1), hidden, dtype=dtype), randn(reqs * (k + 1), hidden, dtype=dtype)
    norm, gate_up = randn(hidden, dtype=dtype), randn(reqs * (k + 1), 2 * inter, dtype=dtype)
    scale = head_dim ** -0.5

    def attention(n_q: int, tree: bool):
        q = randn(reqs * n_q, q_heads, head_dim, dtype=dtype)
        cu_q = torch.arange(0, reqs * n_q + 1, n_q, device=device)
        chain = torch.tril(torch.ones(reqs, n_q, n_q, dtype=torch.bool, device=device))
        return lambda impl: paged_attention(q, k_cache, v_cache, tables, cu_q, lens, scale,
                                            impl=impl, tree_mask=chain if tree else None)

    return [
        ("compute_probs temperature",
         lambda impl: compute_probs(logits, temperature, no_k, no_p, impl=impl)),
        ("compute_probs top-k 50, top-p 0.9",
         lambda impl: compute_probs(logits, temperature, top_k, top_p, impl=impl)),
        ("sample (exponential race)",
         lambda impl: sample(probs, seeds, positions, DRAFT, impl=impl)),
        ("greedy_accept", lambda impl: greedy_accept(drafts_greedy, cu, argmax, impl=impl)),
        ("random_accept", lambda impl: random_accept(drafts, cu, target_probs, draft_probs, seeds,
                                                     positions, impl=impl)),
        ("scatter_rows (draft probs)",
         lambda impl: scatter_rows(store, slots, draft_probs, impl=impl)),
        ("gather_rows (draft probs)", lambda impl: gather_rows(store, slots, impl=impl)),
        ("add + RMSNorm", lambda impl: add_rms_norm(x, residual, norm, 1e-5, impl=impl)),
        ("RoPE + KV write", lambda impl: rope_write_kv(new_q, new_k, new_k, cos, sin, k_cache, v_cache,
                                                       new_slots, impl=impl)),
        ("SiLU-and-mul", lambda impl: silu_mul(gate_up, impl=impl)),
        ("paged_attention decode", attention(1, tree=False)),
        (f"paged_attention verify ({k + 1} queries)", attention(k + 1, tree=False)),
        (f"paged_attention tree ({k + 1} queries)", attention(k + 1, tree=True)),
    ]


def run(device: str = "cuda", small: bool = False,
        timer: Callable[[Callable[[], object]], float] | None = None,
        ) -> list[tuple[str, float, float]]:
    """-> (name, reference ms, kernel ms) per case; prints the table."""
    if timer is None:
        from triton.testing import do_bench
        timer = do_bench
    rows = []
    print(f"{'hot path':40s} {'reference ms':>13s} {'kernel ms':>10s} {'speed-up':>9s}")
    for name, call in cases(device, small):
        ref_ms, kernel_ms = timer(lambda: call("ref")), timer(lambda: call("triton"))
        speedup = f"{ref_ms / kernel_ms:8.1f}x" if kernel_ms > 0 else f"{'-':>9s}"
        print(f"{name:40s} {ref_ms:13.3f} {kernel_ms:10.3f} {speedup}")
        rows.append((name, ref_ms, kernel_ms))
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("eagle_serve.kernels.bench: skipped, no CUDA device (tests/kernels/ runs the kernels on CPU "
              "under TRITON_INTERPRET=1)")
        return 0
    print(f"device: {torch.cuda.get_device_name()}")
    run("cuda")
    return 0


if __name__ == "__main__":
    sys.exit(main())
