"""Verification: one target forward over every running request's new tokens and drafts, the
acceptance rule, and the bookkeeping after it.

Rows of a request: the tokens it has not computed (a prompt, or a recompute after preemption),
then its drafts. Draft node i is stored at position len(tokens) + i but rotated at
len(tokens) - 1 + depth_i, and sees only its ancestors (a chain sees every earlier draft).
Acceptance: greedy rows take the longest root path whose tokens equal the target's argmax, then
the target's own token (so greedy output is exactly plain greedy output); coupled sampled rows
do the same against the target's seeded sample at each row (so their output is exactly plain
seeded sampling's); other sampled rows run rejection sampling with the drafts' real
probabilities (recursive, over a tree whose lookup branches have one-hot probabilities; trees
run the reference sampler, a Python walk per request). The accepted path's KV entries belong
at contiguous positions: those moves go with the next forward (`kv_moves`), so the pages that
hold their sources stay until then.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from eagle_serve.interfaces import (RaggedBatch, RowSampling, TargetOutput, TokenBan, ancestor_mask,
                                    tree_depths)
from eagle_serve.kv_pages import PagePool
from eagle_serve.lookup import SOURCES
from eagle_serve.requests import Request
from eagle_serve.workspace import DraftWorkspace
from kernels.rejection import (greedy_accept, greedy_tree_accept, random_accept,
                               random_tree_accept_ref)
from kernels.sampling import SAMPLE, sample_ref


@dataclass
class EngineStats:
    steps: int = 0                    # batched rounds (one target forward each)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    drafts: int = 0                   # rounds (per request) that verified at least one draft
    preemptions: int = 0
    kv_moves: int = 0                 # target KV positions moved after accepting off a tree's
    #                                   first path
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    draft_tokens_by_source: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    accepted_tokens_by_source: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    queue_times: deque[float] = field(default_factory=lambda: deque(maxlen=4096))  # seconds
    #                                   from arrival to first admission, of the requests admitted
    #                                   since a reader (the metrics) last took them


@dataclass
class VerifyRows:
    """Where one request's rows sit in the verify batch."""
    req: Request
    first_row: int
    num_real: int     # tokens it had not computed, before its drafts
    num_logits: int   # rows scored: the last real token + every draft; 0 while recomputing


@dataclass
class VerifyBatch:
    batch: RaggedBatch
    logit_rows: torch.Tensor          # [R] rows of the batch the target scores
    sampling: RowSampling             # per scored row
    rows: list[VerifyRows]
    kv_moves: tuple[torch.Tensor, torch.Tensor] | None  # (src, dst) slots, applied first
    ban: TokenBan | None              # EOS masked on rows below their request's min_tokens


@dataclass
class Verdict:
    """What a request keeps of a round."""
    tokens: list[int]                 # emitted: accepted drafts + the target's token
    path: list[int]                   # accepted draft nodes, root first


@dataclass
class DraftWork:
    """A request the round advanced, and the target features of its newly verified positions
    ([n, F]: its real rows, then the accepted path's rows) for the drafter to catch up on."""
    req: Request
    features: torch.Tensor


