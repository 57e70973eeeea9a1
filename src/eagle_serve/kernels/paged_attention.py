"""Paged KV cache: write new keys/values into their slots (the reference: on a GPU the write is
fused with RoPE, eagle_serve.kernels.layer_ops), and attend over a ragged batch.

Layout: one cache tensor per layer for keys and one for values, [num_pages, page_size,
kv_heads, head_dim]. A request's block table lists its pages in order; token position t lives
in slot block_table[t // page_size] * page_size + t % page_size. Slot -1 means "do not write"
(padding). Queries of request b are its last n_b positions (seq_len_b - n_b .. seq_len_b - 1),
causal among themselves: one query for decode, k + 1 for verification, the prompt for prefill.

Draft trees: with tree_mask [B, Qt, Qt] bool (Qt >= every n_b), query i of request b sees its
new token j (key position seq_len_b - n_b + j) only where tree_mask[b, i, j] is True (set it
for i's ancestors and i itself); the context before the new tokens stays visible, and the mask
refines the causal one (entries j > i are ignored). A lower-triangular mask is the default.

Sliding windows (window > 0): a query sees only keys less than `window` positions behind it,
positions counted along the sequence (`positions`, the RoPE positions of the new tokens; the
context before them sits at its own index), so a draft-tree node's window is that of its path.
Soft-capping (softcap > 0): scores become softcap * tanh(scores / softcap) before the softmax
(Gemma 2). Both are off by default.

The kernel is flash-attention over the pages: one program per (request, block of queries,
kv head) holds the queries of every q head that shares the kv head (GQA) as rows, and walks
the keys a block at a time, finding each key's slot through the block table (any page size).
On CPU, bf16/fp16 (and fp32 where eagle_serve/kernels/cpu.cpp runs) take kernels.rowwise_attention's
row-invariant path; float64 takes the reference (kernels.attention_ref).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagle_serve.kernels import on, use_kernel
from eagle_serve.kernels.attention_ref import paged_attention_ref
from eagle_serve.kernels.cpu import rope_write_kv_fits
from eagle_serve.kernels.rowwise_attention import cpu_attend_fits, paged_attention_rowwise


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v: [T, kv_heads, head_dim]; caches: [num_pages, page_size, kv_heads, head_dim];
    slot_mapping: [T] int64 (-1 = skip)."""
    assert k.shape == v.shape and k.shape[0] == slot_mapping.shape[0]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    valid = slot_mapping >= 0
    if bool(valid.all()):
        flat_k.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        flat_v.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    else:
        flat_k.index_copy_(0, slot_mapping[valid], k[valid].to(k_cache.dtype))
        flat_v.index_copy_(0, slot_mapping[valid], v[valid].to(v_cache.dtype))


def cpu_rope_write_kv_runs(q: torch.Tensor, k_cache: torch.Tensor, cos: torch.Tensor,
                           impl: str | None = None) -> bool:
    """Whether a step's RoPE and KV write run as eagle_serve/kernels/cpu.cpp's one call (fp32 on CPU, the
    kernels built) rather than PyTorch's RoPE and write_kv_ref: not where the GPU path's kernels
    run, nor where the reference is asked for (impl as in eagle_serve/kernels/__init__.py)."""
    return impl is None and not use_kernel(impl, k_cache) and rope_write_kv_fits(q, k_cache, cos)


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                    impl: str | None = None, tree_mask=None, window: int = 0, softcap: float = 0.0,
                    positions=None, max_q: int | None = None, plans: dict | None = None):
    """Dispatch on q's device (impl as in eagle_serve/kernels/__init__.py); CPU tensors in bf16/fp16, and in
    fp32 where eagle_serve/kernels/cpu.cpp runs them, take the row-invariant path (their linears are
    row-invariant too: see eagle_serve.cpu.matmul); float64 (the exactness tests) the reference.
    max_q: the most new tokens of a request, if the caller knows it (else the kernel's launcher
    reads it from cu_seqlens_q: a host sync on a GPU); plans: as paged_attention_rowwise's."""
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, tree_mask, window,
            softcap, positions)
    if use_kernel(impl, q):
        return paged_attention_triton(*args, max_q=max_q)
    if impl is None and (q.dtype in (torch.bfloat16, torch.float16)
                         or q.dtype == torch.float32 and cpu_attend_fits(k_cache)):
        return paged_attention_rowwise(*args, plans=plans)
    return paged_attention_ref(*args)


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           tree_mask: torch.Tensor | None = None, window: int = 0,
                           softcap: float = 0.0, positions: torch.Tensor | None = None,
                           max_q: int | None = None) -> torch.Tensor:
    """As paged_attention_ref; max_q as in paged_attention."""
    assert q.ndim == 3 and k_cache.ndim == 4 and k_cache.shape == v_cache.shape
    tokens, q_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    assert k_cache.shape[3] == head_dim and q_heads % kv_heads == 0
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert block_tables.ndim == 2 and cu_seqlens_q.shape == (block_tables.shape[0] + 1,)
    assert seq_lens.shape == block_tables.shape[:1]
    num_req, group, device = block_tables.shape[0], q_heads // kv_heads, q.device
    q = q.contiguous()
    out = torch.empty_like(q)
    cu = on(cu_seqlens_q, device, torch.int64)
    lens = on(seq_lens, device, torch.int64)
    if max_q is None:
        max_q = int((cu[1:] - cu[:-1]).max()) if num_req else 0
    if tokens == 0 or max_q == 0:
        return out
    if tree_mask is not None:
        assert tree_mask.ndim == 3 and tree_mask.shape[0] == num_req
        assert tree_mask.shape[1] == tree_mask.shape[2] >= max_q
        tree_mask = on(tree_mask, device, torch.int8)
    block_m, block_q = attention_tile(group, max_q)
    tables = on(block_tables, device, torch.int64)
    tree = tree_mask if tree_mask is not None else tables  # any tensor; unused without a tree
    if window > 0 and positions is None:  # the stored positions
        n_q = cu[1:] - cu[:-1]
        positions = torch.repeat_interleave(lens - n_q, n_q, output_size=tokens) + \
            torch.arange(tokens, device=device) - torch.repeat_interleave(cu[:-1], n_q, output_size=tokens)
    pos = on(positions, device, torch.int64) if window > 0 else tables  # unused without
    _paged_attention_kernel[(num_req, triton.cdiv(max_q, block_q), kv_heads)](
        q, k_cache, v_cache, tables, cu, lens, tree, pos, out, scale, max(int(window), 0),
        float(softcap),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        tree.stride(0), tree.stride(1),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=64,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), HEAD_DIM=head_dim,
        PAGE_SIZE=page_size, HAS_TREE=tree_mask is not None, HAS_WINDOW=window > 0,
        HAS_SOFTCAP=softcap > 0, PRECISION=attention_precision(q.dtype))
    return out


