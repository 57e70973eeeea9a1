"""Which requests run each round, and the resources they hold.

The scheduler owns the waiting queue and the running batch, the KV page pools of target and
drafter, and the draft-token workspace. Each round it reserves the pages the running requests
may touch, preempting the newest running request when pages run out (it frees everything and
is recomputed when readmitted: its tokens stand), then admits waiting requests in arrival order
while pages and `max_running` allow; a request admitted without pages first maps the cached
pages of its prefix (eagle_serve.core.prefix_cache). Chunked prefill: a round computes at most
`max_num_batched_tokens` rows, the running requests' decode and verify rows first, then the
uncomputed tokens of prompts (or recomputes) in arrival order, so a long prompt is computed over
several rounds while the other streams go on. It also retires requests: finished, cancelled, expired
(queue time, deadline) or failed. After a model call failed for a batch, the requests of that
batch are `suspect`: each runs alone (the others wait) until a round of its own verified its
drafts, so a request that breaks a model call fails alone (a failure that only a batch
brings about fails its requests after a few isolations: engine.MAX_ISOLATIONS).
"""
from __future__ import annotations

import time
from collections import deque

from eagle_serve.core.kv_pages import PagePool
from eagle_serve.core.prefix_cache import PrefixCache
from eagle_serve.core.requests import Request
from eagle_serve.core.workspace import DraftWorkspace
from eagle_serve.settings import EngineConfig

# Prompt tokens a round computes of a request that wants their logprobs: each costs a [V] row
# of log-softmax through the target's output (~200 KB at V = 49k), so a round moves ~13 MB.
PROMPT_LOGPROBS_CHUNK = 64


