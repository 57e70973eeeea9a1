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

import numpy as np
import torch

from eagle_serve.core import staging
from eagle_serve.core.interfaces import RaggedBatch, RowSampling, TargetOutput, ancestor_mask, tree_depths
from eagle_serve.core.kv_pages import PagePool
from eagle_serve.core.processors import LogitsProcessors, ProcessorRows, token_logprobs
from eagle_serve.core.requests import Request, TokenLogprob
from eagle_serve.core.workspace import DraftWorkspace
from eagle_serve.kernels.rejection import greedy_accept, greedy_tree_walk, random_accept, random_tree_accept_ref
from eagle_serve.kernels.sampling import SAMPLE, sample_ref
from eagle_serve.spec.lookup import GRAMMAR, SOURCES


@dataclass
class EngineStats:
    steps: int = 0                    # batched rounds (one target forward each)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    drafts: int = 0                   # rounds (per request) that verified at least one draft
    preemptions: int = 0
    prefix_cache_queries: int = 0     # tokens of admitted requests looked up in the prefix cache
    prefix_cache_hits: int = 0        # of those, tokens found there
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
    partial: bool = False  # a prefill chunk short of its last token: nothing to draft from yet


@dataclass
class VerifyBatch:
    batch: RaggedBatch
    logit_rows: torch.Tensor          # [R] rows of the batch the target scores
    sampling: RowSampling             # per scored row
    rows: list[VerifyRows]
    kv_moves: tuple[torch.Tensor, torch.Tensor] | None  # (src, dst) slots, applied first
    processors: LogitsProcessors | None  # what the requests' parameters do to the scored rows'
    #                                   logits (None: nothing)
    drafts: dict[str, tuple[torch.Tensor, torch.Tensor]]  # per acceptance group (see
    #                                   _accept_groups): the drafts [N] and their offsets [B+1]
    prompt_rows: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, first
    #                                   position, n): logit rows after the scored ones, whose
    #                                   log-softmax gives the prompt's logprobs


@dataclass
class Verdict:
    """What a request keeps of a round."""
    tokens: list[int]                 # emitted: accepted drafts + the target's token
    path: list[int]                   # accepted draft nodes, root first
    logprobs: list[TokenLogprob] | None = None  # of each emitted token (the request asked)


@dataclass
class DraftWork:
    """A request the round advanced, and the target features of its newly verified positions
    ([n, F]: its real rows, then the accepted path's rows) for the drafter to catch up on."""
    req: Request
    features: torch.Tensor