# Launch parameters (eagle_serve/kernels/warmup.py enumerates what these functions can return).

def attention_tile(group: int, max_q: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q) of _paged_attention_kernel: a tile holds BLOCK_Q queries of each of the
    `group` q heads sharing a kv head; max_q: the most new tokens of a request in the batch."""
    block_m = max(16, min(64, triton.next_power_of_2(group * max_q)), triton.next_power_of_2(group))
    return block_m, block_m // group


def attention_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


# ----------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["stride_table", "stride_tree_b", "stride_tree_i"])
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, cu_q_ptr, seq_lens_ptr, tree_ptr, pos_ptr,
        out_ptr, scale, window, softcap, stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
        stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_tree_b,
        stride_tree_i, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr, HAS_TREE: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    # q, out: [T, Hq, D]; caches: [P, PAGE_SIZE, Hkv, D]; tables: [B, Pmax]; cu_q: [B+1];
    # seq_lens: [B]; tree: [B, Qt, Qt] int8 (HAS_TREE); pos: [T] int64 positions of the new
    # tokens (HAS_WINDOW). Grid: (B, cdiv(max_q, BLOCK_Q), Hkv)
    # Row m of the tile is query BLOCK_Q * pid(1) + m // GROUP of q head Hkv-group member m % GROUP.
    req = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + req)
    n_q = tl.load(cu_q_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    new_start = seq_len - n_q  # key position of the first new token

    m = tl.arange(0, BLOCK_M)
    qi = q_block * BLOCK_Q + m // GROUP  # [BLOCK_M] query index within the request
    row_ok = (m < BLOCK_Q * GROUP) & (qi < n_q)
    head = kv_head * GROUP + m % GROUP
    d = tl.arange(0, BLOCK_D)
    q_rows = (q_start + qi).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_rows + d[None, :], mask=row_ok[:, None] & (d < HEAD_DIM)[None, :],
                other=0.0)
    q_pos = new_start + qi
    if HAS_WINDOW:
        q_wpos = tl.load(pos_ptr + q_start + qi, mask=row_ok, other=0)  # along the sequence
    # Keys past the block's last query are never visible; an empty block walks none.
    kv_end = tl.minimum(seq_len, new_start + tl.minimum(n_q, (q_block + 1) * BLOCK_Q))
    kv_end = tl.where(q_block * BLOCK_Q < n_q, kv_end, 0)

    row_max = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: fully masked rows stay NaN-free
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, kv_end, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        t_ok = t < kv_end
        page = tl.load(tables_ptr + req * stride_table + t // PAGE_SIZE, mask=t_ok, other=0)
        kd_ok = t_ok[None, :] & (d < HEAD_DIM)[:, None]
        k_off = page * stride_kp + (t % PAGE_SIZE) * stride_ks + kv_head * stride_kh  # [BLOCK_N]
        k = tl.load(k_cache_ptr + k_off[None, :] + d[:, None], mask=kd_ok, other=0.0)  # [D, N]
        scores = tl.dot(q, k.to(q.dtype), input_precision=PRECISION) * scale  # [M, N]
        if HAS_SOFTCAP:  # softcap * tanh(scores / softcap), tanh(x) = 2 sigmoid(2x) - 1
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        visible = row_ok[:, None] & t_ok[None, :] & (t[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            jn = t - new_start
            k_wpos = tl.load(pos_ptr + q_start + jn, mask=t_ok & (jn >= 0), other=0)
            k_wpos = tl.where(jn >= 0, k_wpos, t)
            visible = visible & ((q_wpos[:, None] - k_wpos[None, :]) < window)
        if HAS_TREE:
            j = t - new_start  # index among the new tokens, < 0 for context
            tree_row = tree_ptr + req * stride_tree_b + qi[:, None] * stride_tree_i
            tree = tl.load(tree_row + j[None, :], mask=visible & (j >= 0)[None, :], other=0)
            visible = visible & ((j < 0)[None, :] | (tree != 0))
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        alpha = tl.exp(row_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        row_sum = row_sum * alpha + tl.sum(p, 1)
        v_off = page * stride_vp + (t % PAGE_SIZE) * stride_vs + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :],
                    mask=t_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        row_max = new_max
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    o_rows = (q_start + qi).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(out_ptr + o_rows + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (d < HEAD_DIM)[None, :])
