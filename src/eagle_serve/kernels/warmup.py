"""Compile every kernel variant a served model can launch before its first request.

Triton compiles one binary per variant of a kernel: per value of its constexpr arguments (the
tile sizes a launcher derives from the batch's shape, HAS_TREE, PRECISION), per dtype of its
tensor arguments, and per specialization of its integer arguments (equal to 1, a multiple of
16, other). The kernels mark their batch-dependent integers `do_not_specialize`, so a variant
depends only on the launch parameters the launchers pick (`attention_tile`,
`vocab_row_tile`, `request_block`, `row_tile`, ...) and on values fixed by the served model
(head sizes, vocabulary, cache and workspace shapes, dtypes).

The functions here enumerate, through those same tile functions, every value a launcher can
pick for any batch, and run the launcher once per value on small tensors shaped like the served
model: the model's own KV cache and workspace tensors (read, or written with skipped slots
only), its vocabulary and dtypes. Each process warms what it launches: `warm_target` in
eagle_target, `warm_drafter` in eagle_drafter, `warm_engine` in spec_decode. On CPU they do
nothing (the references run there) unless `force=True` (the tests, under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from eagle_serve.kernels.layer_ops import add_rms_norm_triton, rope_write_kv_triton, silu_mul_triton
from eagle_serve.kernels.paged_attention import attention_tile, paged_attention_triton
from eagle_serve.kernels.rejection import greedy_accept_triton, random_accept_triton, request_block
from eagle_serve.kernels.sampling import compute_probs_triton, sample_triton, vocab_row_tile
from eagle_serve.kernels.workspace import gather_rows_triton, row_tile, scatter_rows_triton

MAX_ROWS = 4096  # every tile function saturates below this many rows / tokens / requests
MAX_QUERIES = 64  # attention_tile saturates at 64 tile rows (>= 1 query of each q head)


@dataclass(frozen=True)
class WarmupReport:
    launches: int   # launcher calls made (one per variant)
    seconds: float


def smallest_inputs(tile, sizes) -> dict:
    """{launch parameters: the smallest size giving them} over `sizes` (ascending)."""
    picked: dict = {}
    for n in sizes:
        picked.setdefault(tile(n), n)
    return picked


def warm_attention(k_cache: torch.Tensor, v_cache: torch.Tensor, q_heads: int,
                   windows: set[int] = frozenset({0}), softcap: float = 0.0) -> int:
    """Paged attention (every tile, with and without a draft tree, for each sliding window the
    model's layers use (0 = none) and its soft-cap) on the model's own caches [P, page_size,
    Hkv, D]: reads change nothing."""
    _, page_size, kv_heads, head_dim = k_cache.shape
    device, dtype = k_cache.device, k_cache.dtype
    launches = 0
    group = q_heads // kv_heads
    for n in smallest_inputs(lambda q: attention_tile(group, q), range(1, MAX_QUERIES + 1)).values():
        pages = -(-n // page_size)
        assert pages <= k_cache.shape[0], "the cache is smaller than one attention tile"
        q = torch.zeros((n, q_heads, head_dim), dtype=dtype, device=device)
        table = torch.arange(pages, dtype=torch.int64, device=device).unsqueeze(0)  # [1, P]
        cu = torch.tensor([0, n], dtype=torch.int64, device=device)
        lens = torch.tensor([n], dtype=torch.int64, device=device)
        causal = torch.ones((1, n, n), dtype=torch.bool, device=device).tril()
        for tree, window in itertools.product((None, causal), sorted(windows)):
            paged_attention_triton(q, k_cache, v_cache, table, cu, lens, head_dim ** -0.5, tree,
                                   window=window, softcap=softcap)
            launches += 1
    return launches


def warm_layers(model) -> int:
    """The target's fused layer kernels (eagle_serve.kernels.layer_ops), where its layers run
    them: the norm with and without a residual, RoPE + KV write on views of a q/k/v projection
    shaped like the model's (the same pointer alignments), SiLU-and-mul. Writes skip every slot."""
    if not model.fusable:
        return 0
    cfg, dtype, device = model.config, model.dtype, model.device
    hidden, cache = cfg.hidden_size, model.cache
    x = torch.zeros((1, hidden), dtype=dtype, device=device)
    norm = model.hf.model.norm.weight
    add_rms_norm_triton(x, x, norm, 1e-6)
    add_rms_norm_triton(x, None, norm, 1e-6)
    qkv = torch.zeros((1, model.q_width + 2 * model.kv_width), dtype=dtype, device=device)
    q, k, v = (t.view(1, -1, model.head_dim) for t in qkv.split([model.q_width, model.kv_width, model.kv_width], -1))
    rope = model._rope(x, torch.zeros(1, dtype=torch.int64, device=device))
    skip = torch.full((1,), -1, dtype=torch.int64, device=device)
    for cos, sin in rope.values():
        rope_write_kv_triton(q, k, v, cos, sin, cache.keys[0], cache.values[0], skip)
    gate_up = torch.zeros((1, 2 * cfg.intermediate_size), dtype=dtype, device=device)
    silu_mul_triton(gate_up)
    return 3 + len(rope)


def warm_head(head, cache, dtype, device) -> int:
    """A draft head's layer kernels: its norms (each width), SiLU-and-mul, RoPE + KV write (q, k, v
    contiguous: separate projections). Writes skip every slot."""
    widths = {m.weight.shape[0] for m in head.modules() if type(m).__name__ == "RMSNorm"}
    for width in widths:
        x = torch.zeros((1, width), dtype=dtype, device=device)
        add_rms_norm_triton(x, None, x[0], 1e-6)
    silu_mul_triton(torch.zeros((1, 2 * head.spec.layer.intermediate_size), dtype=dtype, device=device))
    cfg, d = head.spec.layer, head.head_dim
    q = torch.zeros((1, cfg.num_attention_heads, d), dtype=dtype, device=device)
    kv = torch.zeros((1, cfg.num_key_value_heads, d), dtype=dtype, device=device)
    cos, sin = head.rotary(q, torch.zeros((1, 1), dtype=torch.int64, device=device))
    skip = torch.full((1,), -1, dtype=torch.int64, device=device)
    rope_write_kv_triton(q, kv, kv, cos[0], sin[0], cache.keys[0], cache.values[0], skip)
    return len(widths) + 2


def warm_probs(vocab: int, dtype: torch.dtype, device) -> int:
    """compute_probs on logits of `dtype` (one variant: the tile depends on the vocabulary)."""
    logits = torch.zeros((1, vocab), dtype=dtype, device=device)
    ones = torch.ones(1, device=device)
    compute_probs_triton(logits, ones, torch.zeros(1, dtype=torch.int64, device=device), ones)
    return 1


def warm_sample(vocab: int, device) -> int:
    """Sampling from float32 probabilities, every BLOCK_R."""
    launches = 0
    for rows in smallest_inputs(lambda r: vocab_row_tile(r, vocab), range(1, MAX_ROWS + 1)).values():
        probs = torch.full((rows, vocab), 1.0 / vocab, device=device)
        sample_triton(probs, [0] * rows, [0] * rows, 0)
        launches += 1
    return launches


def warm_acceptance(vocab: int, device) -> int:
    """Greedy and random acceptance (float32 target and draft probabilities): every BLOCK_B of
    the per-request kernels, and every BLOCK_R of the residual race over the target rows."""
    launches = 0
    by_requests = smallest_inputs(request_block, range(1, MAX_ROWS + 1)).values()
    by_rows = smallest_inputs(lambda r: vocab_row_tile(r, vocab), range(1, MAX_ROWS + 1)).values()
    cases = [(b, 0) for b in by_requests] + [(1, rows - 1) for rows in by_rows]
    for num_req, k in cases:  # num_req requests with k drafts each: num_req * (k + 1) rows
        drafts = torch.zeros(num_req * k, dtype=torch.int64, device=device)
        cu = torch.arange(num_req + 1, dtype=torch.int64, device=device) * k
        argmax = torch.zeros(num_req * (k + 1), dtype=torch.int64, device=device)
        greedy_accept_triton(drafts, cu, argmax)
        p = torch.full((num_req * (k + 1), vocab), 1.0 / vocab, device=device)
        q = torch.full((num_req * k, vocab), 1.0 / vocab, device=device)
        random_accept_triton(drafts, cu, p, q, [0] * num_req, [0] * num_req)
        launches += 2
    return launches


def warm_workspace(store: torch.Tensor) -> int:
    """Scatter into and gather from the engine's draft workspace [S, V], every BLOCK_N (the
    scatter skips every slot)."""
    launches = 0
    for n in smallest_inputs(lambda r: row_tile(r, store.shape[1]), range(1, MAX_ROWS + 1)).values():
        skip = torch.full((n,), -1, dtype=torch.int64, device=store.device)
        scatter_rows_triton(store, skip, torch.zeros((n, store.shape[1]), device=store.device))
        gather_rows_triton(store, skip)
        launches += 2
    return launches


def _timed(device: torch.device, force: bool, warm) -> WarmupReport | None:
    if device.type != "cuda" and not force:
        return None
    start = time.perf_counter()
    launches = warm()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return WarmupReport(launches, time.perf_counter() - start)


def warm_target(model, force: bool = False) -> WarmupReport | None:
    """What eagle_serve.models.target.TargetModel launches: the fused layer kernels (RoPE with the
    KV write among them), attention, probabilities."""
    def warm():
        cache = model.cache
        windows = {layer.window for layer in model.layers}
        return (warm_layers(model)
                + warm_attention(cache.keys[0], cache.values[0], model.config.num_attention_heads,
                                 windows, model.attn_softcap)
                + warm_probs(model.vocab_size, model.dtype, model.device))
    return _timed(model.device, force, warm)


def warm_drafter(drafter, force: bool = False) -> WarmupReport | None:
    """What eagle_serve.models.drafter.Drafter launches: its layer's kernels, attention, draft
    probabilities over its own vocabulary and sampling from them."""
    def warm():
        spec, cache = drafter.head.spec, drafter.cache
        return (warm_head(drafter.head, cache, drafter.dtype, drafter.device)
                + warm_attention(cache.keys[0], cache.values[0], spec.layer.num_attention_heads)
                + warm_probs(spec.draft_vocab_size, drafter.dtype, drafter.device)
                + warm_sample(spec.draft_vocab_size, drafter.device))
    return _timed(drafter.device, force, warm)


def warm_engine(engine, force: bool = False) -> WarmupReport | None:
    """What eagle_serve.engine.Engine launches: acceptance over the target vocabulary and the
    draft workspace."""
    def warm():
        return (warm_acceptance(engine.target.vocab_size, engine.device)
                + warm_workspace(engine.workspace.probs))
    return _timed(engine.device, force, warm)
