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
"""
from __future__ import annotations

import torch

from kernels.sampling import ACCEPT, RESIDUAL, SAMPLE, keyed_uniform


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


def _race(p: torch.Tensor, seed: int, position: int, purpose: int) -> int:
    u = keyed_uniform(seed, position, purpose, p.shape[0], device=p.device)
    return int(torch.argmax(p / -torch.log(u)))


def greedy_accept(draft_ids, cu_num_drafts, target_argmax, impl: str | None = None):
    return greedy_accept_ref(draft_ids, cu_num_drafts, target_argmax)


def random_accept(draft_ids, cu_num_drafts, target_probs, draft_probs, seeds, positions,
                  impl: str | None = None):
    return random_accept_ref(draft_ids, cu_num_drafts, target_probs, draft_probs, seeds, positions)
