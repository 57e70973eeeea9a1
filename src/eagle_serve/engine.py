"""The engine: continuous batching of EAGLE draft/verify rounds over all running requests.

One `step()` is one round for every running request:
  schedule  - reserve KV pages (target + drafter) for the round; admit waiting requests while
              pages allow; when pages run out, preempt the newest request (free everything,
              requeue, recompute later) instead of failing;
  verify    - one target forward over [uncomputed tokens + drafts] of every request (drafts
              of a tree attend to their ancestors only, at RoPE position prefix + depth);
  accept    - greedy: longest matching root-to-leaf path + the target's token; sampled:
              rejection sampling with the real draft probabilities -> 1..k+1 new tokens; roll
              back (the accepted path's KV moves to contiguous positions with the next forward);
  draft     - one drafter call catches up on the newly verified positions and proposes the
              next drafts of every speculative request: a chain of k, or (greedy requests with
              draft_topk > 1) an EAGLE-2 dynamic tree of k nodes.
A request with num_speculative_tokens = 0 goes through the same path without drafts: that is
the plain-decoding baseline. Sampled requests always draft chains (draft_topk is treated as 1),
which keeps rejection sampling exactly lossless. Randomness is keyed by (seed, position,
purpose), so a seeded request's output does not depend on its batch; a preempted request is
recomputed up to its last token and drafted again, so its round structure (and output) is the
same as without preemption.

Draft trees: k (num_speculative_tokens) is the number of nodes verified per round; a greedy
request with draft_topk > 1 drafts an EAGLE-2 tree of min(k, tree_capacity(topk, depth))
nodes, depth = draft_depth clamped to k (and to the tokens it may still emit). A tree pays
off while the verify pass has spare rows: in a round with more than max_tree_batch running
requests (when set), tree requests draft chains of their depth instead.

The engine knows token ids, pages and slots; the models behind `TargetRunner` and
`DrafterRunner` hold weights and KV tensors. The tokenizer is used only for stop strings.
"""
from __future__ import annotations

import itertools
import logging
import math
import random
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import torch

from eagle_serve.interfaces import (DrafterRunner, KVLost, ModelTimeout, RaggedBatch, RowSampling,
                                    TargetRunner, ancestor_mask, tree_depths)
from eagle_serve.kv_pages import PagePool
from eagle_serve.stopping import StopChecker
from eagle_serve.workspace import DraftWorkspace
from kernels.rejection import greedy_accept, greedy_tree_accept, random_accept


log = logging.getLogger(__name__)


class EngineBusy(RuntimeError):
    """The waiting queue is full."""


@dataclass(frozen=True)
class EngineConfig:
    num_speculative_tokens: int = 4   # k of requests that do not ask for one
    max_speculative_tokens: int = 8   # the largest k a request may ask for
    max_running: int = 8              # requests decoded together in one round
    max_waiting: int = 64             # queued requests beyond running; more -> EngineBusy
    max_model_len: int = 2048         # prompt + output tokens of one request
    page_size: int = 16
    num_target_pages: int = 256       # must match the target's cache
    num_drafter_pages: int = 256      # must match the drafter's cache
    num_draft_slots: int = 128        # draft tokens in flight (workspace slots)
    eos_token_ids: tuple[int, ...] = ()
    draft_topk: int = 1               # children per draft-tree node of requests that do not ask
    #                                   (1 = a chain of k)
    draft_depth: int = 0              # draft-tree levels of requests that do not ask (0 = k)
    max_draft_topk: int = 8
    max_draft_depth: int = 8
    max_tree_batch: int = 0           # trees are drafted while at most this many requests run;
    #                                   beyond, a tree request drafts a chain of its depth (0 = always)
    request_timeout_s: float = 0.0    # a request still unfinished this long after arrival fails
    #                                   (0 = no deadline)
    max_queue_time_s: float = 0.0     # a request waiting this long for admission fails (0 = no limit)
    max_stop_strings: int = 32        # stop strings of one request
    max_stop_bytes: int = 4096        # their total UTF-8 size

    def validate(self) -> None:
        if not 1 <= self.draft_topk <= self.max_draft_topk:
            raise ValueError(f"draft_topk must be in [1, {self.max_draft_topk}], got {self.draft_topk}")
        if not 0 <= self.draft_depth <= self.max_draft_depth:
            raise ValueError(f"draft_depth must be in [0, {self.max_draft_depth}] (0 = k), "
                             f"got {self.draft_depth}")
        if self.max_tree_batch < 0:
            raise ValueError(f"max_tree_batch must be >= 0 (0 = no limit), got {self.max_tree_batch}")


