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

from dataclasses import dataclass

import math

import torch
from torch import nn

from eagle_serve.heads import EagleHead
from eagle_serve.interfaces import DraftOutput, DraftShapes, RaggedBatch, RowSampling, ancestor_mask
from eagle_serve.paged import PagedKVCache
from kernels.sampling import DRAFT, compute_probs, coupled_scores, sample


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
        out = self.head.step(emb, features.to(self.dtype), True, batch, self.cache)
        last = out[batch.cu_seqlens[1:] - 1]  # [B, H]
        num_drafts, topk, depth = shapes.num_drafts, shapes.topk, shapes.depth
        limits = log_limit(shapes.min_prob), log_limit(shapes.expand_prob)  # [B] each
        couple = _Coupling(self, sampling, shapes.coupled_rows())
        drafting = couple.drafting  # coupled rows draft as greedy ones
        if bool(((topk > 1) & drafting.sampled).any()):  # a tree needs one guess per node
            raise ValueError("rejection-sampled rows draft chains (draft_topk 1); trees need "
                             "argmax or coupled drafting")
        is_tree = topk > 1  # [B]
        tokens, probs = self._draft_chains(batch, last, torch.where(is_tree, 0, num_drafts),
                                           drafting, *limits, couple)
        ks = num_drafts.tolist()
        width = max(ks, default=0)
        cols = torch.arange(width, device=self.device)
        parents = torch.where(cols < num_drafts.unsqueeze(1), cols - 1, -1)  # [B, width] chains
        tokens = nn.functional.pad(tokens, (0, width - tokens.shape[1]), value=-1)
        scores = None
        tree_rows = is_tree.nonzero().squeeze(1).tolist()
        if tree_rows:
            scores = torch.zeros((len(ks), width), dtype=torch.float64, device=self.device)
            trees = self._draft_trees(batch, last, tree_rows, ks, topk.tolist(), depth.tolist(),
                                      [(limits[0][b].item(), limits[1][b].item()) for b in tree_rows],
                                      couple)
            for b, tree in zip(tree_rows, trees):
                n = len(tree.tokens)
                tokens[b], parents[b] = -1, -1
                tokens[b, :n] = torch.tensor(tree.tokens, device=self.device)
                parents[b, :n] = torch.tensor(tree.parents, device=self.device)
                scores[b, :n] = torch.tensor(tree.scores, dtype=torch.float64, device=self.device)
        return DraftOutput(tokens=tokens, probs=probs, parents=parents, scores=scores)

    def _draft_chains(self, batch: RaggedBatch, last: torch.Tensor, num_drafts: torch.Tensor,
                      sampling: RowSampling, min_logp: torch.Tensor,
                      expand_logp: torch.Tensor, couple: "_Coupling") -> tuple[torch.Tensor, torch.Tensor]:
        """k_b drafts per request, each fed back with the drafter's own feature.
        last: [B, H] catch-up outputs; min_logp, expand_logp: [B] log limits (sampled rows: min_logp only)
        -> tokens [B, max_k] (-1 padded), q [N_sampled, V]"""
        ks = num_drafts.tolist()
        num_req, max_k = len(ks), max(ks, default=0)
        tokens = torch.full((num_req, max_k), -1, dtype=torch.int64, device=self.device)
        probs = [[] for _ in range(num_req)]
        active = torch.arange(num_req, device=self.device)
        seq_lens = batch.seq_lens
        prune = bool(((min_logp > -math.inf) | (expand_logp > -math.inf)).any())
        stop_logp = torch.maximum(min_logp, expand_logp)  # [B]
        path_logp = torch.zeros(num_req, dtype=torch.float64, device=self.device)  # [B]
        going = torch.ones(num_req, dtype=torch.bool, device=self.device)  # [B]
        for j in range(max_k):
            active = active[(num_drafts[active] > j) & going[active]]
            if active.numel() == 0:
                break
            if j > 0:  # feed back (own feature, previous draft) at position seq_len + j - 1
                step = self._single_token_batch(batch, active, tokens[active, j - 1], seq_lens[active] + j - 1)
                emb = nn.functional.embedding(step.input_ids, self.embed_tokens)
                last = last.clone()
                last[active] = self.head.step(emb, last[active], False, step, self.cache)
            positions = seq_lens[active] + j + 1  # [A] the target positions drafted
            logits = couple(self.logits(last[active]), active, positions)  # [A, V_draft]
            drafted, q = self._sample(logits, sampling.select(active), positions.tolist())
            tokens[active, j] = drafted
            if prune:  # path probability: greedy rows their argmax's, sampled rows their q's top
                sampled = sampling.sampled[active]  # [A]
                step_logp = torch.empty(active.shape[0], dtype=torch.float64, device=self.device)
                step_logp[~sampled] = torch.log_softmax(logits[~sampled].double(), -1).amax(-1)
                if q is not None:  # decided from q alone, before the draft: stays lossless
                    step_logp[sampled] = q[sampled].double().amax(-1).log()
                path_logp[active] += step_logp
                low = path_logp[active] < min_logp[active]
                tokens[active[low & (sampled | (j > 0))], j] = -1  # a greedy first draft stays
                going[active[path_logp[active] < stop_logp[active]]] = False
            for row, b in enumerate(active.tolist()):
                if q is not None and sampling.temperature[b] > 0 and tokens[b, j] >= 0:
                    probs[b].append(q[row])
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
        trees = [_Tree(int(batch.seq_lens[b]), topk[b], depth[b], num_nodes[b], lim[0])
                 for b, lim in zip(rows, limits)]
        self._add_children(trees, [-1] * len(trees), last[rows], couple, rows)
        for level in range(1, max(t.depth for t in trees)):
            active = [i for i, t in enumerate(trees)
                      if t.depth > level and t.best_score(level) >= max(limits[i])]
            if not active:
                break
            new_rows = [trees[i].expand(level, last[rows[i]]) for i in active]
            step = self._tree_batch(batch, [rows[i] for i in active], [trees[i] for i in active])
            emb = nn.functional.embedding(step.input_ids, self.embed_tokens)
            feats = torch.cat([torch.stack(trees[i].inputs) for i in active])
            out = self.head.step(emb, feats, False, step, self.cache)  # [sum E, H]
            ends = step.cu_seqlens[1:].tolist()
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
        ints = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        logits = couple(self.logits(features), ints(rows), ints(positions))
        logp = torch.log_softmax(logits.double(), dim=-1)  # [R, V_draft]
        values, ids = logp.topk(max(t.topk for t in trees), dim=-1)
        target_ids = self.to_target_ids(ids)
        for r, (tree, node) in enumerate(zip(trees, nodes)):
            k = tree.topk
            tree.add(node, target_ids[r, :k].tolist(), values[r, :k].tolist())

    def _tree_batch(self, batch: RaggedBatch, rows: list[int], trees: list["_Tree"]) -> RaggedBatch:
        """Every expanded node of each tree as a new token: stored at seq_len + e (e = order of
        expansion), RoPE position seq_len + depth - 1, seeing the context and its ancestors."""
        tables = batch.block_tables[rows]
        ids, positions, slots, cu, seq_lens = [], [], [], [0], []
        for b, tree in enumerate(trees):
            stored = range(tree.end, tree.end + len(tree.expanded))
            ids += [tree.tokens[c] for c in tree.expanded]
            positions += [tree.end + tree.depths[c] - 1 for c in tree.expanded]
            pages = tables[b, [p // self.page_size for p in stored]].tolist()
            slots += [page * self.page_size + p % self.page_size for page, p in zip(pages, stored)]
            cu.append(cu[-1] + len(stored))
            seq_lens.append(stored.stop)
        width = max(len(t.expanded) for t in trees)
        mask = torch.zeros((len(trees), width, width), dtype=torch.bool)
        for b, tree in enumerate(trees):
            n = len(tree.expanded)
            mask[b, :n, :n] = ancestor_mask(tree.expanded_parents())
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        return RaggedBatch(t(ids), t(positions), t(cu), t(seq_lens), tables, t(slots),
                           tree_mask=mask.to(self.device))

    def _sample(self, logits: torch.Tensor, s: RowSampling, positions: list[int]):
        """-> target ids [R], target-vocabulary q [R, V] (None if all greedy)"""
        # bf16 argmax is slow on CPU; coupled rows' float64 scores keep their precision
        draft_ids = (logits if logits.dtype == torch.float64 else logits.float()).argmax(dim=-1)
        if not bool(s.sampled.any()):
            return self.to_target_ids(draft_ids), None
        rows = s.sampled.nonzero().squeeze(1)
        rs = s.select(rows)
        q_draft = compute_probs(logits[rows], rs.temperature, rs.top_k, rs.top_p)
        q = self.to_target_probs(q_draft)
        draft_ids[rows] = sample(q_draft, rs.seeds.tolist(), [positions[r] for r in rows.tolist()], DRAFT)
        full_q = q.new_zeros((logits.shape[0], self.vocab_size))
        full_q[rows] = q
        return self.to_target_ids(draft_ids), full_q

    def _single_token_batch(self, batch: RaggedBatch, active: torch.Tensor, ids: torch.Tensor,
                            positions: torch.Tensor) -> RaggedBatch:
        tables = batch.block_tables[active]
        pages = tables.gather(1, (positions // self.page_size).unsqueeze(1)).squeeze(1)
        n = active.shape[0]
        return RaggedBatch(input_ids=ids, positions=positions,
                           cu_seqlens=torch.arange(n + 1, device=self.device),
                           seq_lens=positions + 1, block_tables=tables,
                           slot_mapping=pages * self.page_size + positions % self.page_size)


class _Coupling:
    """Coupled drafting of some sampled rows (DraftShapes.coupled): their logits are replaced by
    coupled_scores, so they draft as greedy rows do (argmax, trees, confidence limits) and
    carry no q; verification matches the drafts against the target's keyed samples."""

    def __init__(self, drafter: "Drafter", sampling: RowSampling, coupled: torch.Tensor):
        self.drafter, self.sampling, self.coupled = drafter, sampling, coupled  # coupled: [B] bool
        zero = torch.zeros_like(sampling.temperature)
        self.drafting = RowSampling(torch.where(coupled, zero, sampling.temperature),
                                    sampling.top_k, sampling.top_p, sampling.seeds)
        self._target_ids: torch.Tensor | None = None  # [V_draft] target id of each draft id

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """logits: [A, V_draft] of batch rows `rows` [A], drafting target positions [A] -> the
        same, coupled rows' replaced (float64 if any row is coupled)"""
        pick = self.coupled[rows].nonzero().squeeze(1)
        if pick.numel() == 0:
            return logits
        s = self.sampling.select(rows[pick])
        q = compute_probs(logits[pick], s.temperature, s.top_k, s.top_p)  # [P, V_draft]
        if self._target_ids is None:
            self._target_ids = self.drafter.to_target_ids(torch.arange(q.shape[1], device=q.device))
        out = logits.double()
        out[pick] = coupled_scores(q, self._target_ids, self.drafter.vocab_size, s.seeds.tolist(),
                                   positions[pick].tolist())
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
