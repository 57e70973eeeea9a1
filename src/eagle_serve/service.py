"""The engine thread of a `spec_decode` instance: Triton requests in, streamed responses out.

`submit` (called from the decoupled `execute`) validates a request and queues it, or answers it
at once with an error and FINAL; one background thread runs engine rounds while there is work,
sends each request's new tokens (stream) or its whole output (non-stream) with running totals,
polls client cancellation every round, and keeps the Prometheus metrics current; a second one
makes each round's drafter call meanwhile. Every request
gets FINAL exactly once: on finish, error, cancellation or shutdown.
"""
from __future__ import annotations

import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from eagle_serve import triton_utils as tu
from eagle_serve.engine import Engine, EngineBusy, RequestOutput, SamplingParams
from eagle_serve.metrics import EngineMetrics
from eagle_serve.tokenization import decode, decode_delta, detok_window, encode_prompt


@dataclass
class _Open:
    sender: object
    stream: bool
    direct: bool                    # called with text_input: send text_output too
    arrival: float
    output_ids: list[int] = field(default_factory=list)
    num_sent: int = 0
    first_token_at: float | None = None


def read_prompt(request, tokenizer, max_input_bytes: int) -> tuple[list[int], bool]:
    """-> prompt ids, and whether the request came with text (the direct path)."""
    text = tu.text(request, "text_input", max_bytes=max_input_bytes)
    if text is not None:
        if not text:
            raise tu.RequestError("text_input is empty")
        template = bool(tu.scalar(request, "apply_chat_template", True))
        return encode_prompt(tokenizer, text, template), True
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
                 max_input_bytes: int = 65536):
        self.pb, self.engine, self.metrics = pb, engine, metrics
        self.max_input_bytes = max_input_bytes
        self.open: dict[str, _Open] = {}
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
        sender = request.get_response_sender()
        if self._thread.ident is None and not self._stopping:
            self._thread.start()
        try:
            prompt, direct = read_prompt(request, self.engine.tokenizer, self.max_input_bytes)
            params, stream = read_params(request)
            with self._wake:
                self._ids += 1
                rid = f"{request.request_id() or 'req'}#{self._ids}"
                self.open[rid] = _Open(sender, stream, direct, time.perf_counter())
                try:
                    self.engine.add_request(prompt, params, rid)
                except Exception:
                    del self.open[rid]
                    raise
                self._wake.notify()
        except (tu.RequestError, ValueError) as error:
            self._final_error(sender, str(error))
        except EngineBusy as error:
            self._final_error(sender, str(error), "UNAVAILABLE")

    def shutdown(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._drafting.shutdown(wait=False)
        for rid in list(self.open):
            self._final_error(self.open.pop(rid).sender, "the server is shutting down", "UNAVAILABLE")

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
            except Exception as error:  # a model call failed: fail the batch, keep serving
                self.pb.Logger.log_error(traceback.format_exc())
                for rid in self.engine.fail_all():
                    if rid in self.open:
                        self._final_error(self.open.pop(rid).sender, f"engine error: {error}", "INTERNAL")

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
        finally:
            drafting.result()  # the engine is whole again before anything else touches it

    def _poll_cancellations(self) -> None:
        for rid, entry in list(self.open.items()):
            if entry.sender.is_cancelled():
                self.engine.abort(rid)

    def _respond(self, out: RequestOutput) -> None:
        entry = self.open.get(out.request_id)
        if entry is None:
            return
        now = time.perf_counter()
        if out.new_token_ids and entry.first_token_at is None:
            entry.first_token_at = now
            if self.metrics:
                self.metrics.observe_ttft(now - entry.arrival)
        entry.output_ids += out.new_token_ids
        if out.finished:
            del self.open[out.request_id]
            if self.metrics and len(entry.output_ids) > 1 and entry.first_token_at is not None:
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
        flags = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if out.finished else 0
        try:
            tensors = self._tensors(out, new, prev) + [tu.text_tensor("text_output", text)]
            entry.sender.send(self.pb.InferenceResponse(output_tensors=tensors), flags=flags)
        except Exception:  # the client is gone; still close the stream once
            if out.finished:
                self._send_final(entry.sender)

    def _tensors(self, out: RequestOutput, new: list[int], prev: list[int]) -> list:
        return [tu.ids_tensor("output_ids", np.asarray(new, dtype=np.int32)),
                tu.ids_tensor("prev_ids", np.asarray(prev, dtype=np.int32)),
                tu.int_tensor("num_input_tokens", out.num_input_tokens),
                tu.int_tensor("num_output_tokens", out.num_output_tokens),
                tu.int_tensor("num_draft_tokens", out.num_draft_tokens),
                tu.int_tensor("num_accepted_tokens", out.num_accepted_tokens),
                tu.int_tensor("num_rounds", out.num_rounds),
                tu.text_tensor("finish_reason", out.finish_reason)]

    def _final_error(self, sender, message: str, code: str = "INVALID_ARG") -> None:
        try:
            sender.send(tu.error_response(message, code),
                        flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:
            self._send_final(sender)

    def _send_final(self, sender) -> None:
        try:
            sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:
            pass
