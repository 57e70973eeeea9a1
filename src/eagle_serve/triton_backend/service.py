"""The engine thread of a `spec_decode` instance: Triton requests in, streamed responses out.

`submit` (called from the decoupled `execute`) validates a request and queues it, or answers it
at once with an error and FINAL; one background thread runs engine rounds while there is work,
sends each request's new tokens (stream) or its whole output (non-stream) with running totals,
polls client cancellation (every CANCEL_POLL_S at most), and keeps the Prometheus metrics
current; a second one makes each round's drafter call meanwhile. A request's inputs become a
`ClientRequest` in triton_backend.client_request (return_num_output_tokens there makes
num_output_tokens count each response's tokens). Every request gets FINAL exactly once
(`_Stream`): on finish, bad input, cancellation, a failed model call, a timeout or shutdown. A
model call that times out or finds its model process dead (`ModelUnavailable`) breaks the
engine: every open request fails and `on_broken` stops the server so that its supervisor
restarts it.
"""
from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from eagle_serve.core.interfaces import ModelUnavailable
from eagle_serve.core.requests import (
    RequestOutput,
    TokenLogprob,
)
from eagle_serve.core.tokenization import decode, decode_delta, detok_window, eos_token_ids, text_tokenizer
from eagle_serve.engine import Engine, EngineBusy
from eagle_serve.kernels.warmup import warm_engine
from eagle_serve.models.dtypes import settings_dtype
from eagle_serve.settings import EngineConfig, LimitSettings, ServingSettings, generation_defaults, model_vocab_size
from eagle_serve.spec.lookup import load_corpus_index
from eagle_serve.triton_backend import internal_key
from eagle_serve.triton_backend import io as tu
from eagle_serve.triton_backend.bls import BlsDrafter, BlsTarget
from eagle_serve.triton_backend.client_request import read_request
from eagle_serve.triton_backend.metrics import EngineMetrics
from eagle_serve.triton_backend.workers import instance_device, log_warmup

# Asking Triton whether a client cancelled is a round trip to the server process (measured
# ~0.08 ms a request, 1-2% of a round at 1-8 streams on a 2-core CPU): open requests are asked
# at most this often, so a cancelled request runs at most this much (and a round) longer.
CANCEL_POLL_S = 0.02


class _Stream:
    """One request's response sender: FINAL goes out exactly once, whatever fails on the way."""

    def __init__(self, pb, sender):
        self.pb, self.sender, self.closed = pb, sender, False

    def send(self, response, final: bool) -> None:
        if self.closed:
            return
        flags = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        try:
            self.sender.send(response, flags=flags)
        except Exception:  # the client is gone or the response was bad: still close once
            if final:
                self._send_final()
        finally:
            self.closed = final

    def fail(self, message: str, code: str = "INVALID_ARG") -> None:
        self.send(tu.error_response(message, code), final=True)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._send_final()

    def _send_final(self) -> None:
        try:
            self.sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:
            pass


@dataclass
class _Open:
    out: _Stream
    stream: bool
    direct: bool                    # called with text_input: send text_output too
    arrival: float
    count_per_response: bool        # num_output_tokens counts each response's tokens
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of output_ids (asked)
    prompt_logprobs: list[TokenLogprob] | None = None  # until sent (asked)
    num_sent: int = 0
    first_token_at: float | None = None


