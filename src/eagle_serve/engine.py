"""The engine: continuous batching of EAGLE draft/verify rounds over all running requests.

One `step()` is one round for every running request:
  schedule  - reserve KV pages (target + drafter) for the round; admit waiting requests while
              pages allow; when pages run out, preempt the newest request (free everything,
              requeue, recompute later) instead of failing;
  verify    - one target forward over [uncomputed tokens + drafts] of every request;
  accept    - greedy: longest matching prefix + the target's token; sampled: rejection
              sampling with the real draft probabilities -> 1..k+1 new tokens; roll back;
  draft     - one drafter call catches up on the newly verified positions and proposes the
              next k drafts of every speculative request.
A request with num_speculative_tokens = 0 goes through the same path without drafts: that is
the plain-decoding baseline. Randomness is keyed by (seed, position, purpose), so a seeded
request's output does not depend on its batch; a preempted request is recomputed up to its last
token and drafted again, so its round structure (and output) is the same as without preemption.

The engine knows token ids, pages and slots; the models behind `TargetRunner` and
`DrafterRunner` hold weights and KV tensors. The tokenizer is used only for stop strings.
"""
from __future__ import annotations

import itertools
import random
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from eagle_serve.interfaces import DrafterRunner, KVLost, RaggedBatch, RowSampling, TargetRunner
from eagle_serve.kv_pages import PagePool
from eagle_serve.stopping import StopChecker
from eagle_serve.workspace import DraftWorkspace
from kernels.rejection import greedy_accept, random_accept


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

    def validate(self, max_k: int) -> None:
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (self.num_speculative_tokens is None or 0 <= self.num_speculative_tokens <= max_k,
             f"num_speculative_tokens must be in [0, {max_k}], got {self.num_speculative_tokens}"),
            (all(self.stop), "stop strings must not be empty"),
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


@dataclass
class _Request:
    id: str
    prompt_len: int
    params: SamplingParams
    k: int
    seed: int
    arrival: int
    stop: StopChecker | None
    tokens: list[int]
    num_computed: int = 0           # positions in the target's KV
    draft_computed: int = 0         # positions in the drafter's KV
    drafts: list[int] = field(default_factory=list)
    draft_slots: list[int] = field(default_factory=list)
    target_pages: list[int] = field(default_factory=list)
    drafter_pages: list[int] = field(default_factory=list)
    num_sent: int = 0               # output tokens handed out
    finish_reason: str = ""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rounds: int = 0

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    def sampling_row(self) -> tuple[float, int, float, int]:
        p = self.params
        return (p.temperature, p.top_k, p.top_p, self.seed)


@dataclass
class EngineStats:
    steps: int = 0                    # batched rounds (one target forward each)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    preemptions: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)


