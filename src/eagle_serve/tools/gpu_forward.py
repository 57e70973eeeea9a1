"""gpu-check's forward-path steps: plain greedy decoding on the PyTorch layers, the fused layer
kernels (eagle_serve.kernels.layer_ops) and those replayed as CUDA graphs (models.graphs),
in turn; the kernels a decode forward launches on each; and one token through the whole
forward alone vs among the rows of a verify pass.
"""
from __future__ import annotations

import time

import torch

from eagle_serve.core.interfaces import RaggedBatch
from eagle_serve.core.kv_pages import PagePool
from eagle_serve.core.requests import SamplingParams
from eagle_serve.kernels import layer_ops as lo
from eagle_serve.tools.launches import launches_per_call

PATHS = ("PyTorch layers", "fused layers", "fused + CUDA graphs")


def forward_path(engine, path: str):
    """Put the target on one of PATHS -> a function that restores it."""
    target, graphs = engine.target, engine.target.graphs
    target.graphs = graphs if path == PATHS[2] else None
    original = lo.use_kernel
    if path == PATHS[0]:
        lo.use_kernel = lambda impl, tensor: False

    def restore():
        target.graphs, lo.use_kernel = graphs, original
    return restore


def decode_launches(engine, prompt: list[int]) -> int:
    """Kernels launched by the target's forward at a plain greedy decode step."""
    with launches_per_call(engine.target, "forward") as counts:
        engine.generate([prompt], SamplingParams(max_tokens=3, num_speculative_tokens=0))
    return counts[-1]


def path_comparison(engine, prompts: list[list[int]], max_tokens: int) -> dict[str, dict]:
    """Per forward path: plain greedy tokens/s (prompts through each path in turn, the order
    rotated per prompt), launches of one decode forward, outputs equal to the fused path's."""
    params = SamplingParams(max_tokens=max_tokens, num_speculative_tokens=0)
    seconds, tokens, outputs = ({p: 0.0 for p in PATHS}, {p: 0 for p in PATHS}, {p: [] for p in PATHS})
    launches = {}
    for path in PATHS:  # untimed: compiles and captures
        restore = forward_path(engine, path)
        engine.generate(prompts[:1], params)
        launches[path] = decode_launches(engine, prompts[0])
        restore()
    for i, prompt in enumerate(prompts):
        for path in PATHS[i % 3:] + PATHS[:i % 3]:
            restore = forward_path(engine, path)
            start = time.perf_counter()
            out = engine.generate([prompt], params)[0].token_ids
            seconds[path] += time.perf_counter() - start
            restore()
            tokens[path] += len(out)
            outputs[path].append(out)
    return {p: dict(tokens_per_s=tokens[p] / seconds[p], launches=launches[p],
                    same_as_fused=sum(a == b for a, b in zip(outputs[p], outputs[PATHS[1]])))
            for p in PATHS}


def forward_invariance(target, prompt: list[int], sizes=(2, 4, 8, 16, 64)) -> dict[int, dict]:
    """The prompt's last token through the whole forward alone (a decode step) vs as the first of
    n rows (a verify pass): {n: max |logit difference|, argmax equal, top-2 logits where not}."""
    # its own pages from the first: run last (the engine's prefix cache may hold them)
    device, pool, table = target.device, PagePool(target.cache.num_pages, target.cache.page_size), []

    def rows(tokens: list[int], start: int) -> torch.Tensor:
        pool.grow(table, start + len(tokens))
        n = len(tokens)
        t = lambda values: torch.tensor(values, device=device)  # noqa: E731
        batch = RaggedBatch(t(tokens), t(list(range(start, start + n))), t([0, n]), t([start + n]),
                            t([table]), t([pool.slot(table, i) for i in range(start, start + n)]),
                            max_query_len=n)
        return target.logits(batch, torch.arange(n, device=device))

    rows(prompt[:-1], 0)  # the context, cached
    alone = rows(prompt[-1:], len(prompt) - 1)[0].float()
    out = {}
    for n in sizes:
        first = rows((prompt[-1:] + prompt * (n // len(prompt) + 1))[:n], len(prompt) - 1)[0].float()
        same = bool(alone.argmax() == first.argmax())
        out[n] = dict(max_diff=(alone - first).abs().max().item(), argmax_equal=same)
        if not same:
            out[n]["top2_alone"] = alone.topk(2).values.tolist()
            out[n]["top2_among"] = first.topk(2).values.tolist()
    return out
