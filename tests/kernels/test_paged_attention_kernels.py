"""Paged attention: the kernel against the reference (within float32 tolerance), at page sizes
that do not divide the lengths, GQA with a group of 3, a head size of 40, decode / verify /
prefill / empty requests and draft trees."""
from __future__ import annotations

import itertools

import pytest
import torch

import eagle_serve.kernels.rowwise_attention as rowwise_module
from eagle_serve.kernels.attention_ref import paged_attention_ref
from eagle_serve.kernels.cpu import cpu_kernels
from eagle_serve.kernels.layer_ops import rope_write_kv_triton
from eagle_serve.kernels.paged_attention import paged_attention
from eagle_serve.kernels.rowwise_attention import paged_attention_rowwise

Q_HEADS, KV_HEADS, HEAD_DIM = 6, 2, 40


@pytest.fixture(params=["cpu.cpp", "python"])
def rowwise_path(request, monkeypatch):
    """paged_attention_rowwise through eagle_serve/kernels/cpu.cpp's `attend` (where this CPU builds it) or
    through its PyTorch fallback."""
    if request.param == "cpu.cpp" and cpu_kernels() is None:
        pytest.skip("eagle_serve/kernels/cpu.cpp needs AVX2, FMA and a compiler")
    if request.param == "python":
        monkeypatch.setattr(rowwise_module, "cpu_kernels", lambda: None)
    return request.param