class Engine:
    def __init__(self, target: TargetRunner, drafter: DrafterRunner | None, config: EngineConfig,
                 tokenizer=None, device="cpu"):
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

    # ---- requests in and out (thread-safe) ----

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; raises ValueError (bad request) or EngineBusy."""
        cfg = self.config
        params.validate(cfg.max_speculative_tokens if self.drafter else 0)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        k = cfg.num_speculative_tokens if params.num_speculative_tokens is None else params.num_speculative_tokens
        k = k if self.drafter else 0
        total = len(prompt_ids) + params.max_tokens
        if total > cfg.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len ({cfg.max_model_len})")
        need = total + k + 1
        pools = [self.target_pool] + ([self.drafter_pool] if k else [])
        if not all(pool.can_hold(need) for pool in pools):
            raise ValueError(f"the request needs {need} KV positions; the cache holds only "
                             f"{min(p.num_pages for p in pools) * cfg.page_size}")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        stop = StopChecker(self.tokenizer, params.stop) if params.stop else None
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = _Request(request_id, len(prompt_ids), params, k, seed % (1 << 63), 0, stop,
                       list(prompt_ids))
        with self._lock:
            if len(self.waiting) + len(self._inbox) >= cfg.max_waiting:
                raise EngineBusy(f"server busy: {cfg.max_waiting} requests are already waiting")
            req.arrival = next(self._arrivals)
            self._inbox.append(("add", req))
        return request_id

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._inbox)

    # ---- one round ----

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        self._drain_inbox(outputs)
        self._schedule()
        if self.running:
            try:
                batch, logit_rows, sampling, plan = self._target_batch()
                result = self.target.forward(batch, logit_rows, sampling)
                self.stats.steps += 1
                emitted = self._accept(result, plan)
                features = self._advance(result.hidden, plan, emitted)
                self._draft(features)
            except KVLost:  # tokens verified so far stand; all KV is recomputed
                for req in list(reversed(self.running)):
                    self._preempt(req)
        for req in list(self.running):
            out = self._output(req)
            if out is not None:
                outputs.append(out)
            if req.finish_reason:
                self._release(req)
                self.running.remove(req)
        return outputs

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
        """KV positions this round may touch: target (tokens + drafts), drafter (+ next k)."""
        n = len(req.tokens) + len(req.drafts)
        return n, (n + req.k if req.k else 0)

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
        self.running.sort(key=lambda r: r.arrival)

    def fail_all(self) -> list[str]:
        """Drop every request (after an unrecoverable model error); -> their ids."""
        with self._lock:
            dropped = [item.id for kind, item in self._inbox if kind == "add"]
            self._inbox.clear()
        for req in self.running + list(self.waiting):
            self._release(req)
            dropped.append(req.id)
        self.running, self.waiting = [], deque()
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
        req.drafts, req.draft_slots = [], []

    # ---- verify ----

    def _target_batch(self):
        """Rows of each request: tokens it has not computed + its drafts. A request that was
        preempted after emitting tokens recomputes all but its last token and samples nothing."""
        ids, positions, cu, seq_lens, slots, logit_rows, rows_sampling, plan = [], [], [0], [], [], [], [], []
        for req in self.running:
            start = req.num_computed
            resume = len(req.output) > 0 and start < len(req.tokens) - 1
            real = req.tokens[start:len(req.tokens) - 1 if resume else len(req.tokens)]
            new = real + req.drafts
            ids += new
            positions += range(start, start + len(new))
            slots += [self.target_pool.slot(req.target_pages, p) for p in range(start, start + len(new))]
            n_logits = 0 if resume else 1 + len(req.drafts)
            logit_rows += range(cu[-1] + len(new) - n_logits, cu[-1] + len(new))
            rows_sampling += [req.sampling_row()] * n_logits
            plan.append((req, cu[-1], len(real), n_logits))
            cu.append(cu[-1] + len(new))
            seq_lens.append(start + len(new))
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        batch = RaggedBatch(t(ids), t(positions), t(cu), t(seq_lens),
                            self._tables([r.target_pages for r in self.running]), t(slots))
        return batch, t(logit_rows), self._row_sampling(rows_sampling), plan

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

    def _accept(self, result, plan) -> dict[str, list[int]]:
        """-> emitted tokens per request id (requests that sampled nothing are absent)."""
        emitted: dict[str, list[int]] = {}
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
            drafts, cu = self._flat_drafts([r for r, _ in greedy])
            out, num = greedy_accept(drafts, cu, torch.cat([a for _, a in greedy]))
            for i, (req, _) in enumerate(greedy):
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
        return emitted

    def _flat_drafts(self, reqs: list[_Request]) -> tuple[torch.Tensor, torch.Tensor]:
        lens = [len(r.drafts) for r in reqs]
        cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int64, device=self.device)
        drafts = torch.tensor([d for r in reqs for d in r.drafts], dtype=torch.int64, device=self.device)
        return drafts, cu

    def _advance(self, hidden: torch.Tensor, plan, emitted) -> list[tuple]:
        """Append accepted tokens, roll back KV, update stats. -> drafter work per request:
        (request, feature rows [n, F])."""
        work = []
        for req, first_row, num_real, _ in plan:
            tokens = emitted.get(req.id)
            accepted = 0
            if tokens is not None:
                accepted = len(tokens) - 1
                self._count_round(req, accepted)
                self._append(req, tokens)
            valid = num_real + accepted  # rows whose KV and features are now the truth
            req.num_computed += valid
            self.workspace.free(req.draft_slots)
            req.drafts, req.draft_slots = [], []
            self.target_pool.shrink(req.target_pages, req.num_computed)
            if req.k and not req.finish_reason:
                work.append((req, hidden[first_row:first_row + valid]))
        return work

    def _count_round(self, req: _Request, accepted: int) -> None:
        req.num_rounds += 1
        req.num_draft_tokens += len(req.drafts)
        req.num_accepted_tokens += accepted
        s = self.stats
        s.rounds += 1
        s.draft_tokens += len(req.drafts)
        s.accepted_tokens += accepted
        for j in range(len(req.drafts)):
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
        ids, positions, cu, seq_lens, slots, feats, ks = [], [], [0], [], [], [], []
        for req, rows in work:
            start, end = req.draft_computed, req.num_computed
            assert rows.shape[0] == end - start, "drafter fell behind the target"
            left = min(req.params.max_tokens - len(req.output) - 1,
                       self.config.max_model_len - len(req.tokens))
            ks.append(max(0, min(req.k, left)))
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
        out = self.drafter.propose(batch, torch.cat(feats), t(ks), sampling)
        prob_row = 0
        for i, (req, _) in enumerate(work):
            req.draft_computed = req.num_computed
            self.drafter_pool.shrink(req.drafter_pages, req.draft_computed)
            drafts = out.tokens[i, :ks[i]].tolist()
            slots = self.workspace.alloc(len(drafts))
            if not req.greedy:
                q = out.probs[prob_row:prob_row + len(drafts)]
                prob_row += len(drafts)
                if slots is not None:
                    self.workspace.store(slots, q)
            if slots is not None:  # no free slots: this round verifies no drafts
                req.drafts, req.draft_slots = drafts, slots

    # ---- results ----

    def _output(self, req: _Request, force: bool = False) -> RequestOutput | None:
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
        """Run requests to completion (library use and tests)."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        done: dict[str, Completion] = {i: Completion([], "", None) for i in ids}
        while any(not c.finish_reason for c in done.values()):
            for out in self.step():
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