def tree_capacity(topk: int, depth: int) -> int:
    """Candidates an EAGLE-2 tree of this shape scores: topk at depth 1, topk^2 at each deeper
    level (the children of the topk expanded nodes)."""
    return topk + (depth - 1) * topk * topk if depth > 0 else 0


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    seed: int | None = None           # None = a random seed
    num_speculative_tokens: int | None = None  # None = the engine's default; 0 = plain decoding
    stop: tuple[str, ...] = ()        # stop strings, excluded from the output
    ignore_eos: bool = False
    draft_topk: int | None = None     # children per tree node; None = the engine's; 1 = chain
    draft_depth: int | None = None    # tree levels; None = the engine's

    def validate(self, max_k: int, max_topk: int = 8, max_depth: int = 8) -> None:
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (self.num_speculative_tokens is None or 0 <= self.num_speculative_tokens <= max_k,
             f"num_speculative_tokens must be in [0, {max_k}], got {self.num_speculative_tokens}"),
            (all(self.stop), "stop strings must not be empty"),
            (self.draft_topk is None or 1 <= self.draft_topk <= max_topk,
             f"draft_topk must be in [1, {max_topk}], got {self.draft_topk}"),
            (self.draft_depth is None or 1 <= self.draft_depth <= max_depth,
             f"draft_depth must be in [1, {max_depth}], got {self.draft_depth}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class RequestOutput:
    """What one step produced for one request; counters are running totals."""
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str          # "" until finished, then "length", "stop" or "cancelled"
    num_input_tokens: int
    num_output_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_rounds: int
    error: str = ""             # the request failed: a message for its client (finished, no reason)
    error_code: str = ""        # then: "INTERNAL" (a model call failed) or "UNAVAILABLE" (limits)
    cause: BaseException | None = field(default=None, repr=False)  # what failed (logged, not sent)


@dataclass(eq=False)  # identity: `req in self.running` must not compare fields
class _Request:
    id: str
    prompt_len: int
    params: SamplingParams
    k: int
    seed: int
    arrival: int
    stop: StopChecker | None
    tokens: list[int]
    topk: int = 1                   # draft-tree shape (1 = chain; sampled requests: 1)
    depth: int = 0                  # <= k
    num_computed: int = 0           # positions in the target's KV
    draft_computed: int = 0         # positions in the drafter's KV
    drafts: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)   # of each draft (-1 = the last token)
    kv_moves: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) target positions,
    #                                 applied by the next forward (the accepted tree path)
    draft_slots: list[int] = field(default_factory=list)
    target_pages: list[int] = field(default_factory=list)
    drafter_pages: list[int] = field(default_factory=list)
    num_sent: int = 0               # output tokens handed out
    finish_reason: str = ""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rounds: int = 0
    arrived_at: float = field(default_factory=time.monotonic)
    admitted: bool = False          # has run at least one round since it arrived
    suspect: bool = False           # was in a batch whose model call failed: runs alone until a
    #                                 round of its own succeeds
    error: str = ""                 # set when the request failed
    error_code: str = ""
    cause: BaseException | None = None

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    def sampling_row(self) -> tuple[float, int, float, int]:
        p = self.params
        return (p.temperature, p.top_k, p.top_p, self.seed)

    @property
    def is_tree(self) -> bool:
        """Drafts that are not a chain (-1, 0, 1, ...)."""
        return any(p != j - 1 for j, p in enumerate(self.parents))

    def drafter_scratch(self) -> int:
        """Drafter positions past the verified ones that one drafting round may write."""
        return max(self.k, self.topk * (self.depth - 1)) if self.topk > 1 else self.k