def make_batch(n_q: list[int], seq_lens: list[int], page_size: int, seed: int = 0):
    """Random caches and queries; pages handed out shuffled, block tables -1 padded."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages) + 3
    k_cache = torch.randn(num_pages, page_size, KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn(num_pages, page_size, KV_HEADS, HEAD_DIM, generator=gen)
    order = torch.randperm(num_pages, generator=gen)
    tables = torch.full((len(n_q), max(pages) + 2), -1, dtype=torch.int64)
    for b, (first, count) in enumerate(zip(itertools.accumulate([0] + pages), pages)):
        tables[b, :count] = order[first:first + count]
    cu = torch.tensor([0] + list(itertools.accumulate(n_q)))
    q = torch.randn(int(cu[-1]), Q_HEADS, HEAD_DIM, generator=gen)
    return q, k_cache, v_cache, tables, cu, torch.tensor(seq_lens)


BATCHES = {
    "decode, one request": ([1], [37]),
    "decode, seven requests": ([1] * 7, [37, 1, 5, 16, 17, 64, 3]),
    "verify k+1 = 4": ([4, 4, 4], [23, 4, 41]),
    "mixed, with a prefill and an empty request":
        ([1, 4, 0, 7, 1, 3, 70], [37, 12, 9, 7, 1, 20, 70]),
}


@pytest.mark.parametrize("page_size", [5, 16])
@pytest.mark.parametrize("name", list(BATCHES))
def test_attention_kernel_matches_the_reference(name, page_size):
    batch = make_batch(*BATCHES[name], page_size)
    scale = HEAD_DIM ** -0.5
    kernel = paged_attention(*batch, scale, impl="triton")
    torch.testing.assert_close(kernel, paged_attention_ref(*batch, scale), atol=2e-5, rtol=2e-5)


def tree_masks(n_q: list[int]) -> torch.Tensor:
    """[B, 8, 8]: a draft tree per request: token 0 the root, 1 and 2 its children, 3 a child
    of 1, 4 of 2, 5 of 3, 6 of 4 (ancestors and self visible)."""
    parent = [-1, 0, 0, 1, 2, 3, 4, 5]
    mask = torch.zeros(8, 8, dtype=torch.bool)
    for i in range(8):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask.expand(len(n_q), 8, 8).clone()


def test_tree_masked_attention_kernel_matches_the_reference():
    n_q, seq_lens = [7, 1, 5, 0, 3], [30, 9, 5, 4, 13]
    batch = make_batch(n_q, seq_lens, page_size=5, seed=1)
    tree = tree_masks(n_q)
    kernel = paged_attention(*batch, 0.2, impl="triton", tree_mask=tree)
    torch.testing.assert_close(kernel, paged_attention_ref(*batch, 0.2, tree_mask=tree),
                               atol=2e-5, rtol=2e-5)


def test_a_tree_query_sees_only_the_context_and_its_ancestors():
    """Query 4 (path 0 -> 2 -> 4) of a request equals plain attention over the context plus
    new tokens 0, 2 and 4, computed by hand."""
    n_q, seq_lens, page_size = [7], [19], 4
    q, k_cache, v_cache, tables, cu, lens = make_batch(n_q, seq_lens, page_size, seed=2)
    out = paged_attention(q, k_cache, v_cache, tables, cu, lens, 0.3, impl="triton",
                          tree_mask=tree_masks(n_q))
    seen = list(range(12)) + [12 + 0, 12 + 2, 12 + 4]
    slots = [int(tables[0, t // page_size]) * page_size + t % page_size for t in seen]
    keys = k_cache.reshape(-1, KV_HEADS, HEAD_DIM)[slots].repeat_interleave(3, dim=1)  # [S, Hq, D]
    values = v_cache.reshape(-1, KV_HEADS, HEAD_DIM)[slots].repeat_interleave(3, dim=1)
    weights = torch.softmax(torch.einsum("hd,shd->hs", q[4], keys) * 0.3, dim=1)
    torch.testing.assert_close(out[4], torch.einsum("hs,shd->hd", weights, values),
                               atol=2e-5, rtol=2e-5)


def test_a_lower_triangular_tree_is_the_default_causal_mask():
    n_q = [4, 1, 6]
    batch = make_batch(n_q, [10, 3, 6], page_size=5, seed=3)
    chain = torch.tril(torch.ones(3, 6, 6, dtype=torch.bool))
    plain = paged_attention_ref(*batch, 0.25)
    assert torch.equal(paged_attention_ref(*batch, 0.25, tree_mask=chain), plain)
    torch.testing.assert_close(paged_attention(*batch, 0.25, impl="triton", tree_mask=chain), plain,
                               atol=2e-5, rtol=2e-5)


def test_kv_write_then_attention_uses_what_was_written():
    """Write a request's new tokens through the GPU path's KV write (RoPE's, an identity
    rotation here), then decode over them."""
    page_size, n_new = 5, 7
    q, k_cache, v_cache, tables, cu, lens = make_batch([1], [n_new], page_size, seed=4)
    k = torch.randn(n_new, KV_HEADS, HEAD_DIM)
    v = torch.randn(n_new, KV_HEADS, HEAD_DIM)
    slots = torch.tensor([int(tables[0, t // page_size]) * page_size + t % page_size
                          for t in range(n_new)])
    no_turn = torch.ones(n_new, HEAD_DIM), torch.zeros(n_new, HEAD_DIM)  # cos, sin
    rope_write_kv_triton(torch.zeros(n_new, 1, HEAD_DIM), k, v, *no_turn, k_cache, v_cache, slots)
    out = paged_attention(q, k_cache, v_cache, tables, cu, lens, 0.5, impl="triton")
    weights = torch.softmax(torch.einsum("hd,shd->hs", q[0], k.repeat_interleave(3, 1)) * 0.5, 1)
    expected = torch.einsum("hs,shd->hd", weights, v.repeat_interleave(3, 1))
    torch.testing.assert_close(out[0], expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", list(BATCHES))
def test_row_invariant_attention_matches_the_reference(name, rowwise_path):
    batch = make_batch(*BATCHES[name], page_size=5)
    scale = HEAD_DIM ** -0.5
    torch.testing.assert_close(paged_attention_rowwise(*batch, scale), paged_attention_ref(*batch, scale),
                               atol=2e-5, rtol=2e-5)
    n_q, seq_lens = [7, 1, 5, 0, 3], [30, 9, 5, 4, 13]
    batch = make_batch(n_q, seq_lens, page_size=5, seed=1)
    tree = tree_masks(n_q)
    torch.testing.assert_close(paged_attention_rowwise(*batch, scale, tree_mask=tree),
                               paged_attention_ref(*batch, scale, tree_mask=tree), atol=2e-5, rtol=2e-5)


def test_the_layers_of_a_forward_share_one_plan_and_get_the_results_of_planning_alone(
        rowwise_path, monkeypatch):
    """A batch's plans (RaggedBatch.plans) are built at its first layer's call; the other layers
    reuse them, with the same results as a call planned alone."""
    n_q, seq_lens = [7, 1, 5, 0, 3], [30, 9, 5, 4, 13]
    q, k_cache, v_cache, tables, cu, lens = make_batch(n_q, seq_lens, page_size=5, seed=2)
    tree, scale = tree_masks(n_q), HEAD_DIM ** -0.5
    built = []
    monkeypatch.setattr(rowwise_module, "_rowwise_queries",
                        lambda *a, f=rowwise_module._rowwise_queries: built.append(1) or f(*a))
    plans = {}
    layers = [(q * (i + 1), k_cache * (i + 1), v_cache - i) for i in range(3)]  # three "layers"
    shared = [paged_attention_rowwise(lq, kc, vc, tables, cu, lens, scale, tree_mask=tree, plans=plans)
              for lq, kc, vc in layers]
    assert len(built) == 1 and len(plans) == 1
    alone = [paged_attention_rowwise(lq, kc, vc, tables, cu, lens, scale, tree_mask=tree)
             for lq, kc, vc in layers]
    assert len(built) == 4
    for a, b in zip(shared, alone):
        assert torch.equal(a, b)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (9, 2.5)], ids=["plain", "window-softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_invariant_verify_query_equals_its_one_token_decode_step_bitwise(dtype, window, softcap, rowwise_path):
    """Each query of a verify pass (a chain, or a tree path) gets exactly the result a decode
    step at its position would, whatever else is in the batch (also with a sliding window and
    soft-capping)."""
    opts = dict(window=window, softcap=softcap)
    n_q, seq_lens = [4, 1, 7], [23, 9, 30]
    q, k_cache, v_cache, tables, cu, lens = make_batch(n_q, seq_lens, page_size=5, seed=2)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    tree = tree_masks(n_q)
    tree[0] = torch.tril(torch.ones(8, 8, dtype=torch.bool))  # request 0: a chain
    out = paged_attention_rowwise(q, k_cache, v_cache, tables, cu, lens, 0.2, tree_mask=tree, **opts)
    # Request 2's node 5 (path 0 -> 1 -> 3 -> 5) decoded alone: its path moved to contiguous
    # slots after the context, as acceptance would leave it.
    prefix, path = 30 - 7, [0, 1, 3, 5]
    flat_k, flat_v = (c.view(-1, KV_HEADS, HEAD_DIM) for c in (k_cache, v_cache))
    slots = [int(tables[2, p // 5]) * 5 + p % 5 for p in range(30)]
    k2, v2 = flat_k.clone(), flat_v.clone()
    for depth, node in enumerate(path):
        k2[slots[prefix + depth]], v2[slots[prefix + depth]] = flat_k[slots[prefix + node]], flat_v[slots[prefix + node]]
    alone = paged_attention_rowwise(q[cu[2] + 5:cu[2] + 6], k2.view_as(k_cache), v2.view_as(v_cache),
                                    tables[2:3], torch.tensor([0, 1]), torch.tensor([prefix + len(path)]), 0.2,
                                    **opts)
    assert torch.equal(alone[0], out[cu[2] + 5])
    # Request 0's query 2 decoded alone at its position.
    alone = paged_attention_rowwise(q[2:3], k_cache, v_cache, tables[:1], torch.tensor([0, 1]),
                                    torch.tensor([23 - 4 + 3]), 0.2, **opts)
    assert torch.equal(alone[0], out[2])


def test_a_verify_pass_and_a_prefill_of_twenty_rows_stay_row_invariant_in_bf16(rowwise_path):
    """A 20-row verify pass after a context of 23, and a 20-token prefill, equal one-token
    decode steps bitwise (a prefix cache hit or a prompt in chunks computes the same KV)."""
    n_q, seq_lens = [20, 20], [43, 20]  # request 1: a prefill
    q, k_cache, v_cache, tables, cu, lens = make_batch(n_q, seq_lens, page_size=5, seed=3)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    out = paged_attention_rowwise(q, k_cache, v_cache, tables, cu, lens, 0.2)
    for i in range(20):
        alone = paged_attention_rowwise(q[i:i + 1], k_cache, v_cache, tables[:1], torch.tensor([0, 1]),
                                        torch.tensor([23 + i + 1]), 0.2)
        assert torch.equal(alone[0], out[i]), f"verify row {i}"
    for i in range(20):
        alone = paged_attention_rowwise(q[20 + i:21 + i], k_cache, v_cache, tables[1:], torch.tensor([0, 1]),
                                        torch.tensor([i + 1]), 0.2)
        assert torch.equal(alone[0], out[20 + i]), f"prefill row {i}"


# ---- sliding windows and soft-capping (Mistral, Qwen2, Gemma 2/3) ----

def tree_positions(n_q: list[int], seq_lens: list[int]) -> torch.Tensor:
    """[T] positions along the sequence of tree_masks' nodes: prefix + depth - 1."""
    depth = [1, 2, 2, 3, 3, 4, 4, 5]
    return torch.tensor([s - n + depth[i] - 1 for n, s in zip(n_q, seq_lens) for i in range(n)])


