"""The draft policy: what each request drafts each round (eagle_serve.spec.proposals runs it).

`DraftPolicy` is the one home of the rules: whether a sampled request's drafts are verified
by coupling or by rejection sampling (`sampled_verify`), a request's tree shape (draft_topk x
draft_depth, k nodes; rejection-sampled requests and k = 0 draft chains, coupled ones
coupled_draft_topk wide trees), what a round may draft (depth clamped to the tokens the
request may still emit; a chain of the tree's depth when more than `max_tree_batch`
requests run), the confidence limits on greedy drafts, and the model-free sources: a greedy
request's tree also gets the continuations looked up in its own tokens and in the corpus of the
target's answers (eagle_serve.spec.lookup) as extra branches, merged where they agree with the head's;
a sampled request's head chain gets them too, as one-hot proposals. Every draft must be likely
enough to pay for its verify row (`_row_prob`): the head's by its path probability, a lookup's
by the acceptance the process measured for drafts like it (eagle_serve.spec.lookup_scores).
Each request's measured acceptance decides whether the head's drafting pays (`best_chain`, with
the costs measured on this machine as the server runs (eagle_serve.spec.costs), or the static
draft_call_cost, draft_step_cost and draft_batch_cost: verify rows cost more in a fuller batch):
chains take the length it pays for, and a request whose drafts do not pay drafts nothing and
skips the drafter call until a probe round (none where its drafts could not pay even if nearly
always accepted); beyond max_draft_batch running requests (max_sampled_draft_batch for
sampled ones) nothing is drafted.
The drafter only executes the shapes it is sent, row by row; verification and acceptance do not
depend on the policy, so whatever is drafted, the output is the target's.
"""
from __future__ import annotations

from dataclasses import dataclass

from eagle_serve.core.requests import AcceptanceRecord, Request, SamplingParams
from eagle_serve.settings import EngineConfig
from eagle_serve.spec.costs import MeasuredCosts
from eagle_serve.spec.lookup import CONTEXT_MIN_MATCH, CORPUS_MIN_PROB, ContextIndex, CorpusIndex
from eagle_serve.spec.lookup_scores import LookupKey, LookupScores


def tree_capacity(topk: int, depth: int) -> int:
    """Candidates an EAGLE-2 tree of this shape scores: topk at depth 1, topk^2 at each deeper
    level (the children of the topk expanded nodes)."""
    return topk + (depth - 1) * topk * topk if depth > 0 else 0


@dataclass(frozen=True)
class Branch:
    """A lookup branch of a round's draft tree, from the root: the head's path it continues
    (keys None), then the looked-up tokens."""
    tokens: list[int]
    source: str
    keys: list[LookupKey | None]


@dataclass(frozen=True)
class RoundShape:
    """What one request drafts in one round."""
    nodes: int            # drafts verified (a chain: its length)
    topk: int             # children per tree node (1 = chain)
    depth: int            # levels
    min_prob: float       # greedy drafts below this path probability are dropped (0 = off)
    expand_prob: float    # draft a level deeper only under a draft this likely (0 = off)


# A request's acceptance estimate starts at ACCEPT_PRIOR, counted as PRIOR_WEIGHT reached drafts
# (a prior from the server's acceptance of the same kind of drafts ran sampled requests alone at
# 1.10x plain against 1.12x with this one, greedy alike, in process, alternating per prompt);
# a request whose drafts do not pay drafts nothing, and one draft again after PROBE_EVERY rounds
# (twice as long after each probe that did not pay, up to MAX_PROBE_WAIT rounds), and no sooner
# than keeps its probes under PROBE_BUDGET of the batch's time: a probe costs the whole batch a
# drafter call, which first catches up on every position since the request's last one, and a
# verify row. Where a drafter call costs about a plain round (fp32 on the GGUF blocks, 2 cores),
# probes every 4-32 rounds ran greedy 128-token requests at 1.12x plain decoding alone and 0.94x
# at 4 streams, against 1.20x and 1.01x with no probes (one server each, interleaved runs).
ACCEPT_PRIOR, PRIOR_WEIGHT, PROBE_EVERY, MAX_PROBE_WAIT, PROBE_BUDGET = 0.5, 4.0, 4, 32, 0.02
# A request probes only where its drafts would pay were they accepted PROBE_RATE of the time:
# where even that would not pay (dear rows beside other requests), a probe only costs (a drafter
# call that catches up on every position since the last, and a row). In process on the AVX-512
# build (eagle-serve bench engine --concurrency 4 / 8): 1.03x / 0.97x plain decoding, against 1.01x /
# 0.97x probing there too, within drift; the probes' catch-up calls are gone.
PROBE_RATE = 0.9
# With measured costs, a tree must promise MEASURED_MARGIN more than plain decoding (a share of
# its speed), costed as one draft though it verifies several (greedy alone, 128 tokens: tau 2.01
# and 1.32x without the margin, tau 1.77 and 1.39x with it), and beside other requests any draft
# BATCH_MARGIN more: acceptance estimates are noisy and a batch's round has costs no timer sees,
# so a draft that only breaks even loses whenever the estimate was high (greedy, 4 streams, in
# process on the AVX-512 build: 0.94-0.98x plain with 0.1, 0.98x with 0.2, drafting a seventh as
# much). A chain alone drafts whatever its measured costs pay for (sampled alone, 128 tokens:
# 1.05x plain with the margin, 1.09x without).
MEASURED_MARGIN, BATCH_MARGIN = 0.1, 0.2


