"""The engine: continuous batching of EAGLE draft/verify rounds over all running requests.

One round (`step()`, then `draft()`) for every running request:
  schedule  - reserve KV pages, admit waiting requests (mapping the cached pages of their
              prefix), preempt the newest when pages run out, and pick the round's rows within
              the token budget (eagle_serve.core.scheduler, eagle_serve.core.prefix_cache);
  verify    - one target forward over [uncomputed tokens + drafts] of every request, the
              acceptance rule, KV rollback (eagle_serve.spec.verify);
  draft     - one drafter call catches up on the newly verified positions and proposes the
              next drafts of every speculative request, in the shapes the draft policy chooses
              (eagle_serve.spec.policy).
A request with num_speculative_tokens = 0 goes through the same path without drafts: that is
the plain-decoding baseline. Randomness is keyed by (seed, position, purpose), so a seeded
request's output does not depend on its batch; a preempted request is recomputed up to its
last token and drafted again, so its round structure (and output) is the same as without
preemption. A model call that fails fails only the request that caused it (its batch runs
again one request at a time); a call that times out (`ModelUnavailable`) is not handled here.

`step(defer_draft=True)` returns the round's outputs before drafting, so a caller can stream
them while `draft()` runs; the next `step()` refuses to start until `draft()` has run.
The engine knows token ids, pages and slots; the models behind `TargetRunner` and
`DrafterRunner` hold weights and KV tensors. The tokenizer is used only for stop strings.
"""
from __future__ import annotations

import itertools
import logging
import random
import threading
import time
import uuid
from collections import deque
from concurrent import futures
from dataclasses import replace

import torch

from eagle_serve.core.grammar import COMPILE_TIMEOUT_S, Guides
from eagle_serve.core.interfaces import DrafterRunner, KVLost, ModelUnavailable, TargetRunner
from eagle_serve.core.processors import bad_word_ids
from eagle_serve.core.requests import TO_THE_END, Completion, Request, RequestOutput, SamplingParams
from eagle_serve.core.scheduler import Scheduler
from eagle_serve.core.stopping import StopChecker
from eagle_serve.core.workspace import DraftWorkspace
from eagle_serve.settings import EngineConfig
from eagle_serve.spec import verify
from eagle_serve.spec.lookup import CorpusIndex
from eagle_serve.spec.policy import DraftPolicy
from eagle_serve.spec.proposals import propose_drafts
from eagle_serve.spec.verify import DraftWork, EngineStats

log = logging.getLogger(__name__)
MAX_ISOLATIONS = 3  # batch failures a request may be in before it fails (its own rounds passed)
SOLO_ROUNDS = 2     # rounds a suspect runs alone at most when it verifies no drafts in them


class EngineBusy(RuntimeError):
    """The waiting queue is full."""