class SpecDecodeService:
    def __init__(self, pb, engine: Engine, metrics: EngineMetrics | None = None,
                 max_input_bytes: int = LimitSettings.max_input_bytes, draft_timeout_s: float = 0.0,
                 on_broken: Callable[[str], None] | None = None, apply_chat_template: bool = True,
                 defaults: dict | None = None):
        """on_broken(reason): called once when a model process is stuck or dead; spec_decode's
        start_service stops the server there, so its supervisor restarts it. apply_chat_template:
        what a text_input request without that input gets."""
        self.pb, self.engine, self.metrics = pb, engine, metrics
        self.max_input_bytes, self.draft_timeout_s = max_input_bytes, draft_timeout_s
        self.apply_chat_template, self.defaults = apply_chat_template, defaults or {}
        self.on_broken = on_broken
        self.open: dict[str, _Open] = {}
        self.broken = ""                # why the engine cannot go on ("" = it can)
        self._wake = threading.Condition()
        self._stopping = False
        self._ids = 0
        self._polled = 0.0              # time.monotonic() of the last cancellation poll
        # Started by the first request: BLS calls are allowed from threads that `execute`
        # starts, not from `initialize`.
        self._thread = threading.Thread(target=self._loop, name="spec-decode-engine", daemon=True)
        # The drafter call of a round runs here while the engine thread streams the round's
        # tokens (started lazily by the engine thread).
        self._drafting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spec-decode-draft")
        if metrics:  # the gauges show the idle pool from the start, not 0 until a first request
            metrics.update(engine)

    # ---- from execute ----

    def submit(self, request) -> None:
        out = _Stream(self.pb, request.get_response_sender())
        try:
            if self._thread.ident is None and not self._stopping:
                self._thread.start()
            if self.broken or self._stopping:
                raise EngineBusy(f"the server is restarting: {self.broken or 'shutting down'}")
            client = read_request(request, self.engine.tokenizer, self.max_input_bytes,
                                  self.apply_chat_template, self.defaults)
            with self._wake:
                self._ids += 1
                rid = f"{request.request_id() or 'req'}#{self._ids}"
                self.open[rid] = _Open(out, client.stream, client.direct, time.perf_counter(),
                                       client.count_per_response)
                try:
                    self.engine.add_request(client.prompt, client.params, rid)
                except Exception:
                    del self.open[rid]
                    raise
                self._wake.notify()
        except ValueError as error:  # (RequestError: bad input)
            out.fail(str(error))
        except EngineBusy as error:
            out.fail(str(error), "UNAVAILABLE")
        except Exception as error:  # a bug: this request fails, the service goes on
            self.pb.Logger.log_error(traceback.format_exc())
            out.fail(f"internal error: {type(error).__name__}", "INTERNAL")

    def shutdown(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._drafting.shutdown(wait=False)
        self._fail_open("the server is shutting down", "UNAVAILABLE")

    # ---- the engine thread ----

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.engine.has_work():
                    self._wake.wait(timeout=1.0)
                if self._stopping:
                    return
            try:
                self._round()
            except ModelUnavailable as error:  # a model process is stuck or dead
                self._break(str(error))
                return
            except Exception:  # a bug outside the model calls: fail what is open, keep serving
                error_id = uuid.uuid4().hex[:12]
                self.pb.Logger.log_error(f"engine error (error id {error_id}):\n"
                                         f"{traceback.format_exc()}")
                self.engine.fail_all()
                self._fail_open(f"internal error (error id {error_id}); the server log has the "
                                f"details", "INTERNAL")

    def _round(self) -> None:
        """Verify, then draft the next round in the drafting thread while this one updates the
        metrics and sends the round's tokens: the drafter call (a BLS hop and the head's
        forward) overlaps the responses instead of following them."""
        if time.monotonic() - self._polled >= CANCEL_POLL_S:
            self._poll_cancellations()
        outputs = self.engine.step(defer_draft=True)
        drafting = self._drafting.submit(self.engine.draft)
        try:
            if self.metrics:  # before the responses: a client that saw FINAL reads settled gauges
                self.metrics.update(self.engine)
            for out in outputs:
                self._respond(out)
        finally:  # the engine is whole again before anything else touches it
            try:
                failed = drafting.result(timeout=self.draft_timeout_s + 5 if self.draft_timeout_s else None)
            except concurrent.futures.TimeoutError:
                raise ModelUnavailable("the drafting thread did not finish") from None
        for out in failed:
            self._respond(out)

    def _break(self, reason: str) -> None:
        self.broken = reason
        self.pb.Logger.log_error(f"spec_decode cannot go on: {reason}")
        self.engine.fail_all()
        self._fail_open(f"the server stopped: {reason}; it is restarting", "UNAVAILABLE")
        if self.on_broken is not None:
            self.on_broken(reason)

    def _fail_open(self, message: str, code: str) -> None:
        for rid in list(self.open):
            entry = self.open.pop(rid, None)
            if entry is not None:
                entry.out.fail(f"{message} (request {rid})", code)
                if self.metrics:
                    self.metrics.observe_finished("error")

    def _poll_cancellations(self) -> None:
        self._polled = time.monotonic()
        for rid, entry in list(self.open.items()):
            if entry.out.sender.is_cancelled():
                self.engine.abort(rid)

    def _respond(self, out: RequestOutput) -> None:
        entry = self.open.pop(out.request_id, None) if out.finished else self.open.get(out.request_id)
        if entry is None:
            return
        if self.metrics and not out.error:
            self.metrics.observe_generated(len(out.new_token_ids))
        if out.finished and self.metrics:  # before FINAL: a client that saw it reads settled counters
            if out.error:
                self.metrics.observe_finished("error")
            else:
                e2e = time.perf_counter() - entry.arrival
                first = None if entry.first_token_at is None else entry.first_token_at - entry.arrival
                self.metrics.observe_request(out.num_input_tokens, out.num_output_tokens, out.queued_s, first, e2e)
                self.metrics.observe_finished(out.finish_reason, e2e)
        try:
            if out.error:
                entry.out.fail(out.error, out.error_code or "INTERNAL")
                return
            self._send_tokens(entry, out)
        finally:
            if out.finished:
                entry.out.close()  # FINAL exactly once, whatever happened above

    def _send_tokens(self, entry: _Open, out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.new_token_ids and entry.first_token_at is None:
            entry.first_token_at = now
            if self.metrics:
                self.metrics.observe_first_token(now - entry.arrival, out.num_input_tokens)
        first_new = entry.num_sent if entry.stream else 0
        entry.output_ids += out.new_token_ids
        entry.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            entry.prompt_logprobs = out.prompt_logprobs
        if out.finished and self.metrics and len(entry.output_ids) > 1 and entry.first_token_at is not None:
            self.metrics.observe_tpot((now - entry.first_token_at) / (len(entry.output_ids) - 1))
        if not entry.stream and not out.finished:
            return
        new = entry.output_ids[entry.num_sent:] if entry.stream else entry.output_ids
        prev = detok_window(entry.output_ids, entry.num_sent) if entry.stream else []
        entry.num_sent = len(entry.output_ids)
        text = ""
        if entry.direct:
            tok = self.engine.tokenizer
            text = decode_delta(tok, prev, new, out.finished) if entry.stream else decode(tok, new)
        num_output = len(new) if entry.count_per_response else out.num_output_tokens
        tensors = self._tensors(out, new, prev, num_output) + [tu.text_tensor("text_output", text)]
        tensors += logprob_tensors(entry.logprobs[first_new:first_new + len(new)])
        tensors += logprob_tensors(entry.prompt_logprobs or [], "prompt_")
        entry.prompt_logprobs = None
        entry.out.send(self.pb.InferenceResponse(output_tensors=tensors), final=out.finished)

    def _tensors(self, out: RequestOutput, new: list[int], prev: list[int], num_output: int) -> list:
        return [tu.ids_tensor("output_ids", np.asarray(new, dtype=np.int32)),
                tu.ids_tensor("prev_ids", np.asarray(prev, dtype=np.int32)),
                tu.int_tensor("num_input_tokens", out.num_input_tokens),
                tu.int_tensor("num_output_tokens", num_output),
                tu.int_tensor("num_draft_tokens", out.num_draft_tokens),
                tu.int_tensor("num_accepted_tokens", out.num_accepted_tokens),
                tu.int_tensor("num_rounds", out.num_rounds),
                tu.int_tensor("num_cached_tokens", out.num_cached_tokens),
                tu.text_tensor("finish_reason", out.finish_reason)]


def logprob_tensors(logprobs: list[TokenLogprob], prefix: str = "") -> list:
    """output_log_probs [1, n], top_logprob_ids / top_logprobs [1, n, N] (prefix "prompt_": the
    prompt's, with prompt_log_probs): empty when the request did not ask (the ensemble maps
    every output of every response)."""
    width = max((len(x.top) for x in logprobs), default=0)
    ids = np.zeros((1, len(logprobs), width), dtype=np.int32)
    values = np.full((1, len(logprobs), width), -np.inf, dtype=np.float32)
    for i, x in enumerate(logprobs):
        for j, (tok, lp) in enumerate(x.top):
            ids[0, i, j], values[0, i, j] = tok, lp
    chosen = np.asarray([[x.logprob for x in logprobs]], dtype=np.float32).reshape(1, -1)
    pb_utils = tu.pb()
    chosen_name = "prompt_log_probs" if prefix else "output_log_probs"
    return [pb_utils.Tensor(chosen_name, chosen), pb_utils.Tensor(prefix + "top_logprob_ids", ids),
            pb_utils.Tensor(prefix + "top_logprobs", values)]


def start_service(pb, args: dict) -> "SpecDecodeService":
    """spec_decode's `initialize`: its settings resolved as eagle_target's, the engine on BLS
    models, warmed (GPU kernels compiled before any request), and its service."""
    config = json.loads(args["model_config"])
    tu.require_single_instance(config)
    repo = tu.repository_dir(args)
    settings = ServingSettings.from_parameters(tu.model_parameters(config))
    target_dir, drafter_dir = settings.model_dirs(repo)
    device = instance_device(args)
    dtype = settings_dtype(settings, device.type == "cuda", repo)
    settings = settings.resolved(target_dir, dtype.itemsize)  # as eagle_target's
    print(f"spec_decode: {settings.kv_summary()}", flush=True)
    if device.type == "cpu":
        settings.apply_threads("engine")
    vocab = model_vocab_size(target_dir)
    bls = dict(key=internal_key.server_key(), timeout_s=settings.limits.model_call_timeout_s)
    target = BlsTarget(pb, vocab, device, **bls)
    drafter = BlsDrafter(pb, vocab, device, **bls) if drafter_dir is not None else None
    tokenizer = text_tokenizer(target_dir)  # not AutoTokenizer: see TextTokenizer
    corpus = settings.corpus_index_path(repo, drafter_dir)
    engine = Engine(target, drafter, EngineConfig.from_settings(settings, eos_token_ids(target_dir)),
                    tokenizer=tokenizer, device=device,
                    corpus=load_corpus_index(corpus, tokenizer) if corpus else None)
    log_warmup("spec_decode", warm_engine(engine))
    metrics = EngineMetrics(pb, settings.drafting.max_speculative_tokens, model_name=target_dir.name)
    return SpecDecodeService(pb, engine, metrics, settings.limits.max_input_bytes,
                             draft_timeout_s=settings.limits.model_call_timeout_s, on_broken=tu.stop_server,
                             apply_chat_template=settings.api.apply_chat_template,
                             defaults=generation_defaults(target_dir))
