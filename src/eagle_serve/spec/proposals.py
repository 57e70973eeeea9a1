"""One drafting round: the drafter call for the requests whose round drafts from the head, then
the lookup branches merged into each request's tree, as `DraftPolicy` (eagle_serve.spec.policy)
shapes them. Verification does not depend on what is drafted, so the output is the target's.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from eagle_serve.core import staging
from eagle_serve.core.interfaces import DrafterRunner, DraftShapes, RaggedBatch, RowSampling
from eagle_serve.core.kv_pages import PagePool
from eagle_serve.core.workspace import DraftWorkspace
from eagle_serve.spec.lookup import GRAMMAR
from eagle_serve.spec.lookup_scores import MAX_PLACE, LookupKey
from eagle_serve.spec.policy import Branch, DraftPolicy, RoundShape
from eagle_serve.spec.verify import DraftWork, sampling_fields


def propose_drafts(work: list[DraftWork], drafter: DrafterRunner, policy: DraftPolicy,
                   pool: PagePool, workspace: DraftWorkspace, batch_size: int, device) -> None:
    """Draft each request's next round: one drafter call for the requests whose round drafts
    from the head (it first catches up on their newly verified positions), then the lookup
    branches. A request whose round drafts nothing from the head skips the call: its features
    wait in `undrafted` for its next drafting round. The drafts (and sampled requests' draft
    probabilities) go into the request."""
    cfg, start = policy.config, time.perf_counter()
    lefts = [min(w.req.params.max_tokens - len(w.req.output) - 1,
                 cfg.scheduler.max_model_len - len(w.req.tokens)) for w in work]
    shapes = [policy.round_shape(w.req, left, batch_size) for w, left in zip(work, lefts)]
    called = [(w, s) for w, s in zip(work, shapes) if s.nodes]
    for w, _ in called:  # join the features of the rounds that drafted nothing, once
        if w.req.undrafted:
            w.features = torch.cat([*w.req.undrafted, w.features])
            w.req.undrafted = []
    out = _call_drafter(called, drafter, pool, device) if called else None
    tokens, tree_parents = _read_drafts(out)
    stores = []  # (slots, q rows) of the sampled requests, written at once
    row = prob_row = 0
    for w, shape, left in zip(work, shapes, lefts):
        req = w.req
        drafts, parents, q = [], [], None
        if shape.nodes:
            req.draft_computed = req.num_computed
            pool.shrink(req.drafter_pages, req.draft_computed)
            drafts = tokens[row][:shape.nodes]
            drafts = drafts[:drafts.index(-1)] if -1 in drafts else drafts  # fewer nodes
            parents = (tree_parents[row][:len(drafts)] if tree_parents is not None
                       else list(range(-1, len(drafts) - 1)))
            if not req.matched:
                q = out.probs[prob_row:prob_row + len(drafts)]
                prob_row += len(drafts)
            row += 1
        else:
            req.undrafted.append(w.features)
        keys: list[LookupKey | None] = [None] * len(drafts)  # None: the head's
        budget, num_head = req.lookup_budget, len(drafts)
        for branch in policy.lookups(req, left, batch_size, first_path(drafts, parents)):
            budget -= merge_branch(drafts, parents, keys, branch, budget)
        if req.grammar is not None:
            drafts, parents, keys = _guided(req, drafts, parents, keys, left, cfg.drafting.max_speculative_tokens)
        slots = workspace.alloc(len(drafts))
        if slots is None:  # no free slots: this round verifies no drafts
            continue
        if not req.matched and drafts:
            stores.append((slots, _with_lookups(q, drafts[num_head:], workspace.vocab_size)))
        req.drafts, req.draft_slots, req.parents, req.draft_keys = drafts, slots, parents, keys
    if stores:
        workspace.store([s for slots, _ in stores for s in slots], torch.cat([q for _, q in stores]))
    if called:  # what the round's drafting took: the call, and the policy's work around it
        policy.costs.record_drafter(time.perf_counter() - start)


def _guided(req, drafts: list[int], parents: list[int], keys: list, left: int, most: int):
    """A guided request's tree: the ways to write the text its grammar forces next (at most
    `most` nodes, none deeper than the output has room for) joined from the root, then, for
    requests whose drafts are matched (not drawn from q), every node the grammar refuses pruned."""
    tokens, tree = req.grammar.forced_tree(most) if left > 0 else ([], [])
    at: list[int | None] = []  # each forced node's index in the draft tree (None: left out)
    depth: list[int] = []
    for token, parent in zip(tokens, tree):
        depth.append(1 if parent < 0 else depth[parent] + 1)
        under = -1 if parent < 0 else at[parent]
        if under is None or depth[-1] > left:
            at.append(None)
            continue
        child = next((i for i, (t, p) in enumerate(zip(drafts, parents)) if p == under and t == token), None)
        if child is None:  # (a node another source drafted is kept as it is)
            drafts.append(token)
            parents.append(under)
            keys.append(LookupKey(req.rule, GRAMMAR, 0, min(depth[-1], MAX_PLACE)))
            child = len(drafts) - 1
        at.append(child)
    if req.matched and drafts:
        drafts, parents, keys = req.grammar.prune(drafts, parents, keys)
    return drafts, parents, keys


def _read_drafts(out) -> tuple[list[list[int]], list[list[int]] | None]:
    """A drafter call's tokens and parents (None: chains), read in one go (not per request)."""
    if out is None:
        return [], None
    if out.parents is None:
        return out.tokens.tolist(), None
    both = torch.stack([out.tokens, out.parents]).tolist()  # [2, B, max_k]
    return both[0], both[1]