class Engine:
    def __init__(self, target: TargetRunner, drafter: DrafterRunner | None, config: EngineConfig,
                 tokenizer=None, device="cpu", corpus: CorpusIndex | None = None):
        self.target, self.drafter, self.config, self.tokenizer = target, drafter, config, tokenizer
        self.device = torch.device(device)
        k_max = config.drafting.max_speculative_tokens
        self.stats = EngineStats(accepted_per_position=[0] * k_max, drafted_per_position=[0] * k_max)
        self.workspace = DraftWorkspace(config.cache.num_draft_slots, target.vocab_size, device=device)
        self.scheduler = Scheduler(config, self.workspace, self.stats)
        self.policy = DraftPolicy(config, corpus)
        self._inbox: deque = deque()
        self._lock = threading.Lock()
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self._pending_draft: list[DraftWork] = []  # left by step(defer_draft=True)
        self._guides: Guides | None = None          # built at the first guided request
        self._compiling: list[Request] = []         # waiting for their grammar (not queued yet)

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def waiting(self) -> deque[Request]:
        return self.scheduler.waiting

    @property
    def target_pool(self):
        return self.scheduler.target_pool

    @property
    def drafter_pool(self):
        return self.scheduler.drafter_pool

    # ---- requests in and out (thread-safe) ----

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; raises ValueError (bad request) or EngineBusy."""
        cfg = self.config
        to_the_end = params.max_tokens == TO_THE_END
        if to_the_end:  # settled below, once the request's own KV needs are known
            params = replace(params, max_tokens=max(1, params.min_tokens))
        params.validate(cfg, cfg.drafting.max_speculative_tokens if self.drafter else 0)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.target.vocab_size
        for name, ids in (("token ids", prompt_ids), ("logit_bias token ids", [t for t, _ in params.logit_bias]),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = [i for i in ids if not 0 <= i < vocab]
            if bad:
                raise ValueError(f"{name} must be in [0, {vocab}); got {bad[:8]}")
        if (params.bad_words or params.guide) and self.tokenizer is None:
            raise ValueError("bad_words and guides need the engine's tokenizer")
        total = len(prompt_ids) + params.max_tokens
        if total > cfg.scheduler.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len ({cfg.scheduler.max_model_len})")
        k = self.policy.default_k(params, self.drafter is not None)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        stop = StopChecker(self.tokenizer, params.stop, params.min_tokens) if params.stop else None
        req = Request(request_id if request_id is not None else f"req-{next(self._ids)}",
                      len(prompt_ids), params, k, seed % (1 << 63), stop, list(prompt_ids))
        if params.bad_words:
            req.bad_word_ids = bad_word_ids(self.tokenizer, params.bad_words)
        if params.guide is not None:  # compiled off the engine's step; admitted once ready
            req.grammar_future = self.guides().compile(params.guide)
        self.policy.setup_request(req)
        if to_the_end:
            room = min(cfg.scheduler.max_model_len, self.scheduler.longest(req)) - len(prompt_ids)
            if room < max(1, params.min_tokens):
                raise ValueError(f"the prompt ({len(prompt_ids)} tokens) leaves room for {max(0, room)} "
                                 f"output tokens (max_model_len {cfg.scheduler.max_model_len}), fewer than asked")
            req.params = replace(req.params, max_tokens=room)
            total = len(prompt_ids) + room
        self.scheduler.can_ever_hold(req, total)
        with self._lock:
            if len(self.waiting) + len(self._inbox) + len(self._compiling) >= cfg.scheduler.max_waiting:
                raise EngineBusy(f"server busy: {cfg.scheduler.max_waiting} requests are already waiting")
            req.arrival = next(self._arrivals)
            self._inbox.append(("add", req))
        return req.id

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._inbox or self._compiling)

    def guides(self) -> Guides:
        if self._guides is None:
            self._guides = Guides(self.tokenizer, self.target.vocab_size, self.config.eos_token_ids)
        return self._guides

    # ---- one round ----

    @torch.inference_mode()
    def step(self, defer_draft: bool = False) -> list[RequestOutput]:
        """One round: verify the running requests' drafts (or decode), accept, and draft the
        next round. With defer_draft the drafting is left to `draft()`, so a caller can stream
        this round's outputs while the drafter runs (the outputs do not depend on it)."""
        assert not self._pending_draft, "call draft() after step(defer_draft=True)"
        outputs = self._drain_inbox()
        outputs += self._compiled()
        outputs += [req.take_output() for req in self.scheduler.expire()]
        self.scheduler.schedule()
        reqs = self.scheduler.round_requests()
        if reqs:
            self._pending_draft = self._verify(reqs)
        for req in list(self.running):
            out = req.take_output()
            if out is not None:
                outputs.append(out)
            if req.done:
                self.scheduler.retire(req)
        if not defer_draft:
            outputs += self.draft()
        return outputs

    def _verify(self, reqs: list[Request]) -> list[DraftWork]:
        """The target forward of a round and its acceptance -> drafter work."""
        drafted = [bool(r.drafts) for r in reqs]
        try:
            vb = verify.build_verify_batch(reqs, self.target_pool, self.device,
                                           self.config.eos_token_ids)
            extra = {"kv_moves": vb.kv_moves} if vb.kv_moves else {}
            extra |= {"processors": vb.processors} if vb.processors else {}
            start = time.perf_counter()
            result = self.target.forward(vb.batch, vb.logit_rows, vb.sampling, **extra)
            self.stats.steps += 1
            verdicts = verify.accept(result, vb, self.workspace, self.target.vocab_size, self.device)
            verify.attach_logprobs(result, vb, verdicts)
            if all(r.num_real == 1 for r in vb.rows):  # decode/verify rows only: the draft costs
                self.policy.costs.record_target(vb.batch.input_ids.shape[0], time.perf_counter() - start)
            prefix = self.scheduler.prefix
            store = prefix if self.drafter is not None and prefix.enabled else None
            work = verify.advance(result, vb, verdicts, self.target_pool, self.workspace,
                                  self.stats, self.config.eos_token_ids, store)
            for req in reqs:  # before a finished request gives its pages back
                prefix.publish(req)
        except KVLost:  # tokens verified so far stand; all KV is recomputed
            self._preempt_all()
            return []
        except ModelUnavailable:
            raise
        except Exception as error:  # noqa: BLE001 (a model call failed for this batch)
            self._model_failed(reqs, "eagle_target", error)
            return []
        if len(reqs) == 1 and reqs[0].suspect:  # a round of its own succeeded
            req = reqs[0]
            req.solo_rounds += 1
            if drafted[0] or not req.k or req.finish_reason or req.solo_rounds >= SOLO_ROUNDS:
                req.suspect = False
        return work

    @torch.inference_mode()
    def draft(self) -> list[RequestOutput]:
        """Propose the next round's drafts for the requests the last step advanced. -> outputs
        of requests that failed in the drafter call (usually none)."""
        running = {id(req) for req in self.running}  # none left since, unless failed
        work = [w for w in self._pending_draft if id(w.req) in running]
        self._pending_draft = []
        if work and self.drafter is not None:
            try:
                propose_drafts(work, self.drafter, self.policy, self.drafter_pool,
                               self.workspace, len(self.running), self.device)
                for w in work:
                    self.scheduler.prefix.publish(w.req)
            except KVLost:
                self._preempt_all()
            except ModelUnavailable:
                raise
            except Exception as error:  # noqa: BLE001 (a model call failed for this batch)
                self._model_failed([w.req for w in work], "eagle_drafter", error)
        failed = [req for req in self.running if req.error]
        for req in failed:
            self.scheduler.retire(req)
        return [req.take_output() for req in failed]

    def _model_failed(self, reqs: list[Request], model: str, error: Exception) -> None:
        """A model call failed for `reqs`. Alone, the request fails with a generic message (the
        details go to the log under an error id); in a batch, every request of it runs alone
        until a round of its own verified its drafts, so only the culprit fails. A request whose
        batches failed MAX_ISOLATIONS times while it passed alone fails then: a failure that only
        a batch brings about would otherwise repeat for as long as it runs."""
        hopeless = [r for r in reqs if r.isolations >= MAX_ISOLATIONS]  # (batches fail, alone not)
        if len(reqs) == 1 or hopeless:
            for req in reqs if len(reqs) == 1 else hopeless:
                error_id = uuid.uuid4().hex[:12]
                log.error("request %s failed in %s (error id %s): %s", req.id, model, error_id,
                          error, exc_info=error)
                req.fail(f"internal error while serving request {req.id} (error id "
                         f"{error_id}); the server log has the details", "INTERNAL", error)
            reqs = [r for r in reqs if not r.error]
            if not reqs:
                return
        log.warning("%s failed for a batch of %d requests (%s); retrying each alone", model,
                    len(reqs), error)
        self.scheduler.isolate(reqs)

    def _preempt_all(self) -> None:
        self.scheduler.preempt_all()
        self.scheduler.prefix.forget()

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            items, self._inbox = list(self._inbox), deque()
        outputs = []
        for kind, item in items:
            if kind == "add":
                (self._compiling if item.grammar_future is not None else self.waiting).append(item)
                continue
            req = self.scheduler.find(item) or next((r for r in self._compiling if r.id == item), None)
            if req is None:
                continue
            if req in self._compiling:
                self._compiling.remove(req)
            else:
                self.scheduler.retire(req)
            req.finish_reason = "cancelled"
            outputs.append(req.take_output(force=True))
        return outputs

    def _compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar compiled (in arrival order: Scheduler.enqueue); fail those whose guide
        did not compile, or compiles too slowly. With nothing else to do, wait a little for one."""
        if self._compiling and not (self.running or self.waiting):
            futures.wait([r.grammar_future for r in self._compiling], timeout=0.01,
                         return_when=futures.FIRST_COMPLETED)
        outputs, now = [], time.monotonic()
        for req in list(self._compiling):
            future = req.grammar_future
            if not future.done() and now - req.arrived_at < COMPILE_TIMEOUT_S:
                continue
            self._compiling.remove(req)
            req.grammar_future = None
            error = future.exception() if future.done() else TimeoutError(
                f"the guide did not compile within {COMPILE_TIMEOUT_S:g} s")
            if error is not None:
                req.fail(str(error), "INVALID_ARG")
                outputs.append(req.take_output())
                continue
            req.grammar = self.guides().matcher(future.result())
            self.scheduler.enqueue(req)
        return outputs

    def fail_all(self) -> list[str]:
        """Drop every request (after an unrecoverable error) -> their ids."""
        with self._lock:
            dropped = [item.id for kind, item in self._inbox if kind == "add"]
            self._inbox.clear()
        dropped += [req.id for req in self._compiling]
        self._compiling = []
        dropped += [req.id for req in self.scheduler.drop_all()]
        self._pending_draft = []
        return dropped

    # ---- convenience ----

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[Completion]:
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
                c.logprobs += out.logprobs or []
                c.prompt_logprobs += out.prompt_logprobs or []
                c.finish_reason, c.last = out.finish_reason, out
        return [done[i] for i in ids]

    def idle_counts(self) -> dict[str, int]:
        return self.scheduler.idle_counts()
