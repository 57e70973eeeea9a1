"""Rejection sampling over a ragged batch of drafts: which draft tokens the target accepts.

Vocabulary (as in vLLM's rejection sampler):
- draft tokens: the k_b tokens the drafter proposed for request b;
- accepted tokens: the longest prefix of them the target keeps;
- recovered token: what replaces the first rejected draft (greedy: the target's argmax there;
  random: a sample from the residual normalize(max(0, p - q)));
- bonus token: sampled from the target after all k_b drafts were accepted.
Each request therefore emits accepted + 1 tokens (1 .. k_b + 1).

Both rules keep the output exactly the target's: greedy output equals plain greedy decoding,
and sampled output follows the target distribution (Leviathan et al. 2023, Chen et al. 2023).

Kernels: recovered and bonus tokens are raced for every target row at once (one exponential
race over the residual, falling back to p where the residual is empty; bonus rows have no
draft, so their residual is p itself), then one pass per tile of requests walks the drafts and
picks the accepted prefix. Random acceptance draws Philox noise keyed by the same keys as the
reference (see eagle_serve/kernels/sampling.py), so it agrees with the reference in distribution, and
exactly wherever the outcome is forced (p/q of 0 or >= 1, one-hot residuals). Greedy
acceptance is exact.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagle_serve.kernels import on, use_kernel
from eagle_serve.kernels.sampling import (
    ACCEPT,
    RESIDUAL,
    SAMPLE,
    _race_block,
    _uniform,
    key_seed,
    keyed_uniform,
    sample_ref,
    vocab_row_tile,
)


def greedy_accept_ref(draft_ids: torch.Tensor, cu_num_drafts: torch.Tensor,
                      target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafts while they equal the target's argmax; then the argmax there (recovered or
    bonus).

    draft_ids: [N]; cu_num_drafts: [B+1]; target_argmax: [N+B] (request b owns rows
    cu[b]+b .. cu[b+1]+b: one per draft plus the bonus row)
    -> out [B, max_k+1] (-1 padded), num_emitted [B]
    """
    assert draft_ids.ndim == 1 and cu_num_drafts.ndim == 1
    assert target_argmax.shape[0] == draft_ids.shape[0] + cu_num_drafts.shape[0] - 1
    cu = cu_num_drafts.tolist()
    num_req = len(cu) - 1
    max_k = max((cu[b + 1] - cu[b] for b in range(num_req)), default=0)
    out = torch.full((num_req, max_k + 1), -1, dtype=torch.int64)
    num = torch.zeros(num_req, dtype=torch.int64)
    drafts, argmax = draft_ids.tolist(), target_argmax.tolist()
    for b in range(num_req):
        k = cu[b + 1] - cu[b]
        rows = argmax[cu[b] + b: cu[b + 1] + b + 1]
        n = 0
        while n < k and drafts[cu[b] + n] == rows[n]:
            n += 1
        out[b, :n + 1] = torch.tensor(rows[:n + 1])
        num[b] = n + 1
    return out, num