@dataclass
class EngineStats:
    steps: int = 0                    # batched rounds (one target forward each)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    preemptions: int = 0
    kv_moves: int = 0                 # target KV positions moved after accepting off a tree's
    #                                   first path
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)


class Engine:
    def __init__(self, target: TargetRunner, drafter: DrafterRunner | None, config: EngineConfig,
                 tokenizer=None, device="cpu"):
        config.validate()
        self.target, self.drafter, self.config, self.tokenizer = target, drafter, config, tokenizer
        self.device = torch.device(device)
        self.target_pool = PagePool(config.num_target_pages, config.page_size, "target")
        self.drafter_pool = PagePool(config.num_drafter_pages, config.page_size, "drafter")
        self.workspace = DraftWorkspace(config.num_draft_slots, target.vocab_size, device=device)
        k_max = config.max_speculative_tokens
        self.stats = EngineStats(accepted_per_position=[0] * k_max, drafted_per_position=[0] * k_max)
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self._inbox: deque = deque()
        self._lock = threading.Lock()
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self._pending_draft: list[tuple] = []  # (request, feature rows) left by step(defer_draft=True)

    # ---- requests in and out (thread-safe) ----

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; raises ValueError (bad request) or EngineBusy."""
        cfg = self.config
        params.validate(cfg.max_speculative_tokens if self.drafter else 0, cfg.max_draft_topk,
                        cfg.max_draft_depth)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.target.vocab_size
        bad = [i for i in prompt_ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"token ids must be in [0, {vocab}); got {bad[:8]}")
        k = cfg.num_speculative_tokens if params.num_speculative_tokens is None else params.num_speculative_tokens
        k = k if self.drafter else 0
        total = len(prompt_ids) + params.max_tokens
        if total > cfg.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len ({cfg.max_model_len})")
        if len(params.stop) > cfg.max_stop_strings:
            raise ValueError(f"at most {cfg.max_stop_strings} stop strings are allowed, got "
                             f"{len(params.stop)}")
        stop_bytes = sum(len(s.encode("utf-8")) for s in params.stop)
        if stop_bytes > cfg.max_stop_bytes:
            raise ValueError(f"stop strings may total at most {cfg.max_stop_bytes} bytes, got "
                             f"{stop_bytes}")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        stop = StopChecker(self.tokenizer, params.stop) if params.stop else None
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = _Request(request_id, len(prompt_ids), params, k, seed % (1 << 63), 0, stop,
                       list(prompt_ids))
        req.topk, req.depth = self._tree_shape(params, k)
        need = [(self.target_pool, total + k + 1)]
        if k:
            need.append((self.drafter_pool, total + req.drafter_scratch() + 1))
        if not all(pool.can_hold(n) for pool, n in need):
            raise ValueError(f"the request needs {max(n for _, n in need)} KV positions; the "
                             f"cache holds only {min(p.num_pages for p, _ in need) * cfg.page_size}")
        with self._lock:
            if len(self.waiting) + len(self._inbox) >= cfg.max_waiting:
                raise EngineBusy(f"server busy: {cfg.max_waiting} requests are already waiting")
            req.arrival = next(self._arrivals)
            self._inbox.append(("add", req))
        return request_id

    def _tree_shape(self, params: SamplingParams, k: int) -> tuple[int, int]:
        """-> (topk, depth) of the request's drafts: depth <= k; sampled requests draft chains
        of k (rejection sampling over a tree would need per-node draft distributions)."""
        cfg = self.config
        if params.temperature > 0 or k == 0:
            return 1, k
        topk = cfg.draft_topk if params.draft_topk is None else params.draft_topk
        depth = cfg.draft_depth if params.draft_depth is None else params.draft_depth
        return topk, min(depth or k, k)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._inbox)

    # ---- one round ----

    @torch.inference_mode()
    def step(self, defer_draft: bool = False) -> list[RequestOutput]:
        """One round: verify the running requests' drafts (or decode), accept, and draft the
        next round. With defer_draft the drafting is left to `draft()`, so a caller can stream
        this round's outputs while the drafter runs (the outputs do not depend on it); call
        `draft()` before the next step."""
        assert not self._pending_draft, "call draft() after step(defer_draft=True)"
        outputs: list[RequestOutput] = []
        self._drain_inbox(outputs)
        self._expire(outputs)
        self._schedule()
        work = []
        reqs = self._round_requests()
        if reqs:
            try:
                batch, logit_rows, sampling, plan, moves = self._target_batch(reqs)
                result = self.target.forward(batch, logit_rows, sampling,
                                             **({"kv_moves": moves} if moves else {}))
                self.stats.steps += 1
                emitted, paths = self._accept(result, plan)
                work = self._advance(result.hidden, plan, emitted, paths)
                for req in reqs:
                    if not req.k or req.finish_reason:  # a full round of its own: no drafting
                        req.suspect = False
            except KVLost:  # tokens verified so far stand; all KV is recomputed
                self._preempt_all()
            except ModelTimeout:
                raise
            except Exception as error:  # noqa: BLE001: a model call failed for this batch
                self._model_failed(reqs, "eagle_target", error)
        for req in list(self.running):
            out = self._output(req)
            if out is not None:
                outputs.append(out)
            if req.finish_reason or req.error:
                self._release(req)
                self.running.remove(req)
        self._pending_draft = work
        if not defer_draft:
            outputs += self.draft()
        return outputs

    @torch.inference_mode()
    def draft(self) -> list[RequestOutput]:
        """Propose the next round's drafts for the requests the last step advanced. -> outputs
        of requests that failed in the drafter call (usually none)."""
        running = {id(req) for req in self.running}  # none left since, unless failed
        work = [(req, rows) for req, rows in self._pending_draft if id(req) in running]
        self._pending_draft = []
        try:
            self._draft(work)
            for req, _ in work:
                req.suspect = False
        except KVLost:
            self._preempt_all()
        except ModelTimeout:
            raise
        except Exception as error:  # noqa: BLE001: a model call failed for this batch
            self._model_failed([req for req, _ in work], "eagle_drafter", error)
        failed = []
        for req in [r for r in self.running if r.error]:
            failed.append(self._output(req, force=True))
            self._release(req)
            self.running.remove(req)
        return failed

    def _round_requests(self) -> list[_Request]:
        """The requests verified this round: all running ones, or a suspect alone."""
        suspects = [r for r in self.running if r.suspect]
        return suspects[:1] if suspects else list(self.running)

    def _model_failed(self, reqs: list[_Request], model: str, error: Exception) -> None:
        """A model call failed for `reqs`. Alone, the request fails with a generic message (the
        details go to the log under an error id); in a batch, every request of it is recomputed
        and runs alone until one of its rounds succeeds, so only the culprit fails."""
        if len(reqs) == 1:
            error_id = uuid.uuid4().hex[:12]
            log.error("request %s failed in %s (error id %s): %s", reqs[0].id, model, error_id,
                      error, exc_info=error)
            reqs[0].error = (f"internal error while serving request {reqs[0].id} (error id "
                             f"{error_id}); the server log has the details")
            reqs[0].error_code, reqs[0].cause = "INTERNAL", error
            return
        log.warning("%s failed for a batch of %d requests (%s); retrying each alone", model,
                    len(reqs), error)
        for req in reqs:
            req.suspect = True
            if req in self.running:  # a partial forward may have written KV: recompute
                self._preempt(req)

    def _expire(self, outputs: list[RequestOutput]) -> None:
        """Fail requests past the queue-time limit or the request deadline."""
        cfg, now = self.config, time.monotonic()
        for queue in (self.waiting, self.running):
            for req in list(queue):
                age = now - req.arrived_at
                if cfg.max_queue_time_s and not req.admitted and age > cfg.max_queue_time_s:
                    req.error = (f"server busy: request {req.id} waited {age:.0f} s for a place "
                                 f"in the batch (max_queue_time_s {cfg.max_queue_time_s:g})")
                elif cfg.request_timeout_s and age > cfg.request_timeout_s:
                    req.error = (f"request {req.id} exceeded the server's deadline of "
                                 f"{cfg.request_timeout_s:g} s")
                else:
                    continue
                req.error_code = "UNAVAILABLE"
                self._release(req)
                queue.remove(req)
                outputs.append(self._output(req, force=True))

    def _preempt_all(self) -> None:
        for req in list(reversed(self.running)):
            self._preempt(req)

    def _drain_inbox(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            items, self._inbox = list(self._inbox), deque()
        for kind, item in items:
            if kind == "add":
                self.waiting.append(item)
                continue
            for queue in (self.running, self.waiting):
                for req in list(queue):
                    if req.id == item:
                        req.finish_reason = "cancelled"
                        self._release(req)
                        queue.remove(req)
                        outputs.append(self._output(req, force=True))

    def _need(self, req: _Request) -> tuple[int, int]:
        """KV positions this round may touch: target (tokens + drafts), drafter (+ the next
        drafts' scratch)."""
        n = len(req.tokens) + len(req.drafts)
        return n, (n + req.drafter_scratch() if req.k else 0)

    def _reserve(self, req: _Request) -> bool:
        t, d = self._need(req)
        return self.target_pool.grow(req.target_pages, t) and self.drafter_pool.grow(req.drafter_pages, d)

    def _schedule(self) -> None:
        for req in sorted(self.running, key=lambda r: r.arrival):
            while req in self.running and not self._reserve(req):
                self._preempt(self.running[-1])
        while self.waiting and len(self.running) < self.config.max_running:
            req = self.waiting[0]
            if not self._reserve(req):
                self._release(req)
                break
            self.running.append(self.waiting.popleft())
            req.admitted = True
        self.running.sort(key=lambda r: r.arrival)

    def fail_all(self) -> list[str]:
        """Drop every request (after an unrecoverable model error); -> their ids."""
        with self._lock:
            dropped = [item.id for kind, item in self._inbox if kind == "add"]
            self._inbox.clear()
        for req in self.running + list(self.waiting):
            self._release(req)
            dropped.append(req.id)
        self.running, self.waiting, self._pending_draft = [], deque(), []
        return dropped

    def _preempt(self, req: _Request) -> None:
        """Free everything and requeue; the request is recomputed when readmitted."""
        self._release(req)
        req.num_computed = req.draft_computed = 0
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.waiting = deque(sorted(self.waiting, key=lambda r: r.arrival))
        self.stats.preemptions += 1

    def _release(self, req: _Request) -> None:
        self.target_pool.release(req.target_pages)
        self.drafter_pool.release(req.drafter_pages)
        self.workspace.free(req.draft_slots)
        req.drafts, req.draft_slots, req.parents = [], [], []
        req.kv_moves = []  # with the pages gone, those positions are recomputed

    # ---- verify ----

    def _target_batch(self, reqs: list[_Request]):
        """Rows of each request: tokens it has not computed + its drafts (node i stored at
        position len(tokens) + i, RoPE position len(tokens) - 1 + depth_i). A request that was
        preempted after emitting tokens recomputes all but its last token and samples nothing.
        -> batch, logit rows, their sampling, plan, pending KV moves (src, dst slots) or None"""
        ids, positions, cu, seq_lens, slots, logit_rows, rows_sampling, plan = [], [], [0], [], [], [], [], []
        shapes, src, dst = [], [], []
        for req in reqs:
            start = req.num_computed
            resume = len(req.output) > 0 and start < len(req.tokens) - 1
            real = req.tokens[start:len(req.tokens) - 1 if resume else len(req.tokens)]
            new = real + req.drafts
            ids += new
            positions += range(start, start + len(real))
            positions += [len(req.tokens) - 1 + d for d in tree_depths(req.parents)]
            slots += [self.target_pool.slot(req.target_pages, p) for p in range(start, start + len(new))]
            n_logits = 0 if resume else 1 + len(req.drafts)
            logit_rows += range(cu[-1] + len(new) - n_logits, cu[-1] + len(new))
            rows_sampling += [req.sampling_row()] * n_logits
            plan.append((req, cu[-1], len(real), n_logits))
            cu.append(cu[-1] + len(new))
            seq_lens.append(start + len(new))
            shapes.append((len(real), req.parents))
            for a, b in req.kv_moves:
                src.append(self.target_pool.slot(req.target_pages, a))
                dst.append(self.target_pool.slot(req.target_pages, b))
            req.kv_moves = []
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        tree_mask = None
        if any(req.is_tree for req in reqs):
            masks = [self._verify_mask(n, parents) for n, parents in shapes]
            width = max(m.shape[0] for m in masks)
            tree_mask = torch.zeros((len(masks), width, width), dtype=torch.bool)
            for b, m in enumerate(masks):
                tree_mask[b, :m.shape[0], :m.shape[0]] = m
            tree_mask = tree_mask.to(self.device)
        batch = RaggedBatch(t(ids), t(positions), t(cu), t(seq_lens),
                            self._tables([r.target_pages for r in reqs]), t(slots),
                            tree_mask=tree_mask)
        moves = (t(src), t(dst)) if src else None
        return batch, t(logit_rows), self._row_sampling(rows_sampling), plan, moves

    @staticmethod
    def _verify_mask(num_real: int, parents: list[int]) -> torch.Tensor:
        """[n, n] bool over a request's rows: causal, but a draft sees only its ancestors."""
        n = num_real + len(parents)
        mask = torch.ones((n, n), dtype=torch.bool).tril()
        mask[num_real:, num_real:] = ancestor_mask(parents)
        return mask

    def _tables(self, tables: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(t) for t in tables))
        return torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int64,
                            device=self.device)

    def _row_sampling(self, rows: list[tuple]) -> RowSampling:
        temp, top_k, top_p, seeds = zip(*rows) if rows else ((), (), (), ())
        return RowSampling(torch.tensor(temp, dtype=torch.float32, device=self.device),
                           torch.tensor(top_k, dtype=torch.int64, device=self.device),
                           torch.tensor(top_p, dtype=torch.float32, device=self.device),
                           torch.tensor(seeds, dtype=torch.int64, device=self.device))

    def _accept(self, result, plan) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """-> emitted tokens per request id (requests that sampled nothing are absent), and the
        accepted draft nodes (the path, in order) per request id."""
        emitted: dict[str, list[int]] = {}
        paths: dict[str, list[int]] = {}
        row, prob_row = 0, 0
        greedy, sampled = [], []
        for req, _, _, n_logits in plan:
            if n_logits == 0:
                continue
            rows = slice(row, row + n_logits)
            row += n_logits
            if req.greedy:
                greedy.append((req, result.argmax[rows]))
            else:
                sampled.append((req, result.probs[prob_row:prob_row + n_logits]))
                prob_row += n_logits
        if greedy:
            reqs = [r for r, _ in greedy]
            drafts, cu = self._flat_drafts(reqs)
            argmax = torch.cat([a for _, a in greedy])
            if any(r.is_tree for r in reqs):
                parents = torch.tensor([p for r in reqs for p in r.parents], dtype=torch.int64)
                out, num, path = greedy_tree_accept(drafts, parents, cu, argmax)
                for i, req in enumerate(reqs):
                    paths[req.id] = path[i, :num[i] - 1].tolist()
            else:
                out, num = greedy_accept(drafts, cu, argmax)
            for i, req in enumerate(reqs):
                emitted[req.id] = out[i, :num[i]].tolist()
        if sampled:
            reqs = [r for r, _ in sampled]
            drafts, cu = self._flat_drafts(reqs)
            q = self.workspace.load([s for r in reqs for s in r.draft_slots]) if len(drafts) else \
                torch.zeros((0, self.target.vocab_size), device=self.device)
            out, num = random_accept(drafts, cu, torch.cat([p for _, p in sampled]), q,
                                     [r.seed for r in reqs], [len(r.tokens) for r in reqs])
            for i, req in enumerate(reqs):
                emitted[req.id] = out[i, :num[i]].tolist()
        for rid, tokens in emitted.items():
            paths.setdefault(rid, list(range(len(tokens) - 1)))  # chains: the first drafts
        return emitted, paths

    def _flat_drafts(self, reqs: list[_Request]) -> tuple[torch.Tensor, torch.Tensor]:
        lens = [len(r.drafts) for r in reqs]
        cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int64, device=self.device)
        drafts = torch.tensor([d for r in reqs for d in r.drafts], dtype=torch.int64, device=self.device)
        return drafts, cu

    def _advance(self, hidden: torch.Tensor, plan, emitted, paths) -> list[tuple]:
        """Append accepted tokens, roll back KV, update stats. The accepted path's KV (node i
        at position L + i) belongs at L + depth - 1: those moves go with the next forward, so
        the pages holding their sources stay until then. -> drafter work per request:
        (request, feature rows [n, F]: real rows, then the path's rows in path order)."""
        work = []
        for req, first_row, num_real, _ in plan:
            tokens = emitted.get(req.id)
            path = paths.get(req.id, [])
            if tokens is not None:
                self._count_round(req, len(path))
                self._append(req, tokens)
            base = req.num_computed + num_real  # position of draft node 0
            req.num_computed = base + len(path)
            req.kv_moves = [(base + i, base + j) for j, i in enumerate(path) if i != j]
            self.stats.kv_moves += len(req.kv_moves)
            self.workspace.free(req.draft_slots)
            req.drafts, req.draft_slots, req.parents = [], [], []
            keep = max([req.num_computed] + [a + 1 for a, _ in req.kv_moves])
            self.target_pool.shrink(req.target_pages, keep)
            if req.k and not req.finish_reason:
                rows = list(range(first_row, first_row + num_real))
                rows += [first_row + num_real + i for i in path]
                work.append((req, hidden[torch.tensor(rows, dtype=torch.int64, device=hidden.device)]))
        return work

    def _count_round(self, req: _Request, accepted: int) -> None:
        """accepted = length of the accepted path; per-position counters count by depth."""
        offered = max(tree_depths(req.parents), default=0)  # deepest draft (a chain: k)
        req.num_rounds += 1
        req.num_draft_tokens += len(req.drafts)
        req.num_accepted_tokens += accepted
        s = self.stats
        s.rounds += 1
        s.draft_tokens += len(req.drafts)
        s.accepted_tokens += accepted
        for j in range(offered):
            s.drafted_per_position[j] += 1
            s.accepted_per_position[j] += int(j < accepted)

    def _append(self, req: _Request, tokens: list[int]) -> None:
        p = req.params
        for tok in tokens:
            req.tokens.append(tok)
            if tok in self.config.eos_token_ids and not p.ignore_eos:
                req.finish_reason = "stop"
            elif len(req.output) >= p.max_tokens:
                req.finish_reason = "length"
            if req.finish_reason:
                break
        if req.stop is not None and req.stop.check(req.output):
            keep = req.stop.keep
            del req.tokens[req.prompt_len + keep:]
            req.finish_reason = "stop"

    # ---- draft ----

    def _draft(self, work: list[tuple]) -> None:
        if not work or self.drafter is None:
            return
        ids, positions, cu, seq_lens, slots, feats, shapes = [], [], [0], [], [], [], []
        limit = self.config.max_tree_batch
        trees_allowed = limit == 0 or len(self.running) <= limit
        for req, rows in work:
            start, end = req.draft_computed, req.num_computed
            assert rows.shape[0] == end - start, "drafter fell behind the target"
            left = min(req.params.max_tokens - len(req.output) - 1,
                       self.config.max_model_len - len(req.tokens))
            shapes.append(self._draft_shape(req, left, trees_allowed))
            ids += req.tokens[start + 1:end + 1]
            positions += range(start, end)
            slots += [self.drafter_pool.slot(req.drafter_pages, p) for p in range(start, end)]
            feats.append(rows)
            cu.append(cu[-1] + end - start)
            seq_lens.append(end)
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        batch = RaggedBatch(t(ids), t(positions), t(cu), t(seq_lens),
                            self._tables([r.drafter_pages for r, _ in work]), t(slots))
        sampling = self._row_sampling([r.sampling_row() for r, _ in work])
        ks, topks, depths = (list(x) for x in zip(*shapes))
        trees = {"topk": t(topks), "depth": t(depths)} if max(topks) > 1 else {}
        out = self.drafter.propose(batch, torch.cat(feats), t(ks), sampling, **trees)
        prob_row = 0
        for i, (req, _) in enumerate(work):
            req.draft_computed = req.num_computed
            self.drafter_pool.shrink(req.drafter_pages, req.draft_computed)
            drafts = out.tokens[i, :ks[i]].tolist()
            drafts = drafts[:drafts.index(-1)] if -1 in drafts else drafts  # fewer nodes
            parents = (out.parents[i, :len(drafts)].tolist() if out.parents is not None
                       else list(range(-1, len(drafts) - 1)))
            slots = self.workspace.alloc(len(drafts))
            if not req.greedy:
                q = out.probs[prob_row:prob_row + len(drafts)]
                prob_row += len(drafts)
                if slots is not None:
                    self.workspace.store(slots, q)
            if slots is not None:  # no free slots: this round verifies no drafts
                req.drafts, req.draft_slots, req.parents = drafts, slots, parents

    @staticmethod
    def _draft_shape(req: _Request, left: int, trees_allowed: bool = True) -> tuple[int, int, int]:
        """-> (nodes, topk, depth) of this round's drafts; `left` = tokens the request may still
        add after the next one. A tree of depth D scores tree_capacity(topk, D) candidates and
        keeps the best min(k, that) of them; depth is clamped to `left` (a chain: k too). When
        trees are not allowed this round (a full batch), a tree request drafts a chain of D."""
        depth = max(0, min(req.depth, left))
        if req.topk > 1 and depth > 0 and trees_allowed:
            return min(req.k, tree_capacity(req.topk, depth)), req.topk, depth
        return depth, 1, depth

    # ---- results ----

    def _output(self, req: _Request, force: bool = False) -> RequestOutput | None:
        if req.error:
            return RequestOutput(req.id, [], True, "", req.prompt_len, len(req.output),
                                 req.num_draft_tokens, req.num_accepted_tokens, req.num_rounds,
                                 error=req.error, error_code=req.error_code, cause=req.cause)
        upto = len(req.output)
        if req.stop is not None and not req.finish_reason:
            upto = req.stop.safe_upto(req.output)
        new = req.output[req.num_sent:upto]
        if not new and not req.finish_reason and not force:
            return None
        req.num_sent += len(new)
        return RequestOutput(req.id, new, bool(req.finish_reason), req.finish_reason,
                             req.prompt_len, len(req.output), req.num_draft_tokens,
                             req.num_accepted_tokens, req.num_rounds)

    # ---- convenience ----

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list["Completion"]:
        """Run requests to completion (library use and tests); a request that fails raises what
        made it fail."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        done: dict[str, Completion] = {i: Completion([], "", None) for i in ids}
        while any(not c.finish_reason for c in done.values()):
            for out in self.step():
                if out.error:
                    raise (out.cause or RuntimeError(out.error))
                c = done[out.request_id]
                c.token_ids += out.new_token_ids
                c.finish_reason, c.last = out.finish_reason, out
        return [done[i] for i in ids]

    def idle_counts(self) -> dict[str, int]:
        return {"target_pages_free": self.target_pool.num_free,
                "drafter_pages_free": self.drafter_pool.num_free,
                "draft_slots_free": self.workspace.num_free}


@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str
    last: RequestOutput | None

    @property
    def acceptance_length(self) -> float:
        o = self.last
        return (o.num_accepted_tokens + o.num_rounds) / max(1, o.num_rounds)