def int_tensor(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def sampling_fields(rows: list[tuple]) -> dict[str, np.ndarray]:
    """(temperature, top_k, top_p, seed) per row -> staging fields (RowSampling.staged reads
    them back)."""
    temp, top_k, top_p, seeds = zip(*rows) if rows else ((), (), (), ())
    return {"temperature": staging.float32(temp), "top_k": staging.int64(top_k),
            "top_p": staging.float32(top_p), "seeds": staging.int64(seeds),
            "sampled_rows": staging.int64([i for i, t in enumerate(temp) if t > 0])}


def build_verify_batch(reqs: list[Request], pool: PagePool, device,
                       eos_token_ids: tuple[int, ...] = ()) -> VerifyBatch:
    """A request that was preempted after emitting tokens recomputes all but its last token and
    scores nothing this round. A scored row predicts the token `depth` places past the last
    one (0 for the last real token, a draft's tree depth for a draft); EOS is banned on the
    rows whose prediction falls below the request's min_tokens. Every tensor of the batch
    (and the drafts acceptance compares) goes to the device in one copy (eagle_serve.core.staging)."""
    ids, positions, cu, seq_lens, slots, logit_rows, sampling, rows = [], [], [0], [], [], [], [], []
    masks, src, dst = [], [], []
    procs = ProcessorRows(eos_token_ids)
    prompt_rows = []  # (request, first position, batch rows): rows scored for prompt logprobs
    for req in reqs:
        start = req.num_computed
        resume = len(req.output) > 0 and start < len(req.tokens) - 1
        end = len(req.tokens) - 1 if resume else len(req.tokens)
        stop = end if req.chunk is None else min(end, start + req.chunk)
        real = req.tokens[start:stop]  # a chunk short of `end` scores nothing (no drafts then)
        new = real + req.drafts
        depths = tree_depths(req.parents)
        ids += new
        positions += range(start, start + len(real))
        positions += [len(req.tokens) - 1 + d for d in depths]
        slots += [pool.slot(req.target_pages, p) for p in range(start, start + len(new))]
        n_logits = 0 if resume or stop < end else 1 + len(req.drafts)
        if n_logits:
            procs.add(req, [[]] + draft_paths(req.drafts, req.parents), [0] + depths)
        logit_rows += range(cu[-1] + len(new) - n_logits, cu[-1] + len(new))
        sampling += [req.sampling_row()] * n_logits
        rows.append(VerifyRows(req, cu[-1], len(real), n_logits, stop < end))
        lo, hi = max(start, len(req.prompt_logprobs)), min(stop, req.prompt_len - 1)
        if req.params.prompt_logprobs is not None and hi > lo:
            prompt_rows.append((req, lo, [cu[-1] + p - start for p in range(lo, hi)]))
        cu.append(cu[-1] + len(new))
        seq_lens.append(start + len(new))
        masks.append((len(real), req.parents))
        for a, b in req.kv_moves:
            src.append(pool.slot(req.target_pages, a))
            dst.append(pool.slot(req.target_pages, b))
        req.kv_moves = []
    for _, _, batch_rows in prompt_rows:  # after the scored rows: greedy rows nobody accepts
        procs.add_prompt_rows(len(batch_rows))
        logit_rows += batch_rows
        sampling += [(0.0, 0, 1.0, 0)] * len(batch_rows)
    fields = {"input_ids": staging.int64(ids), "positions": staging.int64(positions),
              "cu_seqlens": staging.int64(cu), "seq_lens": staging.int64(seq_lens),
              "block_tables": staging.padded([r.target_pages for r in reqs]),
              "slot_mapping": staging.int64(slots), "logit_rows": staging.int64(logit_rows),
              "kv_src": staging.int64(src), "kv_dst": staging.int64(dst)}
    fields |= sampling_fields(sampling) | procs.fields()
    if any(req.is_tree for req in reqs):
        fields["tree_mask"] = _stack_masks([_verify_mask(n, parents) for n, parents in masks])
    groups = _accept_groups(rows)
    for name, group in groups.items():
        fields[name + "_drafts"] = staging.int64([d for r in group for d in r.req.drafts])
        fields[name + "_cu"] = staging.int64(
            [0] + list(itertools.accumulate(len(r.req.drafts) for r in group)))
    staged = staging.to_device(fields, device)
    batch = RaggedBatch.staged(staged, max((b - a for a, b in zip(cu, cu[1:])), default=0))
    moves = (staged["kv_src"], staged["kv_dst"]) if src else None
    processors = None if procs.empty else LogitsProcessors.staged(staged)
    drafts = {name: (staged[name + "_drafts"], staged[name + "_cu"]) for name in groups}
    return VerifyBatch(batch, staged["logit_rows"], RowSampling.staged(staged), rows, moves, processors,
                       drafts, [(req, lo, len(r)) for req, lo, r in prompt_rows])


def draft_paths(drafts: list[int], parents: list[int]) -> list[list[int]]:
    """The tokens from the root to each draft node, the node included (a chain: its prefixes)."""
    paths: list[list[int]] = []
    for tok, parent in zip(drafts, parents):
        paths.append((paths[parent] if parent >= 0 else []) + [tok])
    return paths


def _accept_groups(rows: list[VerifyRows]) -> dict[str, list[VerifyRows]]:
    """The scored requests by acceptance rule: "matched" (greedy, coupled), "sampled"."""
    scored = [r for r in rows if r.num_logits]
    return {"matched": [r for r in scored if r.req.matched],
            "sampled": [r for r in scored if not r.req.matched]}


def _verify_mask(num_real: int, parents: list[int]) -> np.ndarray:
    """[n, n] bool over a request's rows: causal, but a draft sees only its ancestors."""
    n = num_real + len(parents)
    mask = np.tril(np.ones((n, n), dtype=np.bool_))
    mask[num_real:, num_real:] = ancestor_mask(parents)
    return mask


def _stack_masks(masks: list[np.ndarray]) -> np.ndarray:
    """-> [B, W, W], each mask in the top-left corner"""
    width = max(m.shape[0] for m in masks)
    out = np.zeros((len(masks), width, width), dtype=np.bool_)
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
        drafts, cu = vb.drafts["matched"]
        argmax = torch.cat([a for _, a in greedy])
        if any(r.is_tree for r in reqs):  # a host walk (kernels.rejection.greedy_tree_accept's)
            walks = greedy_tree_walk([d for r in reqs for d in r.drafts], [p for r in reqs for p in r.parents],
                                     [0, *itertools.accumulate(len(r.drafts) for r in reqs)],
                                     argmax.tolist())
            verdicts |= {r.id: Verdict(*walk) for r, walk in zip(reqs, walks)}
        else:
            verdicts |= _verdicts(reqs, *greedy_accept(drafts, cu, argmax))
    if sampled:
        reqs = [r for r, _ in sampled]
        drafts, cu = vb.drafts["sampled"]
        q = (workspace.load([s for r in reqs for s in r.draft_slots]) if len(drafts)
             else torch.zeros((0, vocab_size), device=device))
        args = (torch.cat([p for _, p in sampled]), q, [r.seed for r in reqs],
                [len(r.tokens) for r in reqs])
        if any(r.is_tree for r in reqs):  # lookup branches beside the head's chain
            parents = torch.tensor([p for r in reqs for p in r.parents], dtype=torch.int64)
            verdicts |= _verdicts(reqs, *random_tree_accept_ref(drafts, parents, cu, *args))
        else:
            verdicts |= _verdicts(reqs, *random_accept(drafts, cu, *args))
    return verdicts


def attach_logprobs(result: TargetOutput, vb: VerifyBatch, verdicts: dict[str, Verdict]) -> None:
    """The logprobs of every emitted token of the requests that asked, from the row that
    predicted it: token j of a verdict comes from row 0 (j = 0) or from the row of the accepted
    node before it; and those of the prompt tokens computed this round, where asked."""
    picks, owners, lp_row = [], [], 0
    for r in vb.rows:
        if not r.num_logits or r.req.params.logprobs is None:
            continue
        verdict = verdicts.get(r.req.id)
        if verdict is not None:
            rows = [0] + [1 + n for n in verdict.path]
            picks += [(lp_row + rows[j], tok, r.req.params.logprobs) for j, tok in enumerate(verdict.tokens)]
            owners.append(verdict)
        lp_row += r.num_logits
    for req, first, n in vb.prompt_rows:  # position p predicts prompt token p + 1
        picks += [(lp_row + i, req.tokens[first + i + 1], req.params.prompt_logprobs) for i in range(n)]
        lp_row += n
    found = token_logprobs(result.logprobs, picks) if picks else []
    for verdict in owners:
        verdict.logprobs, found = found[:len(verdict.tokens)], found[len(verdict.tokens):]
    for req, _, n in vb.prompt_rows:
        req.prompt_logprobs += found[:n]
        found = found[n:]


def _verdicts(reqs: list[Request], out: torch.Tensor, num: torch.Tensor,
              path: torch.Tensor | None = None) -> dict[str, Verdict]:
    """An acceptance's out [B, max_k + 1], num [B] (and path [B, max_k] of a tree) -> verdicts,
    read to the host in one go (not per request)."""
    width = out.shape[1]
    parts = [num.unsqueeze(1), out] + ([path] if path is not None else [])
    verdicts = {}
    for req, row in zip(reqs, torch.cat(parts, dim=1).tolist()):  # one read
        n, tokens = row[0], row[1:1 + row[0]]
        accepted = row[1 + width:width + n] if path is not None else list(range(n - 1))
        verdicts[req.id] = Verdict(tokens, accepted)
    return verdicts


def coupled_samples(req: Request, probs: torch.Tensor) -> torch.Tensor:
    """A coupled request's scored rows [1 + n, V] -> the target's seeded sample at each [1 + n]:
    the token plain sampling draws at that row's position (key (seed, position, SAMPLE)), so
    the output is plain seeded sampling's whatever was drafted."""
    pos = len(req.tokens)
    positions = [pos + d for d in [0] + tree_depths(req.parents)]
    return sample_ref(probs, [req.seed] * len(positions), positions, SAMPLE)


def advance(result: TargetOutput, vb: VerifyBatch, verdicts: dict[str, Verdict], pool: PagePool,
            workspace: DraftWorkspace, stats: EngineStats, eos_token_ids: tuple[int, ...],
            store=None) -> list[DraftWork]:
    """Append accepted tokens, roll back KV and update the counters. -> drafter work of the
    speculative requests that go on. store (the prefix cache's features, or None) keeps the
    features of every request's newly computed positions: its `plan([(req, first position,
    n)])` says where (host ints), `write(where [N], features [N, F])` puts them there."""
    spans = []  # (VerifyRows, first position, its rows of the batch: real rows + accepted path)
    for r in vb.rows:
        req = r.req
        verdict = verdicts.get(req.id)
        path = verdict.path if verdict else []
        if verdict is not None:
            _count_round(req, path, stats)
            req.append(verdict.tokens, eos_token_ids, verdict.logprobs)
        base = req.num_computed + r.num_real  # position of draft node 0
        spans.append((r, req.num_computed, list(range(r.first_row, r.first_row + r.num_real))
                      + [r.first_row + r.num_real + i for i in path]))
        req.num_computed = base + len(path)
        req.kv_moves = [(base + i, base + j) for j, i in enumerate(path) if i != j]
        stats.kv_moves += len(req.kv_moves)
        workspace.free(req.draft_slots)
        req.clear_drafts()
        keep = max([req.num_computed] + [a + 1 for a, _ in req.kv_moves])
        pool.shrink(req.target_pages, keep)
    going = [span for span in spans if span[0].req.k and not span[0].req.finish_reason]
    gathered = spans if store is not None else going
    if not any(rows for _, _, rows in gathered):
        return []
    index = [i for _, _, rows in gathered for i in rows]
    where = store.plan([(r.req, start, len(rows)) for r, start, rows in gathered]) if store else []
    packed = int_tensor(index + list(where), result.hidden.device)  # one copy for both
    features = result.hidden.index_select(0, packed[:len(index)])
    if store is not None:
        store.write(packed[len(index):], features)
    pieces = dict(zip([id(r) for r, _, _ in gathered], features.split([len(x) for _, _, x in gathered])))
    work = []
    for r, _, _ in going:
        if r.partial:  # the drafter catches up on the whole prompt once it is computed
            r.req.undrafted.append(pieces[id(r)])
        else:
            work.append(DraftWork(r.req, pieces[id(r)]))
    return work


def _observe_head(req: Request, depths: list[int], path: list[int]) -> None:
    """The request's acceptance record follows its head's drafts alone (lookup branches are
    sized by their own scores, lookup_scores): the head's deepest draft and its drafts on the
    accepted path (a prefix of it: lookup nodes hang below or beside the head's). A round
    without head drafts is idle, even if its lookups drafted, so a head that stopped paying is
    probed again."""
    head = [d for d, key in zip(depths, req.draft_keys) if key is None]
    if head:
        req.acceptance.observe(max(head), sum(req.draft_keys[n] is None for n in path))
    else:
        req.acceptance.idle_rounds += 1


def _observe_lookups(req: Request, path: list[int]) -> None:
    """Count the request's lookup drafts that were reached (their parent accepted, or they hang
    from the root), each accepted or not, in the process's table (lookup_scores). A grammar's
    forced tokens are drafted whatever their record, so they are not scored."""
    kept = set(path)
    for n, key in enumerate(req.draft_keys):
        if key is not None and key.source != GRAMMAR and (req.parents[n] < 0 or req.parents[n] in kept):
            req.lookup_scores.record(key, n in kept)


def _count_round(req: Request, path: list[int], stats: EngineStats) -> None:
    """path = the accepted draft nodes; per-position counters count by depth, per-source
    counters by the source that proposed each node."""
    accepted, sources = len(path), req.draft_sources
    for source in sources:
        stats.draft_tokens_by_source[source] += 1
    for node in path:
        stats.accepted_tokens_by_source[sources[node]] += 1
    depths = tree_depths(req.parents)
    offered = max(depths, default=0)  # deepest draft (a chain: k)
    _observe_head(req, depths, path)
    _observe_lookups(req, path)
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