def best_chain(rate: float, max_depth: int, call_cost: float, step_cost: float,
               margin: float = 0.0) -> int:
    """The chain length in [0, max_depth] with the most expected tokens per unit of cost: with d
    drafts, each accepted with probability `rate` once those before it were, a round emits
    1 + rate + ... + rate^d tokens and costs 1 + call_cost + d * step_cost plain rounds
    (d = 0: one plain round); a chain is chosen only above 1 + margin tokens per plain round."""
    best, best_gain, tokens, cost = 0, 1.0 + margin, 1.0, 1.0 + call_cost
    for d in range(1, max_depth + 1):
        tokens, cost = tokens + rate ** d, cost + step_cost
        if tokens / cost > best_gain:
            best, best_gain = d, tokens / cost
    return best


class DraftPolicy:
    def __init__(self, config: EngineConfig, corpus: CorpusIndex | None = None):
        self.config, self.corpus = config, corpus
        self.costs = MeasuredCosts()  # the engine and propose_drafts record into it
        self.lookup_scores = LookupScores()  # verification records every request's lookups

    def default_k(self, params: SamplingParams, has_drafter: bool) -> int:
        if not has_drafter:
            return 0
        k = params.num_speculative_tokens
        return self.config.drafting.num_speculative_tokens if k is None else k

    def setup_request(self, req: Request) -> None:
        """A new request's verification rule (`coupled`), draft shape and lookup sources."""
        req.coupled = self.coupled(req.params)
        req.topk, req.depth = self.request_shape(req.params, req.k, req.coupled)
        self.setup_lookup(req)

    def coupled(self, params: SamplingParams) -> bool:
        """Whether a request's drafts are verified by coupling (`sampled_verify`): every sampled
        request under "coupled"; under "auto" the sampled requests that give a seed: their
        output is then plain seeded sampling's whatever is drafted, so their drafts may follow
        the load and the measured costs as an unseeded request's do."""
        mode = self.config.drafting.sampled_verify
        return params.temperature > 0 and (
            mode == "coupled" or (mode == "auto" and params.seed is not None))

    def request_shape(self, params: SamplingParams, k: int, coupled: bool = False) -> tuple[int, int]:
        """-> (topk, depth) of a request's drafts: depth <= k; sampled requests draft chains of
        sampled_draft_depth from the head (a head tree would need several draws per node;
        deeper chains of a weak head cost more drafter steps than they win), beside their
        lookup branches; a coupled one drafts a tree (its drafts are guesses at one token, as a
        greedy request's are) of coupled_draft_topk x sampled_draft_depth, or of its own
        draft_topk x draft_depth."""
        cfg = self.config
        if k == 0:
            return 1, 0
        if params.temperature > 0 and not (coupled and params.draft_topk is not None):
            topk = cfg.drafting.coupled_draft_topk if coupled else 1
            return topk, min(params.draft_depth or cfg.drafting.sampled_draft_depth, k)
        topk = cfg.drafting.draft_topk if params.draft_topk is None else params.draft_topk
        depth = cfg.drafting.draft_depth if params.draft_depth is None else params.draft_depth
        return topk, min(depth or k, k)

    def setup_lookup(self, req: Request) -> None:
        """Speculative requests get lookup branches (each source: at most lookup_tokens drafts
        beyond the head's k). A sampled request's lookups are proposals with a one-hot q,
        verified by recursive rejection sampling (kernels.rejection.random_tree_accept_ref)."""
        p, n = req.params, self.lookup_tokens(req)
        if not (req.k and n):
            return
        sources = int(p.context_lookup) + int(p.corpus_lookup and self.corpus is not None)
        req.lookup_budget, req.lookup_scores = sources * n, self.lookup_scores
        if p.context_lookup:
            req.context = ContextIndex(min_n=CONTEXT_MIN_MATCH)

    def lookups(self, req: Request, left: int, batch_size: int, head_path: list[int] = ()
                ) -> list[Branch]:
        """The request's lookup branches this round: continuations of its tokens, and of its
        tokens + the head's most likely path (so a confident head's path goes deeper), each
        source at most lookup_tokens long (sampled requests: sampled_lookup_tokens), cut after
        its last token likely enough to pay for its verify row (`_row_prob`; the chance of each
        from `lookup_scores`, after the head's path times the head's acceptance per draft of
        it), every branch at most `left` deep (longest first); none where the request may not
        draft at all (`_over_draft_batch`)."""
        cfg = self.config
        depth = min(left, cfg.drafting.max_speculative_tokens)
        if not req.lookup_budget or depth <= 0 or self._over_draft_batch(req, batch_size):
            return []
        floor, measured = self._row_prob(req, batch_size), not _seeded_rejection(req)
        head_rate = req.acceptance.rate(ACCEPT_PRIOR, PRIOR_WEIGHT)
        found = []
        for prefix in ([], list(head_path))[:1 + bool(head_path)]:
            limit = min(self.lookup_tokens(req), depth - len(prefix))
            if limit <= 0:
                continue
            proposed = []
            if req.context is not None:
                proposed.append(req.context.propose(req.tokens, limit, after=prefix))
            if req.params.corpus_lookup and self.corpus is not None:
                proposed.append(self.corpus.propose(req.tokens[-self.corpus.max_match:] + prefix,
                                                    limit, CORPUS_MIN_PROB))
            reach = head_rate ** len(prefix)
            for p in filter(None, proposed):
                keys = LookupScores.keys(p, req.rule)
                chances = self.lookup_scores.chances(keys, measured)
                n = sum(reach * c >= floor for c in chances)  # chances only fall along it
                if n:
                    found.append(Branch(prefix + p.tokens[:n], p.source, [None] * len(prefix) + keys[:n]))
        return sorted(found, key=lambda b: -len(b.tokens))

    def lookup_tokens(self, req: Request) -> int:
        cfg = self.config
        return cfg.drafting.lookup_tokens if req.greedy else cfg.drafting.sampled_lookup_tokens

    def _trees_allowed(self, batch_size: int) -> bool:
        limit = self.config.drafting.max_tree_batch
        return limit == 0 or batch_size <= limit

    def _over_draft_batch(self, req: Request, batch_size: int) -> bool:
        """More requests run than the request may draft beside (max_draft_batch; sampled ones
        max_sampled_draft_batch; 0 = no limit), its load being `_load`'s."""
        cfg = self.config
        limit = cfg.drafting.max_draft_batch if req.greedy else cfg.drafting.max_sampled_draft_batch
        return bool(limit) and _load(req, batch_size) > limit

    def round_shape(self, req: Request, left: int, batch_size: int) -> RoundShape:
        """`left` = tokens the request may still add after the next one. A tree of depth D
        scores tree_capacity(topk, D) candidates and keeps the best min(k, that); depth is
        clamped to `left` (a chain: k too). With more than max_tree_batch requests running, a
        tree request drafts a chain of its depth."""
        cfg = self.config
        depth = self._paying_depth(req, max(0, min(req.depth, left)), batch_size)
        if depth == 0:
            return RoundShape(0, 1, 0, 0.0, 0.0)
        pruning = (self._row_prob(req, batch_size), cfg.drafting.draft_expand_prob if req.greedy else 0.0)
        if req.topk > 1 and self._trees_allowed(batch_size):
            return RoundShape(min(req.k, tree_capacity(req.topk, depth)), req.topk, depth, *pruning)
        return RoundShape(depth, 1, depth, *pruning)

    def _paying_depth(self, req: Request, depth: int, batch_size: int) -> int:
        """The depth the request's measured acceptance pays for: a chain the best length up to
        `depth` (`best_chain`; the drafter call's cost is shared by the running requests, and
        each draft costs more the more requests run), a tree all or
        nothing (its confidence limits already prune it). A request drafting nothing drafts one
        again after a while (`_probe`), to measure again. A request that sets its draft_depth
        gets that depth. Nothing is drafted while more than max_draft_batch requests run
        (sampled requests: max_sampled_draft_batch), and a request's load is `_load`'s."""
        cfg = self.config
        load = _load(req, batch_size)
        if self._over_draft_batch(req, batch_size):
            return 0
        fixed = req.params.draft_depth is not None
        if depth == 0 or fixed or not (cfg.drafting.draft_call_cost or cfg.drafting.draft_step_cost):
            return depth
        tree = req.topk > 1 and self._trees_allowed(batch_size)
        rate = req.acceptance.rate(ACCEPT_PRIOR, PRIOR_WEIGHT)
        call, step, margin = self._costs(req, load, tree)
        best = best_chain(rate, 1 if tree else depth, call, step, margin)
        if best == 0:
            hopeless = best_chain(PROBE_RATE, 1 if tree else depth, call, step, margin) == 0
            return 0 if hopeless else _probe(req.acceptance, load * call + step)
        req.acceptance.probes = 0
        return depth if tree else best

    def _row_prob(self, req: Request, batch_size: int) -> float:
        """The least chance of acceptance at which a draft is worth its verify row: a row costs
        `step` plain rounds, so it pays when it brings at least step x (1 + margin) tokens
        (never below draft_min_prob; sampled requests: sampled_draft_min_prob). Where rows are
        dear (fp32 on 2 CPU cores: a fifth of a plain round each alone, half of it beside three
        others) this keeps trees and lookup branches to the drafts likely enough to pay."""
        cfg = self.config
        least = cfg.drafting.draft_min_prob if req.greedy else cfg.drafting.sampled_draft_min_prob
        if not (cfg.drafting.draft_call_cost or cfg.drafting.draft_step_cost):
            return least
        _, step, margin = self._costs(req, _load(req, batch_size))
        return max(least, step * (1.0 + margin))

    def _costs(self, req: Request, load: int, tree: bool = False) -> tuple[float, float, float]:
        """(drafter call, one draft, margin) as shares of a plain round for this request:
        measured on this machine (eagle_serve.spec.costs) once enough rounds ran (the call once
        enough drafter calls ran), with BATCH_MARGIN beside other requests and MEASURED_MARGIN
        for a tree alone; else the static settings (one drafter call serves every drafting
        request of the round, so each bears a share of it; verify rows cost more in a fuller
        batch). A seeded rejection-sampled request always gets the static ones, so its drafts
        never depend on timings."""
        cfg = self.config
        measured = None
        if cfg.drafting.measured_draft_costs and not _seeded_rejection(req):
            measured = self.costs.shares(load)
        call = cfg.drafting.draft_call_cost / load
        if measured is None:
            return call, cfg.drafting.draft_step_cost + cfg.drafting.draft_batch_cost * (load - 1), 0.0
        margin = BATCH_MARGIN if load > 1 else MEASURED_MARGIN if tree else 0.0
        return call if measured.call is None else measured.call, measured.step, margin


def _probe(record: AcceptanceRecord, cost: float) -> int:
    """A request whose drafts do not pay: 1 (one probe draft, to measure again) once it has
    been idle PROBE_EVERY rounds, doubled after each probe that did not pay (up to
    MAX_PROBE_WAIT), and at least cost / PROBE_BUDGET rounds (cost: what every running
    request's probe costs the batch, in plain rounds), else 0. Called once a round."""
    wait = max(min(PROBE_EVERY << record.probes, MAX_PROBE_WAIT), cost / PROBE_BUDGET)
    if record.idle_rounds < wait:
        return 0
    record.probes += 1
    return 1


def _seeded_rejection(req: Request) -> bool:
    """A seeded request verified by rejection sampling: its output depends on its drafts, so
    they must depend on its own history only (a coupled one's output does not depend on its
    drafts at all)."""
    return not req.matched and req.params.seed is not None


def _load(req: Request, batch_size: int) -> int:
    """The batch size a request's policy sees: a seeded rejection-sampled request is costed as
    if alone, so that its output depends on its own history only, not on other traffic."""
    return 1 if _seeded_rejection(req) else batch_size