class Scheduler:
    def __init__(self, config: EngineConfig, workspace: DraftWorkspace, stats):
        """stats: the engine's EngineStats (preemptions are counted there)."""
        self.config, self.stats = config, stats
        self.target_pool = PagePool(config.cache.num_target_pages, config.cache.page_size, "target")
        self.drafter_pool = PagePool(config.cache.num_drafter_pages, config.cache.page_size, "drafter")
        self.prefix = PrefixCache(self.target_pool, self.drafter_pool, stats, config.cache.enable_prefix_caching)
        self.workspace = workspace
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ---- each round ----

    def schedule(self) -> None:
        """Reserve this round's pages for the running requests (oldest first), then admit."""
        for req in sorted(self.running, key=lambda r: r.arrival):
            while req in self.running and not self._reserve(req):
                self.preempt(self.running[-1])
        while self.waiting and len(self.running) < self.config.scheduler.max_running:
            req = self.waiting[0]
            self.prefix.admit(req)
            if not self._reserve(req):
                self.release(req)
                req.num_computed = req.draft_computed = 0
                break
            self.running.append(self.waiting.popleft())
            self.prefix.count(req)
            if not req.admitted:
                req.queued_s = time.monotonic() - req.arrived_at
                self.stats.queue_times.append(req.queued_s)
            req.admitted = True
        self.running.sort(key=lambda r: r.arrival)

    def round_requests(self) -> list[Request]:
        """The requests verified this round: all running ones within the token budget, or a
        suspect alone. Sets each one's `chunk`."""
        suspects = [r for r in self.running if r.suspect]
        reqs = suspects[:1] if suspects else list(self.running)
        for req in reqs:  # prompt logprobs: [chunk, V] logprobs a round, so a chunk is bounded
            req.chunk = PROMPT_LOGPROBS_CHUNK if req.params.prompt_logprobs is not None else None
        budget = self.config.scheduler.max_num_batched_tokens
        if not budget:
            return reqs
        steady = [r for r in reqs if r.uncomputed <= 1]
        left = budget - sum(1 + len(r.drafts) for r in steady)
        chosen = list(steady)
        for req in (r for r in reqs if r.uncomputed > 1):
            if left <= 0 and chosen:
                break
            req.chunk = max(1, min(left, req.uncomputed, req.chunk or left))  # alone: progress even past budget
            left -= req.chunk
            chosen.append(req)
        return sorted(chosen, key=lambda r: r.arrival)

    def _need(self, req: Request) -> tuple[int, int]:
        """KV positions this round may touch: target (tokens + drafts), drafter (+ the next
        drafts' scratch)."""
        n = len(req.tokens) + len(req.drafts)
        return n, (n + req.drafter_scratch() if req.k else 0)

    def _reserve(self, req: Request) -> bool:
        t, d = self._need(req)
        return self.target_pool.grow(req.target_pages, t) and self.drafter_pool.grow(req.drafter_pages, d)

    def longest(self, req: Request) -> int:
        """The most tokens (prompt + output) the request could ever hold (the pools empty)."""
        size = self.config.cache.page_size
        longest = self.target_pool.num_pages * size - (req.k + req.lookup_budget + 1)
        if req.k:
            longest = min(longest, self.drafter_pool.num_pages * size - (req.drafter_scratch() + 1))
        return longest

    def can_ever_hold(self, req: Request, total_tokens: int) -> None:
        """ValueError if the request could not fit even an empty cache."""
        need = [(self.target_pool, total_tokens + req.k + req.lookup_budget + 1)]
        if req.k:
            need.append((self.drafter_pool, total_tokens + req.drafter_scratch() + 1))
        if not all(pool.can_hold(n) for pool, n in need):
            raise ValueError(f"the request needs {max(n for _, n in need)} KV positions; the "
                             f"cache holds only {min(p.num_pages for p, _ in need) * self.config.cache.page_size}")

    # ---- giving back ----

    def preempt(self, req: Request) -> None:
        """Free everything and requeue; the request is recomputed when readmitted."""
        self.release(req)
        req.num_computed = req.draft_computed = 0
        self.running.remove(req)
        self.enqueue(req)
        self.stats.preemptions += 1

    def enqueue(self, req: Request) -> None:
        """Back into the waiting queue at its place by arrival (a preempted request, or one
        whose grammar compiled while later ones were queued)."""
        self.waiting.append(req)
        self.waiting = deque(sorted(self.waiting, key=lambda r: r.arrival))

    def preempt_all(self) -> None:
        for req in list(reversed(self.running)):
            self.preempt(req)

    def isolate(self, reqs: list[Request]) -> None:
        """A model call failed for this batch: recompute each of its requests (a partial forward
        may have written KV) in a round of its own."""
        for req in reqs:
            req.suspect, req.solo_rounds = True, 0
            req.isolations += 1
            if req in self.running:
                self.preempt(req)

    def release(self, req: Request) -> None:
        self.target_pool.release(req.target_pages)
        self.drafter_pool.release(req.drafter_pages)
        self.workspace.free(req.draft_slots)
        req.clear_drafts()
        req.kv_moves = []  # with the pages gone, those positions are recomputed
        req.undrafted = []
        req.published_target = req.published_drafter = 0

    def retire(self, req: Request) -> None:
        """A request leaves the engine (finished, cancelled, expired or failed)."""
        self.release(req)
        for queue in (self.running, self.waiting):
            if req in queue:
                queue.remove(req)

    def find(self, request_id: str) -> Request | None:
        return next((r for r in [*self.running, *self.waiting] if r.id == request_id), None)

    def expire(self) -> list[Request]:
        """Requests past the queue-time limit or the deadline: failed, retired -> them."""
        cfg, now, expired = self.config, time.monotonic(), []
        for req in [*self.waiting, *self.running]:
            age = now - req.arrived_at
            if cfg.limits.max_queue_time_s and not req.admitted and age > cfg.limits.max_queue_time_s:
                req.fail(f"server busy: request {req.id} waited {age:.0f} s for a place in the "
                         f"batch (max_queue_time_s {cfg.limits.max_queue_time_s:g})", "UNAVAILABLE")
            elif cfg.limits.request_timeout_s and age > cfg.limits.request_timeout_s:
                req.fail(f"request {req.id} exceeded the server's deadline of "
                         f"{cfg.limits.request_timeout_s:g} s", "UNAVAILABLE")
            else:
                continue
            self.retire(req)
            expired.append(req)
        return expired

    def drop_all(self) -> list[Request]:
        dropped = [*self.running, *self.waiting]
        for req in dropped:
            self.release(req)
        self.running, self.waiting = [], deque()
        return dropped

    def idle_counts(self) -> dict[str, int]:
        return {"target_pages_free": self.target_pool.num_free,
                "drafter_pages_free": self.drafter_pool.num_free,
                "draft_slots_free": self.workspace.num_free}
