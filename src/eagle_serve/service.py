"""The engine thread of a `spec_decode` instance: Triton requests in, streamed responses out.

`submit` (called from the decoupled `execute`) validates a request and queues it, or answers it
at once with an error and FINAL; one background thread runs engine rounds while there is work,
sends each request's new tokens (stream) or its whole output (non-stream) with running totals,
polls client cancellation every round, and keeps the Prometheus metrics current; a second one
makes each round's drafter call meanwhile. Every request gets FINAL exactly once (`_Stream`): on
finish, bad input, cancellation, a failed model call, a timeout or shutdown. A model call that
times out or finds its model process dead (`ModelUnavailable`) breaks the engine: every open
request fails and `on_broken` stops the server so that its supervisor restarts it.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from eagle_serve import triton_utils as tu
from eagle_serve.engine import Engine, EngineBusy
from eagle_serve.requests import RequestOutput, SamplingParams
from eagle_serve.interfaces import ModelUnavailable
from eagle_serve.metrics import EngineMetrics
from eagle_serve.tokenization import decode, decode_delta, detok_window


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
    output_ids: list[int] = field(default_factory=list)
    num_sent: int = 0
    first_token_at: float | None = None


def read_prompt(request, tokenizer, max_input_bytes: int) -> tuple[list[int], bool]:
    """-> prompt ids, and whether the request came with text (the direct path)."""
    ids = tu.prompt_ids(request, tokenizer, max_input_bytes, required=False)
    if ids is not None:
        return ids, True
    ids = tu.row(request, "input_ids")
    if ids is None:
        raise tu.RequestError("send text_input (or input_ids)")
    if ids.size == 0:
        raise tu.RequestError("input_ids is empty")
    return [int(x) for x in ids], False


def read_params(request, max_stop_bytes: int = 4096) -> tuple[SamplingParams, bool]:
    """One request's sampling parameters and stream flag (RequestError if bad)."""
    k = tu.scalar(request, "num_speculative_tokens")
    topk, depth = tu.scalar(request, "draft_topk"), tu.scalar(request, "draft_depth")
    params = SamplingParams(
        max_tokens=int(tu.scalar(request, "max_tokens", 128)),
        temperature=float(tu.scalar(request, "temperature", 0.0)),
        top_p=float(tu.scalar(request, "top_p", 1.0)),
        top_k=int(tu.scalar(request, "top_k", 0)),
        seed=None if tu.scalar(request, "seed") is None else int(tu.scalar(request, "seed")),
        num_speculative_tokens=None if k is None else int(k),
        draft_topk=None if topk is None else int(topk),
        draft_depth=None if depth is None else int(depth),
        stop=tuple(tu.texts(request, "stop", max_bytes=max_stop_bytes)),
        ignore_eos=bool(tu.scalar(request, "ignore_eos", False)))
    return params, bool(tu.scalar(request, "stream", False))


class SpecDecodeService:
    def __init__(self, pb, engine: Engine, metrics: EngineMetrics | None = None,
                 max_input_bytes: int = 65536, draft_timeout_s: float = 0.0,
                 on_broken: Callable[[str], None] | None = None):
        """on_broken(reason): called once when a model process is stuck or dead; spec_decode's
        model.py stops the server there, so its supervisor restarts it."""
        self.pb, self.engine, self.metrics = pb, engine, metrics
        self.max_input_bytes, self.draft_timeout_s = max_input_bytes, draft_timeout_s
        self.on_broken = on_broken
        self.open: dict[str, _Open] = {}
        self.broken = ""                # why the engine cannot go on ("" = it can)
        self._wake = threading.Condition()
        self._stopping = False
        self._ids = 0
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
            prompt, direct = read_prompt(request, self.engine.tokenizer, self.max_input_bytes)
            params, stream = read_params(request)
            with self._wake:
                self._ids += 1
                rid = f"{request.request_id() or 'req'}#{self._ids}"
                self.open[rid] = _Open(out, stream, direct, time.perf_counter())
                try:
                    self.engine.add_request(prompt, params, rid)
                except Exception:
                    del self.open[rid]
                    raise
                self._wake.notify()
        except (tu.RequestError, ValueError) as error:
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

    def _poll_cancellations(self) -> None:
        for rid, entry in list(self.open.items()):
            if entry.out.sender.is_cancelled():
                self.engine.abort(rid)

    def _respond(self, out: RequestOutput) -> None:
        entry = self.open.pop(out.request_id, None) if out.finished else self.open.get(out.request_id)
        if entry is None:
            return
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
                self.metrics.observe_ttft(now - entry.arrival)
        entry.output_ids += out.new_token_ids
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
        tensors = self._tensors(out, new, prev) + [tu.text_tensor("text_output", text)]
        entry.out.send(self.pb.InferenceResponse(output_tensors=tensors), final=out.finished)

    def _tensors(self, out: RequestOutput, new: list[int], prev: list[int]) -> list:
        return [tu.ids_tensor("output_ids", np.asarray(new, dtype=np.int32)),
                tu.ids_tensor("prev_ids", np.asarray(prev, dtype=np.int32)),
                tu.int_tensor("num_input_tokens", out.num_input_tokens),
                tu.int_tensor("num_output_tokens", out.num_output_tokens),
                tu.int_tensor("num_draft_tokens", out.num_draft_tokens),
                tu.int_tensor("num_accepted_tokens", out.num_accepted_tokens),
                tu.int_tensor("num_rounds", out.num_rounds),
                tu.text_tensor("finish_reason", out.finish_reason)]
