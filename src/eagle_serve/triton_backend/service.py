"""The engine thread of a `spec_decode` instance: Triton requests in, streamed responses out.

`submit` (called from the decoupled `execute`) validates a request and queues it, or answers it
at once with an error and FINAL; one background thread runs engine rounds while there is work,
sends each request's new tokens (stream) or its whole output (non-stream) with running totals,
polls client cancellation (every CANCEL_POLL_S at most), and keeps the Prometheus metrics
current; a second one makes each round's drafter call meanwhile. Inputs that NVIDIA's tools
send (genai-perf's TensorRT-LLM requests, Triton's OpenAI frontend) are read here too: aliases
of ours, flags with the one value that makes sense, and return_num_output_tokens, which makes
num_output_tokens count each response's tokens. Every request gets FINAL exactly once
(`_Stream`): on finish, bad input, cancellation, a failed model call, a timeout or shutdown. A
model call that times out or finds its model process dead (`ModelUnavailable`) breaks the
engine: every open request fails and `on_broken` stops the server so that its supervisor
restarts it.
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

from eagle_serve.core.grammar import MAX_GUIDE_BYTES
from eagle_serve.core.interfaces import ModelUnavailable
from eagle_serve.core.requests import (
    MAX_BAD_WORDS,
    MAX_CACHE_SALT_BYTES,
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from eagle_serve.core.tokenization import decode, decode_delta, detok_window
from eagle_serve.engine import Engine, EngineBusy
from eagle_serve.triton_backend import io as tu
from eagle_serve.triton_backend.metrics import EngineMetrics

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


@dataclass(frozen=True)
class ClientRequest:
    """One request as the engine and the responses need it."""
    prompt: list[int]
    direct: bool                    # came with text_input (send text_output back)
    params: SamplingParams
    stream: bool
    count_per_response: bool        # return_num_output_tokens: num_output_tokens is the number
    #                                 of tokens in each response (the vLLM and TensorRT-LLM
    #                                 backends' meaning, which Triton's OpenAI frontend sums)


# Inputs that NVIDIA's tools send under other names (TensorRT-LLM's): same meaning, same type.
ALIASES = {"seed": "random_seed", "min_tokens": "min_length", "stop": "stop_words"}


def read_request(request, tokenizer, max_input_bytes: int = 65536,
                 apply_chat_template: bool = True, defaults: dict | None = None) -> ClientRequest:
    """A Triton request's inputs -> ClientRequest (RequestError if bad). apply_chat_template:
    the default of the input of that name; defaults: the model's sampling defaults
    (settings.generation_defaults) for inputs the request does not send."""
    prompt, direct = read_prompt(request, tokenizer, max_input_bytes, apply_chat_template)
    params, stream = read_params(request, defaults=defaults or {})
    return ClientRequest(prompt, direct, params, stream,
                         bool(tu.scalar(request, "return_num_output_tokens", False)))


def read_prompt(request, tokenizer, max_input_bytes: int,
                apply_chat_template: bool = True) -> tuple[list[int], bool]:
    """-> prompt ids, and whether the request came with text (the direct path)."""
    ids = tu.prompt_ids(request, tokenizer, max_input_bytes, required=False,
                        apply_chat_template=apply_chat_template)
    if ids is not None:
        return ids, True
    ids = tu.row(request, "input_ids")
    if ids is None:
        raise tu.RequestError("send text_input (or input_ids)")
    if ids.size == 0:
        raise tu.RequestError("input_ids is empty")
    return [int(x) for x in ids], False


def read_params(request, max_stop_bytes: int = 4096, defaults: dict | None = None) -> tuple[SamplingParams, bool]:
    """One request's sampling parameters and stream flag (RequestError if bad)."""
    d = defaults or {}
    check_tool_inputs(request)
    k = tu.scalar(request, "num_speculative_tokens")
    topk, depth = tu.scalar(request, "draft_topk"), tu.scalar(request, "draft_depth")
    seed = aliased(request, "seed", tu.scalar)
    stop = aliased(request, "stop", lambda r, name: tu.texts(r, name, max_bytes=max_stop_bytes) or None)
    params = SamplingParams(
        max_tokens=int(tu.scalar(request, "max_tokens", d.get("max_tokens", 128))),
        temperature=float(tu.scalar(request, "temperature", d.get("temperature", 0.0))),
        top_p=float(tu.scalar(request, "top_p", d.get("top_p", 1.0))),
        top_k=int(tu.scalar(request, "top_k", d.get("top_k", 0))),
        seed=None if seed is None else int(seed),
        num_speculative_tokens=None if k is None else int(k),
        draft_topk=None if topk is None else int(topk),
        draft_depth=None if depth is None else int(depth),
        stop=tuple(stop or ()),
        ignore_eos=bool(tu.scalar(request, "ignore_eos", False)),
        context_lookup=bool(tu.scalar(request, "context_lookup", True)),
        corpus_lookup=bool(tu.scalar(request, "corpus_lookup", True)),
        min_tokens=int(aliased(request, "min_tokens", tu.scalar) or 0),
        cache_salt=tu.text(request, "cache_salt", "", max_bytes=MAX_CACHE_SALT_BYTES),
        **processor_params(request, d))
    return params, bool(tu.scalar(request, "stream", False))