def int_tensor(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def block_tables(tables: list[list[int]], device) -> torch.Tensor:
    width = max(1, max(len(t) for t in tables))
    return int_tensor([t + [-1] * (width - len(t)) for t in tables], device)


def row_sampling(rows: list[tuple], device) -> RowSampling:
    temp, top_k, top_p, seeds = zip(*rows) if rows else ((), (), (), ())
    return RowSampling(torch.tensor(temp, dtype=torch.float32, device=device),
                       int_tensor(top_k, device), torch.tensor(top_p, dtype=torch.float32, device=device),
                       int_tensor(seeds, device))


def build_verify_batch(reqs: list[Request], pool: PagePool, device,
                       eos_token_ids: tuple[int, ...] = ()) -> VerifyBatch:
    """A request that was preempted after emitting tokens recomputes all but its last token and
    scores nothing this round. A scored row predicts the token `depth` places past the last
    one (0 for the last real token, a draft's tree depth for a draft); EOS is banned on the
    rows whose prediction falls below the request's min_tokens."""
    ids, positions, cu, seq_lens, slots, logit_rows, sampling, rows = [], [], [0], [], [], [], [], []
    masks, src, dst, banned = [], [], [], []
    for req in reqs:
        start = req.num_computed
        resume = len(req.output) > 0 and start < len(req.tokens) - 1
        real = req.tokens[start:len(req.tokens) - 1 if resume else len(req.tokens)]
        new = real + req.drafts
        depths = tree_depths(req.parents)
        ids += new
        positions += range(start, start + len(real))
        positions += [len(req.tokens) - 1 + d for d in depths]
        slots += [pool.slot(req.target_pages, p) for p in range(start, start + len(new))]
        n_logits = 0 if resume else 1 + len(req.drafts)
        if n_logits and eos_token_ids:
            banned += [len(logit_rows) + j for j, d in enumerate([0] + depths) if req.eos_banned(d)]
        logit_rows += range(cu[-1] + len(new) - n_logits, cu[-1] + len(new))
        sampling += [req.sampling_row()] * n_logits
        rows.append(VerifyRows(req, cu[-1], len(real), n_logits))
        cu.append(cu[-1] + len(new))
        seq_lens.append(start + len(new))
        masks.append((len(real), req.parents))
        for a, b in req.kv_moves:
            src.append(pool.slot(req.target_pages, a))
            dst.append(pool.slot(req.target_pages, b))
        req.kv_moves = []
    tree_mask = None
    if any(req.is_tree for req in reqs):
        tree_mask = _stack_masks([_verify_mask(n, parents) for n, parents in masks]).to(device)
    t = lambda x: int_tensor(x, device)  # noqa: E731
    batch = RaggedBatch(t(ids), t(positions), t(cu), t(seq_lens),
                        block_tables([r.target_pages for r in reqs], device), t(slots),
                        tree_mask=tree_mask)
    moves = (t(src), t(dst)) if src else None
    ban = TokenBan(t(banned), t(list(eos_token_ids))) if banned else None
    return VerifyBatch(batch, t(logit_rows), row_sampling(sampling, device), rows, moves, ban)


def _verify_mask(num_real: int, parents: list[int]) -> torch.Tensor:
    """[n, n] bool over a request's rows: causal, but a draft sees only its ancestors."""
    n = num_real + len(parents)
    mask = torch.ones((n, n), dtype=torch.bool).tril()
    mask[num_real:, num_real:] = ancestor_mask(parents)
    return mask


def _stack_masks(masks: list[torch.Tensor]) -> torch.Tensor:
    """-> [B, W, W], each mask in the top-left corner"""
    width = max(m.shape[0] for m in masks)
    out = torch.zeros((len(masks), width, width), dtype=torch.bool)
    for b, m in enumerate(masks):
        out[b, :m.shape[0], :m.shape[0]] = m
    return out


def accept(result: TargetOutput, vb: VerifyBatch, workspace: DraftWorkspace, vocab_size: int,
           device) -> dict[str, Verdict]:
    """-> the verdict per request id (requests that scored nothing are absent)."""
    greedy, sampled = [], []
    row = prob_row = 0
    for r in vb.rows:
        if r.num_logits == 0:
            continue
        if r.req.greedy:
            greedy.append((r.req, result.argmax[row:row + r.num_logits]))
        elif r.req.coupled:  # the drafts are matched against the target's seeded samples
            probs = result.probs[prob_row:prob_row + r.num_logits]
            prob_row += r.num_logits
            greedy.append((r.req, coupled_samples(r.req, probs)))
        else:
            sampled.append((r.req, result.probs[prob_row:prob_row + r.num_logits]))
            prob_row += r.num_logits
        row += r.num_logits
    verdicts: dict[str, Verdict] = {}
    if greedy:
        reqs = [r for r, _ in greedy]
        drafts, cu = _flat_drafts(reqs, device)
        argmax = torch.cat([a for _, a in greedy])
        paths = None
        if any(r.is_tree for r in reqs):
            parents = int_tensor([p for r in reqs for p in r.parents], "cpu")
            out, num, path = greedy_tree_accept(drafts, parents, cu, argmax)
            paths = [path[i, :num[i] - 1].tolist() for i in range(len(reqs))]
        else:
            out, num = greedy_accept(drafts, cu, argmax)
        for i, req in enumerate(reqs):
            tokens = out[i, :num[i]].tolist()
            verdicts[req.id] = Verdict(tokens, paths[i] if paths else list(range(len(tokens) - 1)))
    if sampled:
        reqs = [r for r, _ in sampled]
        drafts, cu = _flat_drafts(reqs, device)
        q = (workspace.load([s for r in reqs for s in r.draft_slots]) if len(drafts)
             else torch.zeros((0, vocab_size), device=device))
        args = (torch.cat([p for _, p in sampled]), q, [r.seed for r in reqs],
                [len(r.tokens) for r in reqs])
        paths = None
        if any(r.is_tree for r in reqs):  # lookup branches beside the head's chain
            parents = int_tensor([p for r in reqs for p in r.parents], "cpu")
            out, num, path = random_tree_accept_ref(drafts, parents, cu, *args)
            paths = [path[i, :num[i] - 1].tolist() for i in range(len(reqs))]
        else:
            out, num = random_accept(drafts, cu, *args)
        for i, req in enumerate(reqs):
            tokens = out[i, :num[i]].tolist()
            verdicts[req.id] = Verdict(tokens, paths[i] if paths else list(range(len(tokens) - 1)))
    return verdicts


def coupled_samples(req: Request, probs: torch.Tensor) -> torch.Tensor:
    """A coupled request's scored rows [1 + n, V] -> the target's seeded sample at each [1 + n]:
    the token plain sampling draws at that row's position (key (seed, position, SAMPLE)), so
    the output is plain seeded sampling's whatever was drafted."""
    pos = len(req.tokens)
    positions = [pos + d for d in [0] + tree_depths(req.parents)]
    return sample_ref(probs, [req.seed] * len(positions), positions, SAMPLE)


def _flat_drafts(reqs: list[Request], device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> every request's drafts in one [N] tensor, and their offsets [B+1]"""
    cu = int_tensor([0] + list(itertools.accumulate(len(r.drafts) for r in reqs)), device)
    return int_tensor([d for r in reqs for d in r.drafts], device), cu


def advance(result: TargetOutput, vb: VerifyBatch, verdicts: dict[str, Verdict], pool: PagePool,
            workspace: DraftWorkspace, stats: EngineStats,
            eos_token_ids: tuple[int, ...]) -> list[DraftWork]:
    """Append accepted tokens, roll back KV and update the counters. -> drafter work of the
    speculative requests that go on."""
    work = []
    for r in vb.rows:
        req = r.req
        verdict = verdicts.get(req.id)
        path = verdict.path if verdict else []
        if verdict is not None:
            _count_round(req, path, stats)
            req.append(verdict.tokens, eos_token_ids)
        base = req.num_computed + r.num_real  # position of draft node 0
        req.num_computed = base + len(path)
        req.kv_moves = [(base + i, base + j) for j, i in enumerate(path) if i != j]
        stats.kv_moves += len(req.kv_moves)
        workspace.free(req.draft_slots)
        req.clear_drafts()
        keep = max([req.num_computed] + [a + 1 for a, _ in req.kv_moves])
        pool.shrink(req.target_pages, keep)
        if req.k and not req.finish_reason:
            rows = list(range(r.first_row, r.first_row + r.num_real))
            rows += [r.first_row + r.num_real + i for i in path]
            work.append(DraftWork(req, result.hidden[int_tensor(rows, result.hidden.device)]))
    return work


def _count_round(req: Request, path: list[int], stats: EngineStats) -> None:
    """path = the accepted draft nodes; per-position counters count by depth, per-source
    counters by the source that proposed each node."""
    accepted = len(path)
    for source in req.draft_sources:
        stats.draft_tokens_by_source[source] += 1
    for node in path:
        stats.accepted_tokens_by_source[req.draft_sources[node]] += 1
    offered = max(tree_depths(req.parents), default=0)  # deepest draft (a chain: k)
    if offered:
        req.acceptance.observe(offered, accepted)
    else:
        req.acceptance.idle_rounds += 1
    req.num_rounds += 1
    req.num_draft_tokens += len(req.drafts)
    req.num_accepted_tokens += accepted
    stats.rounds += 1
    stats.drafts += int(bool(req.drafts))
    stats.draft_tokens += len(req.drafts)
    stats.accepted_tokens += accepted
    for j in range(offered):
        stats.drafted_per_position[j] += 1
        stats.accepted_per_position[j] += int(j < accepted)
