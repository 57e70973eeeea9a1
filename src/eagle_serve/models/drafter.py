"""The EAGLE drafter: an EAGLE head (heads.py) run over (token embedding, target feature) pairs.

Row (f_p, x_{p+1}) lives at drafter position p: the feature the target computed at position p
and the token that followed it. The output at a request's last row predicts the next token (the
first draft); each further draft step feeds the drafter's own output feature back with the
token it just drafted. The head kind decides how features are fused, where logits come from
and how draft ids map to target ids.

Drafts are sampled here: greedy requests take the argmax, sampled ones draw from q (their own
temperature/top-k/top-p) with a key (seed, position, DRAFT), and q goes back to the engine
for lossless verification. Coupled sampled rows (DraftShapes.coupled) instead draft as greedy
rows do over `coupled_scores`: q run through the target's own sampling race at each position,
so their drafts are guesses at the target's seeded sample (trees included) and carry no q.

What each request drafts comes with the call (`DraftShapes`, decided by the engine's draft
policy): a chain or a tree, and confidence limits on greedy drafts: a draft whose cumulative
draft probability is below `min_prob` is not proposed (it would cost a verify row and rarely be
accepted), and a chain or tree drafts one level deeper only while one of its drafts reaches
`expand_prob` (a drafter step pays only when the next token is likely). The first draft is
always proposed; verification does not change, so the output does not either. A sampled chain
stops before the draft at which the product of its q's top probabilities falls below `min_prob`
(the first draft included): the decision depends on q, not on the token drawn from it, so
rejection sampling stays exact.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from eagle_serve.core import staging
from eagle_serve.core.interfaces import DraftOutput, DraftShapes, RaggedBatch, RowSampling, ancestor_mask
from eagle_serve.kernels.sampling import DRAFT, compute_probs, coupled_scores, sample
from eagle_serve.models.heads import EagleHead
from eagle_serve.models.paged import PagedKVCache


def log_limit(prob: torch.Tensor) -> torch.Tensor:
    """[B] probability limits -> float64 log limits, -inf where 0 (off)."""
    prob = prob.double()
    return torch.where(prob > 0, prob.clamp(min=1e-300).log(), -math.inf)


class Drafter:
    """In-process drafter runner (implements `DrafterRunner`)."""

    def __init__(self, head: EagleHead, embed_tokens: torch.Tensor, lm_head: torch.Tensor | None,
                 *, num_pages: int = 256, page_size: int = 16):
        """embed_tokens: [V, H] (the target's, or the head's own); lm_head: [V, H] the target's
        (heads that read logits through it: EAGLE-1, EAGLE-3 without an LM head)."""
        self.head = head.eval()
        p = next(head.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.embed_tokens = embed_tokens.to(self.dtype)
        self.lm_head = lm_head.to(self.dtype) if lm_head is not None else None
        self.vocab_size = embed_tokens.shape[0]
        cfg = head.spec.layer
        self.cache = PagedKVCache(head.num_layers, num_pages, page_size, cfg.num_key_value_heads,
                                  head.head_dim, self.dtype, self.device)
        self.page_size = page_size
        self.stack = None  # the head's layers in one C++ call (cpu_stack.head_stack; load_drafter)

    @property
    def feature_layers(self):
        return self.head.spec.feature_layers

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        """feature: [R, H] -> [R, V_draft]"""
        return self.head.logits(feature, self.lm_head)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.head.to_target_ids(draft_ids)

    def to_target_probs(self, q: torch.Tensor) -> torch.Tensor:
        """q: [R, V_draft] -> [R, V] (zero outside the draft vocabulary)"""
        return self.head.to_target_probs(q, self.vocab_size)

    def _step(self, emb, hidden, from_target: bool, batch: RaggedBatch) -> torch.Tensor:
        """The head's step (EagleHead.step), its layers in one C++ call where `stack` runs them."""
        residual, x, cos, sin = self.head.inputs(emb, hidden, from_target, batch)
        out = self.stack(residual, cos, sin, batch, first_input=x) if self.stack is not None else None
        return out[0] if out is not None else self.head.layers_over(residual, x, cos, sin, batch, self.cache)

    @torch.inference_mode()
    def propose(self, batch: RaggedBatch, features: torch.Tensor, shapes: DraftShapes,
                sampling: RowSampling) -> DraftOutput:
        """Catch up on the batch's rows, then draft shapes.num_drafts[b] nodes for each request:
        a chain, or (topk[b] > 1, greedy) an EAGLE-2 tree of depth[b] levels.

        batch: rows (f_p, x_{p+1}) at drafter positions p; block tables must also cover the
        positions the draft steps write (chains: seq_len .. seq_len + k - 2; trees: seq_len ..
        seq_len + topk * (depth - 1) - 1). features: [T, F] -> DraftOutput
        """
        emb = nn.functional.embedding(batch.input_ids, self.embed_tokens)
        out = self._step(emb, features.to(self.dtype), True, batch)
        last = out[batch.cu_seqlens[1:] - 1]  # [B, H]
        couple = _Coupling(self, sampling, shapes.coupled)
        rows = _Rows.read(batch, shapes, couple.drafting)  # coupled rows draft as greedy ones
        couple.rows = rows
        if any(t > 1 and s for t, s in zip(rows.topk, rows.sampled)):  # a tree needs one guess per node
            raise ValueError("rejection-sampled rows draft chains (draft_topk 1); trees need "
                             "argmax or coupled drafting")
        ks = rows.num_drafts
        tree_rows = [b for b, t in enumerate(rows.topk) if t > 1]
        chain_ks = [0 if t > 1 else k for k, t in zip(ks, rows.topk)]
        tokens, probs = self._draft_chains(batch, last, chain_ks, rows, couple.drafting, couple)
        width = max(ks, default=0)
        cols = torch.arange(width, device=self.device)
        parents = torch.where(cols < shapes.num_drafts.unsqueeze(1), cols - 1, -1)  # [B, width] chains
        tokens = nn.functional.pad(tokens, (0, width - tokens.shape[1]), value=-1)
        scores = None
        if tree_rows:
            scores = torch.zeros((len(ks), width), dtype=torch.float64, device=self.device)
            trees = self._draft_trees(batch, last, tree_rows, ks, rows.topk, rows.depth,
                                      [(rows.min_logp[b], rows.expand_logp[b]) for b in tree_rows],
                                      couple)
            pad = lambda x, fill: [r + [fill] * (width - len(r)) for r in x]  # noqa: E731
            staged = staging.to_device({  # one copy
                "rows": staging.int64(tree_rows),
                "tokens": np.array(pad([t.tokens for t in trees], -1), dtype=np.int64),
                "parents": np.array(pad([t.parents for t in trees], -1), dtype=np.int64),
                "scores": np.array(pad([t.scores for t in trees], 0.0), dtype=np.float64)}, self.device)
            index = staged["rows"]
            tokens[index], parents[index], scores[index] = staged["tokens"], staged["parents"], staged["scores"]
        return DraftOutput(tokens=tokens, probs=probs, parents=parents, scores=scores)

    def _draft_chains(self, batch: RaggedBatch, last: torch.Tensor, ks: list[int], rows: "_Rows",
                      sampling: RowSampling, couple: "_Coupling") -> tuple[torch.Tensor, torch.Tensor]:
        """ks[b] drafts for request b, each fed back with the drafter's own feature. Which rows
        go on is decided on the host (`rows`): per step one staged copy (the active rows and
        their positions) and, with confidence limits, one read of the step's log-probabilities.
        last: [B, H] catch-up outputs -> tokens [B, max_k] (-1 padded), q [N_sampled, V]"""
        num_req, max_k = len(ks), max(ks, default=0)
        tokens = torch.full((num_req, max_k), -1, dtype=torch.int64, device=self.device)
        probs: list[list[torch.Tensor]] = [[] for _ in range(num_req)]
        prune = any(lo > -math.inf or hi > -math.inf for lo, hi in zip(rows.min_logp, rows.expand_logp))
        path_logp, going, dropped = [0.0] * num_req, [True] * num_req, []
        for j in range(max_k):
            active = [b for b in range(num_req) if ks[b] > j and going[b]]
            if not active:
                break
            positions = [rows.seq_lens[b] + j + 1 for b in active]  # the target positions drafted
            picks = [i for i, b in enumerate(active) if rows.sampled[b]]
            staged = staging.to_device({"active": staging.int64(active),
                                        "positions": staging.int64(positions),
                                        "sampled": staging.int64(picks)}, self.device)
            index = staged["active"]  # [A]
            if j > 0:  # feed back (own feature, previous draft) at position seq_len + j - 1
                step = self._single_token_batch(batch, index, tokens[index, j - 1], staged["positions"] - 2)
                emb = nn.functional.embedding(step.input_ids, self.embed_tokens)
                last = last.clone()
                last[index] = self._step(emb, last[index], False, step)
            logits = couple(self.logits(last[index]), active, positions)  # [A, V_draft]
            drafted, q = self._sample(logits, sampling.select(index), staged["sampled"],
                                      [rows.seeds[active[i]] for i in picks],
                                      [positions[i] for i in picks])
            tokens[index, j] = drafted
            keep = [True] * len(active)
            if prune:  # path probability: greedy rows their argmax's, sampled rows their q's top
                step_logp = (torch.log_softmax(logits.double(), -1).amax(-1) if len(picks) < len(active)
                             else torch.zeros(len(active), dtype=torch.float64, device=logits.device))  # [A]
                if q is not None:  # decided from q alone, before the draft: stays lossless
                    step_logp[staged["sampled"]] = q[staged["sampled"]].double().amax(-1).log()
                for i, (b, lp) in enumerate(zip(active, step_logp.tolist())):
                    path_logp[b] += lp
                    keep[i] = not (path_logp[b] < rows.min_logp[b] and (rows.sampled[b] or j > 0))
                    going[b] = path_logp[b] >= max(rows.min_logp[b], rows.expand_logp[b])
                dropped += [(b, j) for b, k in zip(active, keep) if not k]  # a greedy first draft stays
            for i in picks:
                if keep[i]:
                    probs[active[i]].append(q[i])
        if dropped:  # one staged copy for every pruned draft
            at = staging.to_device({"rows": staging.int64([b for b, _ in dropped]),
                                    "cols": staging.int64([j for _, j in dropped])}, self.device)
            tokens[at["rows"], at["cols"]] = -1
        flat = [p for per_req in probs for p in per_req]
        q_all = torch.stack(flat) if flat else torch.zeros((0, self.vocab_size), device=self.device)
        return tokens, q_all.float()

    def _draft_trees(self, batch: RaggedBatch, last: torch.Tensor, rows: list[int],
                     num_nodes: list[int], topk: list[int], depth: list[int],
                     limits: list[tuple[float, float]], couple: "_Coupling") -> list["_Tree"]:
        """EAGLE-2 dynamic trees (greedy requests): the root's top-k children are the depth-1
        candidates; each further level expands the top-k candidates of the previous depth by
        cumulative log-probability, in one drafter forward for every tree of the batch; then
        the best num_nodes candidates are kept. last: [B, H] catch-up outputs; limits: (min,
        expand) log limits per tree."""
        seq_lens, tables = couple.rows.seq_lens, batch.block_tables.tolist()
        trees = [_Tree(seq_lens[b], topk[b], depth[b], num_nodes[b], lim[0])
                 for b, lim in zip(rows, limits)]
        self._add_children(trees, [-1] * len(trees), last[rows], couple, rows)
        for level in range(1, max(t.depth for t in trees)):
            active = [i for i, t in enumerate(trees)
                      if t.depth > level and t.best_score(level) >= max(limits[i])]
            if not active:
                break
            new_rows = [trees[i].expand(level, last[rows[i]]) for i in active]
            step = self._tree_batch(tables, [rows[i] for i in active], [trees[i] for i in active])
            emb = nn.functional.embedding(step.input_ids, self.embed_tokens)
            feats = torch.cat([torch.stack(trees[i].inputs) for i in active])
            out = self._step(emb, feats, False, step)  # [sum E, H]
            ends = list(itertools.accumulate(len(trees[i].expanded) for i in active))  # step's cu
            picked = [(i, c, out[end - len(new) + r]) for i, new, end in zip(active, new_rows, ends)
                      for r, c in enumerate(new)]
            for i, c, feature in picked:
                trees[i].outputs[c] = feature
            self._add_children([trees[i] for i, _, _ in picked], [c for _, c, _ in picked],
                               torch.stack([f for _, _, f in picked]), couple,
                               [rows[i] for i, _, _ in picked])
        return [t.select() for t in trees]

    def _add_children(self, trees: list["_Tree"], nodes: list[int], features: torch.Tensor,
                      couple: "_Coupling", rows: list[int]) -> None:
        """The top-k children of each (tree, node) from its output feature [R, H]; rows: the
        batch row of each tree. A node's children draft the target position end + 1 + its depth."""
        positions = [t.end + 1 + (t.depths[c] if c >= 0 else 0) for t, c in zip(trees, nodes)]
        logits = couple(self.logits(features), rows, positions)
        logp = torch.log_softmax(logits.double(), dim=-1)  # [R, V_draft]
        values, ids = logp.topk(max(t.topk for t in trees), dim=-1)
        k_max = values.shape[1]  # target ids (< 2**53: exact in float64) beside their scores
        read = torch.cat([self.to_target_ids(ids).double(), values], dim=1).tolist()  # one read
        for row, tree, node in zip(read, trees, nodes):
            k = tree.topk
            tree.add(node, [int(t) for t in row[:k]], row[k_max:k_max + k])

    def _tree_batch(self, tables: list[list[int]], rows: list[int], trees: list["_Tree"]) -> RaggedBatch:
        """Every expanded node of each tree as a new token: stored at seq_len + e (e = order of
        expansion), RoPE position seq_len + depth - 1, seeing the context and its ancestors.
        tables: the call's block tables (host) -> one staged batch"""
        ids, positions, slots, cu, seq_lens = [], [], [], [0], []
        for b, tree in zip(rows, trees):
            stored = range(tree.end, tree.end + len(tree.expanded))
            ids += [tree.tokens[c] for c in tree.expanded]
            positions += [tree.end + tree.depths[c] - 1 for c in tree.expanded]
            pages = [tables[b][p // self.page_size] for p in stored]
            slots += [page * self.page_size + p % self.page_size for page, p in zip(pages, stored)]
            cu.append(cu[-1] + len(stored))
            seq_lens.append(stored.stop)
        width = max(len(t.expanded) for t in trees)
        mask = np.zeros((len(trees), width, width), dtype=np.bool_)
        for b, tree in enumerate(trees):
            n = len(tree.expanded)
            mask[b, :n, :n] = ancestor_mask(tree.expanded_parents())
        staged = staging.to_device({"input_ids": staging.int64(ids), "positions": staging.int64(positions),
                                    "cu_seqlens": staging.int64(cu), "seq_lens": staging.int64(seq_lens),
                                    "block_tables": staging.padded([tables[b] for b in rows]),
                                    "slot_mapping": staging.int64(slots), "tree_mask": mask}, self.device)
        return RaggedBatch.staged(staged, width)

    def _sample(self, logits: torch.Tensor, s: RowSampling, picks: torch.Tensor,
                seeds: list[int], positions: list[int]):
        """logits [R, V_draft]; picks: [S] the sampled rows, with their seeds and positions (host)
        -> target ids [R], target-vocabulary q [R, V] (None if no row is sampled)"""
        # bf16 argmax is slow on CPU; coupled rows' float64 scores keep their precision
        draft_ids = (logits if logits.dtype == torch.float64 else logits.float()).argmax(dim=-1)
        if picks.numel() == 0:
            return self.to_target_ids(draft_ids), None
        rs = s.select(picks)
        q_draft = compute_probs(logits[picks], rs.temperature, rs.top_k, rs.top_p)
        q = self.to_target_probs(q_draft)
        draft_ids[picks] = sample(q_draft, seeds, positions, DRAFT)
        full_q = q.new_zeros((logits.shape[0], self.vocab_size))
        full_q[picks] = q
        return self.to_target_ids(draft_ids), full_q

    def _single_token_batch(self, batch: RaggedBatch, active: torch.Tensor, ids: torch.Tensor,
                            positions: torch.Tensor) -> RaggedBatch:
        tables = batch.block_tables[active]
        pages = tables.gather(1, (positions // self.page_size).unsqueeze(1)).squeeze(1)
        n = active.shape[0]
        return RaggedBatch(input_ids=ids, positions=positions,
                           cu_seqlens=torch.arange(n + 1, device=self.device),
                           seq_lens=positions + 1, block_tables=tables,
                           slot_mapping=pages * self.page_size + positions % self.page_size,
                           max_query_len=1)


@dataclass
class _Rows:
    """What the drafter decides on the host about each row of a call, read in two copies."""
    num_drafts: list[int]
    topk: list[int]
    depth: list[int]
    seq_lens: list[int]
    seeds: list[int]
    sampled: list[bool]      # drafts drawn from q (rejection-sampled rows)
    coupled: list[bool]
    min_logp: list[float]    # log limits, -inf = off (see log_limit)
    expand_logp: list[float]

    @classmethod
    def read(cls, batch: RaggedBatch, shapes: DraftShapes, drafting: RowSampling) -> "_Rows":
        flags = torch.stack([drafting.sampled, shapes.coupled_rows()]).long()
        ints = torch.cat([torch.stack([shapes.num_drafts, shapes.topk, shapes.depth,
                                       batch.seq_lens, drafting.seeds]), flags]).tolist()
        limits = torch.stack([log_limit(shapes.min_prob), log_limit(shapes.expand_prob)]).tolist()
        return cls(*ints[:5], [bool(x) for x in ints[5]], [bool(x) for x in ints[6]], *limits)


class _Coupling:
    """Coupled drafting of some sampled rows (DraftShapes.coupled): their logits are replaced by
    coupled_scores, so they draft as greedy rows do (argmax, trees, confidence limits) and
    carry no q; verification matches the drafts against the target's keyed samples."""

    def __init__(self, drafter: "Drafter", sampling: RowSampling, coupled: torch.Tensor | None):
        self.drafter, self.sampling, self.coupled = drafter, sampling, coupled  # [B] bool; None: none
        self.rows: _Rows | None = None  # set once read
        self.drafting = sampling
        if coupled is not None:
            zero = torch.zeros_like(sampling.temperature)
            self.drafting = RowSampling(torch.where(coupled, zero, sampling.temperature),
                                        sampling.top_k, sampling.top_p, sampling.seeds)
        self._target_ids: torch.Tensor | None = None  # [V_draft] target id of each draft id

    def __call__(self, logits: torch.Tensor, rows: list[int], positions: list[int]) -> torch.Tensor:
        """logits: [A, V_draft] of batch rows `rows`, drafting target `positions` -> the same,
        coupled rows' replaced (float64 if any row is coupled)"""
        if self.coupled is None:
            return logits
        picks = [i for i, b in enumerate(rows) if self.rows.coupled[b]]
        if not picks:
            return logits
        staged = staging.to_device({"picks": staging.int64(picks),
                                    "rows": staging.int64([rows[i] for i in picks])}, logits.device)
        pick = staged["picks"]
        s = self.sampling.select(staged["rows"])
        q = compute_probs(logits[pick], s.temperature, s.top_k, s.top_p)  # [P, V_draft]
        if self._target_ids is None:
            self._target_ids = self.drafter.to_target_ids(torch.arange(q.shape[1], device=q.device))
        out = logits.double()
        out[pick] = coupled_scores(q, self._target_ids, self.drafter.vocab_size,
                                   [self.rows.seeds[rows[i]] for i in picks],
                                   [positions[i] for i in picks])
        return out


class _Tree:
    """Candidates of one EAGLE-2 draft tree: each has a token, a parent (-1 = the root), a
    depth and a score (cumulative draft log-probability); `expanded` lists the candidates fed
    through the drafter, in order (parents first), with their input features and outputs."""

    def __init__(self, end: int, topk: int, depth: int, num_nodes: int,
                 min_logp: float = -math.inf):
        self.end, self.topk, self.depth, self.num_nodes = end, topk, depth, num_nodes
        self.min_logp = min_logp  # candidates scoring below are neither expanded nor kept
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.scores: list[float] = []
        self.expanded: list[int] = []
        self.inputs: list[torch.Tensor] = []      # [H] parent's output feature per expanded node
        self.outputs: dict[int, torch.Tensor] = {}

    def add(self, parent: int, tokens: list[int], logps: list[float]) -> None:
        base = 0.0 if parent < 0 else self.scores[parent]
        for token, logp in zip(tokens, logps):
            self.tokens.append(token)
            self.parents.append(parent)
            self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
            self.scores.append(base + logp)

    def _rank(self, c: int) -> tuple:
        # a child never ranks before its parent: its score is <= the parent's, ties by depth
        return (-self.scores[c], self.depths[c], c)

    def best_score(self, level: int) -> float:
        return max((s for s, d in zip(self.scores, self.depths) if d == level), default=-math.inf)

    def expand(self, level: int, root_feature: torch.Tensor) -> list[int]:
        """Mark the top-k candidates of depth `level` for expansion -> their indices."""
        frontier = sorted((c for c, d in enumerate(self.depths) if d == level), key=self._rank)
        new = [c for c in frontier[:self.topk] if self.scores[c] >= self.min_logp]
        for c in new:
            p = self.parents[c]
            self.inputs.append(root_feature if p < 0 else self.outputs[p])
        self.expanded += new
        return new

    def expanded_parents(self) -> list[int]:
        where = {c: e for e, c in enumerate(self.expanded)}
        return [where.get(self.parents[c], -1) for c in self.expanded]

    def select(self) -> "_Tree":
        """The best num_nodes candidates, depth-first with the best child first (so the
        drafter's own greedy path comes first) -> a tree with tokens, parents, scores. Below
        min_logp only the best candidate is kept."""
        ranked = sorted(range(len(self.tokens)), key=self._rank)[:self.num_nodes]
        keep = ranked[:1] + [c for c in ranked[1:] if self.scores[c] >= self.min_logp]
        children: dict[int, list[int]] = {-1: []}
        for c in keep:  # in rank order: best child first
            assert self.parents[c] in children, "a kept node's parent was not kept"
            children[self.parents[c]].append(c)
            children[c] = []
        order, stack = [], list(reversed(children[-1]))
        while stack:
            c = stack.pop()
            order.append(c)
            stack += reversed(children[c])
        index = {c: i for i, c in enumerate(order)}
        out = _Tree(self.end, self.topk, self.depth, self.num_nodes, self.min_logp)
        out.tokens = [self.tokens[c] for c in order]
        out.parents = [index.get(self.parents[c], -1) for c in order]
        out.depths = [self.depths[c] for c in order]
        out.scores = [self.scores[c] for c in order]
        return out