WINDOWED = [(1, 0.0), (6, 0.0), (9, 2.5), (0, 2.5), (100, 30.0)]


def windowed_batch(name: str | None, window: int, softcap: float):
    """(batch, options) of BATCHES[name] (None: a batch of draft trees), windowed and soft-capped."""
    if name is not None:
        return make_batch(*BATCHES[name], page_size=5, seed=5), dict(window=window, softcap=softcap)
    n_q, seq_lens = [7, 1, 5, 0, 3], [30, 9, 5, 4, 13]
    return make_batch(n_q, seq_lens, page_size=5, seed=6), dict(
        tree_mask=tree_masks(n_q), window=window, softcap=softcap, positions=tree_positions(n_q, seq_lens))


# The kernel and the row-invariant paths are checked apart: the kernel (through the interpreter,
# most of the cost) once, not again for each row-invariant path.
@pytest.mark.parametrize("window,softcap", WINDOWED)
@pytest.mark.parametrize("name", [*BATCHES, None], ids=[*BATCHES, "trees"])
def test_windowed_soft_capped_attention_kernel_matches_the_reference(name, window, softcap):
    batch, opts = windowed_batch(name, window, softcap)
    ref = paged_attention_ref(*batch, 0.3, **opts)
    torch.testing.assert_close(paged_attention(*batch, 0.3, impl="triton", **opts), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window,softcap", WINDOWED)
@pytest.mark.parametrize("name", [*BATCHES, None], ids=[*BATCHES, "trees"])
def test_windowed_soft_capped_row_invariant_path_matches_the_reference(name, window, softcap, rowwise_path):
    batch, opts = windowed_batch(name, window, softcap)
    ref = paged_attention_ref(*batch, 0.3, **opts)
    torch.testing.assert_close(paged_attention_rowwise(*batch, 0.3, **opts), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ["ref", "triton", "rowwise"])
def test_a_windowed_tree_query_sees_the_last_window_positions_of_its_path_soft_capped(impl, rowwise_path):
    """Query 6 (path 0 -> 2 -> 4 -> 6, depth 4) of a request with 12 context tokens sits at
    position 15: with a window of 6 it sees context positions 10, 11 and its path, computed
    by hand with soft-capping."""
    n_q, seq_lens, page_size, window, cap = [7], [19], 4, 6, 1.5
    q, k_cache, v_cache, tables, cu, lens = make_batch(n_q, seq_lens, page_size, seed=7)
    opts = dict(tree_mask=tree_masks(n_q), window=window, softcap=cap, positions=tree_positions(n_q, seq_lens))
    fn = paged_attention_rowwise if impl == "rowwise" else paged_attention
    out = fn(q, k_cache, v_cache, tables, cu, lens, 0.3, **({} if impl == "rowwise" else {"impl": impl}), **opts)
    seen = [10, 11] + [12 + 0, 12 + 2, 12 + 4, 12 + 6]
    slots = [int(tables[0, t // page_size]) * page_size + t % page_size for t in seen]
    keys = k_cache.reshape(-1, KV_HEADS, HEAD_DIM)[slots].repeat_interleave(3, dim=1)  # [S, Hq, D]
    values = v_cache.reshape(-1, KV_HEADS, HEAD_DIM)[slots].repeat_interleave(3, dim=1)
    scores = torch.einsum("hd,shd->hs", q[6], keys) * 0.3
    weights = torch.softmax(torch.tanh(scores / cap) * cap, dim=1)
    torch.testing.assert_close(out[6], torch.einsum("hs,shd->hd", weights, values), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(cpu_kernels() is None, reason="eagle_serve/kernels/cpu.cpp needs AVX2, FMA and a compiler")
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2), (10, 2), (16, 2)],
                         ids=["no-gqa", "group-4", "group-5", "group-8"])
def test_the_cpp_attention_of_any_gqa_group_matches_the_reference_and_is_row_invariant(q_heads, kv_heads):
    """cpu.cpp attends up to four q heads of a kv head together: groups of 1, 4, 5 (4 + 1) and
    8 (4 + 4) give the reference's results, and a query alone its bits within a verify pass."""
    gen = torch.Generator().manual_seed(3)
    page_size, seq_lens = 16, [37, 29]
    k_cache, v_cache = (torch.randn(8, page_size, kv_heads, 64, generator=gen) for _ in range(2))
    tables = torch.tensor([[0, 1, 2], [3, 4, -1]])
    cu, lens = torch.tensor([0, 1, 6]), torch.tensor(seq_lens)
    q = torch.randn(6, q_heads, 64, generator=gen)
    out = paged_attention_rowwise(q, k_cache, v_cache, tables, cu, lens, 0.125)
    torch.testing.assert_close(out, paged_attention_ref(q, k_cache, v_cache, tables, cu, lens, 0.125),
                               atol=2e-5, rtol=2e-5)
    alone = paged_attention_rowwise(q[3:4], k_cache, v_cache, tables[1:], torch.tensor([0, 1]),
                                    torch.tensor([29 - 5 + 3]), 0.125)
    assert torch.equal(alone[0], out[3])