def _with_lookups(q: torch.Tensor | None, lookups: list[int], vocab_size: int) -> torch.Tensor:
    """[n_head, V] the head drafts' q -> [n_head + n_lookup, V], a lookup proposal's q one-hot
    at its token (it is proposed with certainty)."""
    if q is not None and not lookups:
        return q
    one_hot = torch.zeros((len(lookups), vocab_size),
                          dtype=q.dtype if q is not None else torch.float32,
                          device=q.device if q is not None else "cpu")
    one_hot[torch.arange(len(lookups)), torch.tensor(lookups, dtype=torch.int64)] = 1.0
    return one_hot if q is None else torch.cat([q, one_hot])


def _call_drafter(called: list[tuple[DraftWork, RoundShape]], drafter: DrafterRunner,
                  pool: PagePool, device):
    """One drafter call: catch up on each request's verified positions it has not seen, then
    draft its round's shape. -> DraftOutput (rows in the order of `called`)"""
    ids, positions, cu, seq_lens, slots = [], [], [0], [], []
    for w, _ in called:
        req = w.req
        start, end = req.draft_computed, req.num_computed
        assert w.features.shape[0] == end - start, "drafter fell behind"
        ids += req.tokens[start + 1:end + 1]
        positions += range(start, end)
        slots += [pool.slot(req.drafter_pages, p) for p in range(start, end)]
        cu.append(cu[-1] + end - start)
        seq_lens.append(end)
    shapes = [s for _, s in called]
    fields = {"input_ids": staging.int64(ids), "positions": staging.int64(positions),
              "cu_seqlens": staging.int64(cu), "seq_lens": staging.int64(seq_lens),
              "block_tables": staging.padded([w.req.drafter_pages for w, _ in called]),
              "slot_mapping": staging.int64(slots),
              "num_drafts": staging.int64([s.nodes for s in shapes]),
              "topk": staging.int64([s.topk for s in shapes]),
              "depth": staging.int64([s.depth for s in shapes]),
              "min_prob": staging.float32([s.min_prob for s in shapes]),
              "expand_prob": staging.float32([s.expand_prob for s in shapes]),
              "coupled": np.asarray([w.req.coupled for w, _ in called], dtype=np.bool_)}
    fields |= sampling_fields([w.req.sampling_row() for w, _ in called])
    staged = staging.to_device(fields, device)  # one copy
    wire = DraftShapes(*(staged[f] for f in ("num_drafts", "topk", "depth", "min_prob", "expand_prob")),
                       coupled=staged["coupled"] if any(w.req.coupled for w, _ in called) else None)
    batch = RaggedBatch.staged(staged, max((b - a for a, b in zip(cu, cu[1:])), default=0))
    return drafter.propose(batch, torch.cat([w.features for w, _ in called]), wire,
                           RowSampling.staged(staged))


def first_path(drafts: list[int], parents: list[int]) -> list[int]:
    """The tokens along the first child of each node from the root (the head's most likely
    path: it orders children best first)."""
    path, node = [], -1
    while (child := next((i for i, p in enumerate(parents) if p == node), None)) is not None:
        path.append(drafts[child])
        node = child
    return path


def merge_branch(drafts: list[int], parents: list[int], keys: list[LookupKey | None],
                 branch: Branch, budget: int) -> int:
    """Add a chain of tokens under the root of a draft tree, reusing the nodes that already
    hold its prefix (parents stay before children). -> nodes added (at most budget)."""
    added, node = 0, -1
    for token, key in zip(branch.tokens, branch.keys):
        child = next((i for i, (d, p) in enumerate(zip(drafts, parents)) if p == node and d == token), None)
        if child is None:
            if added == budget:
                break
            drafts.append(token)
            parents.append(node)
            keys.append(key)
            child, added = len(drafts) - 1, added + 1
        node = child
    return added