def greedy_tree_accept(draft_ids: torch.Tensor, parents: torch.Tensor, cu_num_drafts: torch.Tensor,
                       target_argmax: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance over draft trees: from the root, step to the child whose token equals
    the target's argmax at the current node, while there is one; then the argmax there.

    draft_ids: [N]; parents: [N] (index of the parent within its request's nodes, -1 = the
    root; parents before children); cu_num_drafts: [B+1]; target_argmax: [N+B] (request b owns
    rows cu[b]+b .. cu[b+1]+b: the root's, then one per node)
    -> out [B, max_k+1] (-1 padded), num_emitted [B], path [B, max_k] (accepted node indices
    in path order, -1 padded). A chain (parents -1, 0, 1, ...) gives greedy_accept's answer.
    """
    assert draft_ids.shape == parents.shape and draft_ids.ndim == 1
    assert target_argmax.shape[0] == draft_ids.shape[0] + cu_num_drafts.shape[0] - 1
    cu = cu_num_drafts.tolist()
    num_req = len(cu) - 1
    max_k = max((cu[b + 1] - cu[b] for b in range(num_req)), default=0)
    out = torch.full((num_req, max_k + 1), -1, dtype=torch.int64)
    path = torch.full((num_req, max_k), -1, dtype=torch.int64)
    num = torch.zeros(num_req, dtype=torch.int64)
    walks = greedy_tree_walk(draft_ids.tolist(), parents.tolist(), cu, target_argmax.tolist())
    for b, (emitted, accepted) in enumerate(walks):
        out[b, :len(emitted)] = torch.tensor(emitted)
        path[b, :len(accepted)] = torch.tensor(accepted, dtype=torch.int64)
        num[b] = len(emitted)
    return out, num, path


def greedy_tree_walk(drafts: list[int], parents: list[int], cu: list[int],
                     argmax: list[int]) -> list[tuple[list[int], list[int]]]:
    """greedy_tree_accept on host lists (the same layout) -> per request (emitted tokens,
    accepted node indices in path order)."""
    walks = []
    for b in range(len(cu) - 1):
        nodes = range(cu[b], cu[b + 1])
        rows = argmax[cu[b] + b: cu[b + 1] + b + 1]  # rows[0]: root, rows[1 + i]: node i
        emitted, accepted, current = [], [], -1
        while True:
            emitted.append(rows[current + 1])
            child = next((n - cu[b] for n in nodes
                          if parents[n] == current and drafts[n] == emitted[-1]), None)
            if child is None:
                break
            accepted.append(child)
            current = child
        walks.append((emitted, accepted))
    return walks


def random_accept_ref(draft_ids: torch.Tensor, cu_num_drafts: torch.Tensor,
                      target_probs: torch.Tensor, draft_probs: torch.Tensor,
                      seeds: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """q >= p: accept with probability p/q; else always accept. On rejection, resample from
    normalize(max(0, p - q)); after k accepts, sample the bonus from p.

    draft_ids: [N]; cu_num_drafts: [B+1]; target_probs: [N+B, V] (rows as in greedy_accept_ref);
    draft_probs: [N, V]; seeds: B ints; positions: B ints (position of each request's first
    draft) -> out [B, max_k+1] (-1 padded), num_emitted [B]
    """
    assert target_probs.shape[0] == draft_ids.shape[0] + cu_num_drafts.shape[0] - 1
    assert draft_probs.shape == (draft_ids.shape[0], target_probs.shape[1])
    cu = cu_num_drafts.tolist()
    num_req = len(cu) - 1
    max_k = max((cu[b + 1] - cu[b] for b in range(num_req)), default=0)
    out = torch.full((num_req, max_k + 1), -1, dtype=torch.int64)
    num = torch.zeros(num_req, dtype=torch.int64)
    for b in range(num_req):
        k, seed, pos = cu[b + 1] - cu[b], seeds[b], positions[b]
        emitted = []
        for j in range(k + 1):
            p = target_probs[cu[b] + b + j].double()
            if j == k:  # bonus
                emitted.append(_race(p, seed, pos + j, SAMPLE))
                break
            x = int(draft_ids[cu[b] + j])
            q = draft_probs[cu[b] + j].double()
            u = keyed_uniform(seed, pos + j, ACCEPT, 1)[0].item()
            if q[x] > 0 and u * q[x] <= p[x]:  # u < p/q without dividing
                emitted.append(x)
                continue
            residual = (p - q).clamp(min=0)
            if float(residual.sum()) <= 0:  # p == q: rejection has probability 0; be safe
                residual = p
            emitted.append(_race(residual / residual.sum(), seed, pos + j, RESIDUAL))
            break
        out[b, :len(emitted)] = torch.tensor(emitted)
        num[b] = len(emitted)
    return out, num


def random_tree_accept_ref(draft_ids: torch.Tensor, parents: torch.Tensor,
                          cu_num_drafts: torch.Tensor, target_probs: torch.Tensor,
                          draft_probs: torch.Tensor, seeds: list[int], positions: list[int]
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling down draft trees (SpecInfer; Chen et al. 2023, multi-draft):
    at a node, its children are tried in index order, child i (token x, drawn from its own
    q_i, independently of the target's noise) accepted with probability min(1, r(x) / q_i(x)),
    where r starts as the target's p at the node and becomes normalize(max(0, r - q_i)) after
    each rejection; the first accepted child becomes the node, and where every child is
    rejected the token is sampled from the last r (p itself at a leaf). Each try is one
    ordinary speculative-sampling step for r, so the emitted token follows p exactly; a child
    proposed deterministically (a lookup) has a one-hot q. Children hold distinct tokens (a
    token tried and rejected has r = 0 from then on anyway).

    Arguments as in greedy_tree_accept, plus draft_probs [N, V] (node i's q) and the seeds and
    positions of random_accept_ref. Keys: a node at depth d draws its tries' uniforms from
    (seed, position + d, ACCEPT) and its residual from (seed, position + d, RESIDUAL) (SAMPLE
    at a leaf), so a chain gets random_accept_ref's answer.
    -> out [B, max_k+1] (-1 padded), num_emitted [B], path [B, max_k] (-1 padded)
    """
    assert draft_ids.shape == parents.shape and draft_ids.ndim == 1
    assert target_probs.shape[0] == draft_ids.shape[0] + cu_num_drafts.shape[0] - 1
    assert draft_probs.shape == (draft_ids.shape[0], target_probs.shape[1])
    cu = cu_num_drafts.tolist()
    num_req = len(cu) - 1
    max_k = max((cu[b + 1] - cu[b] for b in range(num_req)), default=0)
    out = torch.full((num_req, max_k + 1), -1, dtype=torch.int64)
    path = torch.full((num_req, max_k), -1, dtype=torch.int64)
    num = torch.zeros(num_req, dtype=torch.int64)
    drafts, parent = draft_ids.tolist(), parents.tolist()
    for b in range(num_req):
        seed, pos = seeds[b], positions[b]
        children: dict[int, list[int]] = {}
        for n in range(cu[b], cu[b + 1]):
            children.setdefault(parent[n], []).append(n)
        emitted, accepted, node = [], [], -1
        while True:
            depth = len(accepted)
            r = target_probs[cu[b] + b + node + 1].double()  # row of the node (root: its first)
            kids = children.get(node, [])
            u = keyed_uniform(seed, pos + depth, ACCEPT, max(1, len(kids)))
            child = None
            for i, n in enumerate(kids):
                x, q = drafts[n], draft_probs[n].double()
                if q[x] > 0 and u[i] * q[x] <= r[x]:  # u < r/q without dividing
                    child = n
                    break
                residual = (r - q).clamp(min=0)
                r = residual / residual.sum() if float(residual.sum()) > 0 else r  # r == q: be safe
            if child is None:
                emitted.append(_race(r, seed, pos + depth, RESIDUAL if kids else SAMPLE))
                break
            emitted.append(drafts[child])
            accepted.append(child - cu[b])
            node = child - cu[b]
        out[b, :len(emitted)] = torch.tensor(emitted)
        path[b, :len(accepted)] = torch.tensor(accepted, dtype=torch.int64)
        num[b] = len(emitted)
    return out, num, path


def _race(p: torch.Tensor, seed: int, position: int, purpose: int) -> int:
    return int(sample_ref(p.unsqueeze(0), [seed], [position], purpose)[0])


def greedy_accept(draft_ids, cu_num_drafts, target_argmax, impl: str | None = None):
    """Dispatch on target_argmax's device (impl as in eagle_serve/kernels/__init__.py)."""
    if use_kernel(impl, target_argmax):
        return greedy_accept_triton(draft_ids, cu_num_drafts, target_argmax)
    return greedy_accept_ref(draft_ids, cu_num_drafts, target_argmax)


def random_accept(draft_ids, cu_num_drafts, target_probs, draft_probs, seeds, positions,
                  impl: str | None = None):
    """Dispatch on target_probs's device (impl as in eagle_serve/kernels/__init__.py)."""
    if use_kernel(impl, target_probs):
        return random_accept_triton(draft_ids, cu_num_drafts, target_probs, draft_probs, seeds,
                                    positions)
    return random_accept_ref(draft_ids, cu_num_drafts, target_probs, draft_probs, seeds, positions)


def _ragged_args(draft_ids, cu_num_drafts, device):
    """-> draft_ids [N] int64, cu [B+1] int64 on `device`, cu as a list, max_k."""
    assert draft_ids.ndim == 1 and cu_num_drafts.ndim == 1 and cu_num_drafts.shape[0] >= 1
    assert not draft_ids.is_floating_point() and not cu_num_drafts.is_floating_point()
    cu = cu_num_drafts.tolist()
    assert cu[0] == 0 and cu[-1] == draft_ids.shape[0], "cu_num_drafts: [B+1] from 0 to N"
    max_k = max((b - a for a, b in zip(cu, cu[1:])), default=0)
    return on(draft_ids, device, torch.int64), on(cu_num_drafts, device, torch.int64), cu, max_k


def greedy_accept_triton(draft_ids: torch.Tensor, cu_num_drafts: torch.Tensor,
                         target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As greedy_accept_ref, on target_argmax's device."""
    assert target_argmax.ndim == 1 and not target_argmax.is_floating_point()
    assert target_argmax.shape[0] == draft_ids.shape[0] + cu_num_drafts.shape[0] - 1
    device = target_argmax.device
    drafts, cu_dev, cu, max_k = _ragged_args(draft_ids, cu_num_drafts, device)
    num_req = len(cu) - 1
    out = torch.full((num_req, max_k + 1), -1, dtype=torch.int64, device=device)
    num = torch.zeros(num_req, dtype=torch.int64, device=device)
    if num_req:
        block_b = request_block(num_req)
        _greedy_accept_kernel[(triton.cdiv(num_req, block_b),)](
            drafts, cu_dev, target_argmax.to(torch.int64).contiguous(), out, num, num_req, max_k,
            out.stride(0), BLOCK_B=block_b)
    return out, num


def random_accept_triton(draft_ids: torch.Tensor, cu_num_drafts: torch.Tensor,
                         target_probs: torch.Tensor, draft_probs: torch.Tensor,
                         seeds: list[int], positions: list[int],
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """As random_accept_ref (in distribution), on target_probs's device."""
    assert target_probs.ndim == 2
    assert target_probs.shape[0] == draft_ids.shape[0] + cu_num_drafts.shape[0] - 1
    assert draft_probs.shape == (draft_ids.shape[0], target_probs.shape[1])
    assert len(seeds) == len(positions) == cu_num_drafts.shape[0] - 1
    target_probs = target_probs if target_probs.stride(1) == 1 else target_probs.contiguous()
    device, vocab = target_probs.device, target_probs.shape[1]
    drafts, cu_dev, cu, max_k = _ragged_args(draft_ids, cu_num_drafts, device)
    num_req = len(cu) - 1
    out = torch.full((num_req, max_k + 1), -1, dtype=torch.int64, device=device)
    num = torch.zeros(num_req, dtype=torch.int64, device=device)
    if num_req == 0:
        return out, num
    draft_probs = on(draft_probs, device, draft_probs.dtype)
    # Per target row: the draft row it is compared with (-1: bonus) and the key of its race.
    q_row, race_keys, accept_keys = [], [], []
    for b in range(num_req):
        k, seed, pos = cu[b + 1] - cu[b], seeds[b], positions[b]
        q_row += list(range(cu[b], cu[b + 1])) + [-1]
        race_keys += [key_seed(seed, pos + j, RESIDUAL) for j in range(k)]
        race_keys.append(key_seed(seed, pos + k, SAMPLE))
        accept_keys += [key_seed(seed, pos + j, ACCEPT) for j in range(k)]
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    rows = target_probs.shape[0]
    recovered = torch.empty(rows, dtype=torch.int64, device=device)
    block_r, block_v = vocab_row_tile(rows, vocab)
    _recover_kernel[(triton.cdiv(rows, block_r),)](
        target_probs, draft_probs, as_tensor(q_row), as_tensor(race_keys), recovered, rows, vocab,
        target_probs.stride(0), draft_probs.stride(0), BLOCK_R=block_r, BLOCK_V=block_v)
    block_b = request_block(num_req)
    _random_accept_kernel[(triton.cdiv(num_req, block_b),)](
        drafts, cu_dev, target_probs, draft_probs, as_tensor(accept_keys), recovered, out, num,
        num_req, max_k, vocab, target_probs.stride(0), draft_probs.stride(0), out.stride(0),
        BLOCK_B=block_b)
    return out, num


def request_block(num_req: int) -> int:
    """BLOCK_B of the acceptance kernels: one lane per request (eagle_serve/kernels/warmup.py)."""
    return min(triton.next_power_of_2(num_req), 128)


# ----------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["B", "max_k", "stride_out"])
def _greedy_accept_kernel(drafts_ptr, cu_ptr, argmax_ptr, out_ptr, num_ptr, B, max_k, stride_out,
                          BLOCK_B: tl.constexpr):
    # drafts: [N]; cu: [B+1]; argmax: [N+B]; out: [B, max_k+1] (-1 filled); num: [B].
    # Grid: (cdiv(B, BLOCK_B),); one lane per request, walking its drafts.
    reqs = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    req_ok = reqs < B
    start = tl.load(cu_ptr + reqs, mask=req_ok, other=0)
    k = tl.load(cu_ptr + reqs + 1, mask=req_ok, other=0) - start
    row0 = start + reqs  # this request's first target row
    out_row = out_ptr + reqs.to(tl.int64) * stride_out
    live = req_ok  # no draft rejected yet
    for j in range(0, max_k):
        active = live & (j < k)
        target = tl.load(argmax_ptr + row0 + j, mask=active, other=-1)
        draft = tl.load(drafts_ptr + start + j, mask=active, other=-1)
        tl.store(out_row + j, target, mask=active)
        rejected = active & (draft != target)
        tl.store(num_ptr + reqs, j + 1 + tl.zeros_like(reqs), mask=rejected)
        live = live & ~rejected
    bonus = tl.load(argmax_ptr + row0 + k, mask=live, other=-1)
    tl.store(out_row + k, bonus, mask=live)
    tl.store(num_ptr + reqs, k + 1, mask=live)


@triton.jit(do_not_specialize=["R"])
def _recover_kernel(p_ptr, q_ptr, q_row_ptr, keys_ptr, out_ptr, R, V, stride_p, stride_q,
                    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    # p: [R, V] target; q: [N, V] draft; q_row: [R] (-1 = bonus row, no draft); keys: [R] int64;
    # out: [R] int64. Grid: (cdiv(R, BLOCK_R),)
    # Per row: race over max(p - q, 0); if that is all zero, the same race over p.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    key = tl.load(keys_ptr + rows, mask=row_ok, other=0)[:, None]
    q_row = tl.load(q_row_ptr + rows, mask=row_ok, other=-1)
    has_q = (row_ok & (q_row >= 0))[:, None]
    p_base = p_ptr + rows.to(tl.int64)[:, None] * stride_p
    q_base = q_ptr + tl.maximum(q_row, 0).to(tl.int64)[:, None] * stride_q
    best_r = tl.full([BLOCK_R], -2.0, tl.float32)
    idx_r = tl.zeros([BLOCK_R], tl.int64)
    best_p = tl.full([BLOCK_R], -2.0, tl.float32)
    idx_p = tl.zeros([BLOCK_R], tl.int64)
    for start in range(0, V, BLOCK_V):
        cols = (start + tl.arange(0, BLOCK_V))[None, :]
        mask = row_ok[:, None] & (cols < V)
        p = tl.load(p_base + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.load(q_base + cols, mask=mask & has_q, other=0.0).to(tl.float32)
        best_r, idx_r = _race_block(tl.maximum(p - q, 0.0), key, cols, start, mask, best_r, idx_r)
        best_p, idx_p = _race_block(p, key, cols, start, mask, best_p, idx_p)
    tl.store(out_ptr + rows, tl.where(best_r > 0, idx_r, idx_p), mask=row_ok)


@triton.jit(do_not_specialize=["B", "max_k", "stride_out"])
def _random_accept_kernel(drafts_ptr, cu_ptr, p_ptr, q_ptr, keys_ptr, recovered_ptr, out_ptr,
                          num_ptr, B, max_k, V, stride_p, stride_q, stride_out,
                          BLOCK_B: tl.constexpr):
    # drafts: [N]; cu: [B+1]; p: [N+B, V]; q: [N, V]; keys: [N] int64 (ACCEPT key per draft);
    # recovered: [N+B] (from _recover_kernel); out: [B, max_k+1] (-1 filled); num: [B].
    # Grid: (cdiv(B, BLOCK_B),); one lane per request.
    reqs = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    req_ok = reqs < B
    start = tl.load(cu_ptr + reqs, mask=req_ok, other=0)
    k = tl.load(cu_ptr + reqs + 1, mask=req_ok, other=0) - start
    row0 = start + reqs
    out_row = out_ptr + reqs.to(tl.int64) * stride_out
    live = req_ok
    for j in range(0, max_k):
        active = live & (j < k)
        draft = tl.load(drafts_ptr + start + j, mask=active, other=0)
        col = tl.minimum(tl.maximum(draft, 0), V - 1)  # in bounds whatever the draft id
        p_x = tl.load(p_ptr + (row0 + j).to(tl.int64) * stride_p + col, mask=active,
                      other=0.0).to(tl.float32)
        q_x = tl.load(q_ptr + (start + j).to(tl.int64) * stride_q + col, mask=active,
                      other=0.0).to(tl.float32)
        key = tl.load(keys_ptr + start + j, mask=active, other=0)
        u = _uniform(key, tl.zeros([BLOCK_B], tl.int32))
        accept = (q_x > 0) & (u * q_x <= p_x)  # u < p/q without dividing
        recovered = tl.load(recovered_ptr + row0 + j, mask=active, other=-1)
        tl.store(out_row + j, tl.where(accept, draft, recovered), mask=active)
        rejected = active & ~accept
        tl.store(num_ptr + reqs, j + 1 + tl.zeros_like(reqs), mask=rejected)
        live = live & ~rejected
    bonus = tl.load(recovered_ptr + row0 + k, mask=live, other=-1)
    tl.store(out_row + k, bonus, mask=live)
    tl.store(num_ptr + reqs, k + 1, mask=live)