def processor_params(request, defaults: dict) -> dict:
    """The logits processors' and logprobs' inputs -> SamplingParams fields (bounded before they
    are read into Python lists: eagle_serve.core.processors' limits)."""
    bias_ids, bias_values = (bounded_row(request, n, MAX_LOGIT_BIAS) for n in ("logit_bias_ids", "logit_bias_values"))
    if (bias_ids is None) != (bias_values is None) or (bias_ids is not None and bias_ids.size != bias_values.size):
        raise tu.RequestError("logit_bias_ids and logit_bias_values go together, one value per id")
    logprobs, prompt_logprobs = tu.scalar(request, "logprobs"), tu.scalar(request, "prompt_logprobs")
    if logprobs is None and tu.scalar(request, "return_log_probs", False):  # TensorRT-LLM's flag
        logprobs = 0
    stop_ids = bounded_row(request, "stop_token_ids", MAX_STOP_TOKEN_IDS)
    bad_words = bounded_row(request, "bad_words", MAX_BAD_WORDS)
    return dict(
        presence_penalty=float(tu.scalar(request, "presence_penalty", 0.0)),
        frequency_penalty=float(tu.scalar(request, "frequency_penalty", 0.0)),
        repetition_penalty=float(tu.scalar(request, "repetition_penalty", defaults.get("repetition_penalty", 1.0))),
        min_p=float(tu.scalar(request, "min_p", defaults.get("min_p", 0.0))),
        logit_bias=() if bias_ids is None else tuple(zip(bias_ids.tolist(), bias_values.tolist())),
        stop_token_ids=() if stop_ids is None else tuple(stop_ids.tolist()),
        bad_words=() if bad_words is None else tuple(tu.utf8(bytes(w), "bad_words", 256) for w in bad_words),
        logprobs=None if logprobs is None else int(logprobs),
        prompt_logprobs=None if prompt_logprobs is None else int(prompt_logprobs),
        guide=read_guide(request))


def read_guide(request) -> tuple[str, str] | None:
    """TensorRT-LLM's guided_decoding_guide_type and guided_decoding_guide (None: neither)."""
    kind = tu.text(request, "guided_decoding_guide_type", max_bytes=64)
    guide = tu.text(request, "guided_decoding_guide", "", max_bytes=MAX_GUIDE_BYTES)
    if kind is None:
        if guide:
            raise tu.RequestError("guided_decoding_guide needs guided_decoding_guide_type")
        return None
    return kind, guide


def bounded_row(request, name: str, limit: int) -> np.ndarray | None:
    values = tu.row(request, name)
    if values is not None and values.size > limit:
        raise tu.RequestError(f"input '{name}' may hold at most {limit} values, got {values.size}")
    return values


def aliased(request, name: str, read):
    """The value of input `name` or of its alias (None if neither is sent); both sent must agree."""
    values = {n: read(request, n) for n in (name, ALIASES[name])}
    given = {n: v for n, v in values.items() if v is not None}
    if len(given) == 2 and values[name] != values[ALIASES[name]]:
        raise tu.RequestError(f"inputs '{name}' and '{ALIASES[name]}' mean the same and disagree: "
                              f"{values[name]!r} vs {values[ALIASES[name]]!r}; send one of them")
    return next(iter(given.values()), None)


def check_tool_inputs(request) -> None:
    """Inputs NVIDIA's tools send that only one value of makes sense here (RequestError else).
    return_num_input_tokens is accepted and needs nothing: the counters are always sent."""
    if not tu.scalar(request, "exclude_input_in_output", True):
        raise tu.RequestError("exclude_input_in_output=false is not supported: the output never "
                              "includes the prompt")


class SpecDecodeService:
    def __init__(self, pb, engine: Engine, metrics: EngineMetrics | None = None,
                 max_input_bytes: int = 65536, draft_timeout_s: float = 0.0,
                 on_broken: Callable[[str], None] | None = None, apply_chat_template: bool = True,
                 defaults: dict | None = None):
        """on_broken(reason): called once when a model process is stuck or dead; spec_decode's
        model.py stops the server there, so its supervisor restarts it. apply_chat_template:
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
