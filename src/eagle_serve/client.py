"""Talking to the `ensemble` model: gRPC streaming (tritonclient) and HTTP /generate.

One home for building the contract's inputs (DESIGN.md) from keyword parameters and for
collecting a streamed answer, shared by the CLIs, the benchmark, the load test and the tests.
"""
from __future__ import annotations

import json
import queue
import time
import urllib.request
from dataclasses import dataclass, field

import numpy as np

from eagle_serve.core.requests import acceptance_length

# name -> (triton dtype, numpy dtype) of the optional ensemble inputs
PARAMS = {
    "max_tokens": ("INT32", np.int32), "temperature": ("FP32", np.float32),
    "top_p": ("FP32", np.float32), "top_k": ("INT32", np.int32), "seed": ("UINT64", np.uint64),
    "num_speculative_tokens": ("INT32", np.int32), "draft_topk": ("INT32", np.int32),
    "draft_depth": ("INT32", np.int32), "ignore_eos": ("BOOL", np.bool_),
    "context_lookup": ("BOOL", np.bool_), "corpus_lookup": ("BOOL", np.bool_),
    "stream": ("BOOL", np.bool_), "apply_chat_template": ("BOOL", np.bool_),
    "min_tokens": ("INT32", np.int32), "cache_salt": ("BYTES", np.object_),
    "presence_penalty": ("FP32", np.float32), "frequency_penalty": ("FP32", np.float32),
    "repetition_penalty": ("FP32", np.float32), "min_p": ("FP32", np.float32),
    "logprobs": ("INT32", np.int32), "prompt_logprobs": ("INT32", np.int32),
    # lists [1, n]
    "logit_bias_ids": ("INT32", np.int32), "logit_bias_values": ("FP32", np.float32),
    "stop_token_ids": ("INT32", np.int32), "bad_words": ("BYTES", np.object_),
    "guided_decoding_guide_type": ("BYTES", np.object_), "guided_decoding_guide": ("BYTES", np.object_),
}
COUNTERS = ("num_input_tokens", "num_output_tokens", "num_draft_tokens", "num_accepted_tokens",
            "num_rounds", "num_cached_tokens")


@dataclass
class Generation:
    """A whole answer, assembled from one or more responses."""
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    finish_reason: str = ""
    num_responses: int = 0
    ttft_s: float | None = None      # first response with tokens, from sending
    latency_s: float = 0.0
    error: str | None = None
    chunks: list[str] = field(default_factory=list)
    times_s: list[float] = field(default_factory=list)  # arrival of each response with tokens

    @property
    def acceptance_length(self) -> float:
        return acceptance_length(self.counters.get("num_accepted_tokens", 0),
                                 self.counters.get("num_rounds", 0))

    def add(self, text: str, ids: list[int], counters: dict[str, int], finish_reason: str,
            started: float) -> None:
        self.num_responses += 1
        if ids:
            self.times_s.append(time.perf_counter() - started)
            if self.ttft_s is None:
                self.ttft_s = self.times_s[0]
        self.text += text
        self.chunks.append(text)
        self.output_ids += ids
        self.counters, self.finish_reason = counters, finish_reason


def grpc_inputs(text: str | list[int], stop: list[str] | None = None, **params) -> list:
    """text: a prompt, or its token ids (sent as input_ids)."""
    import tritonclient.grpc as grpcclient

    def tensor(name, array, dtype):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    if isinstance(text, str):
        inputs = [tensor("text_input", np.array([[text.encode()]], dtype=np.object_), "BYTES")]
    else:
        inputs = [tensor("input_ids", np.array([text], dtype=np.int32), "INT32")]
    for name, value in params.items():
        if value is None:
            continue
        if name not in PARAMS:
            raise ValueError(f"unknown parameter {name}")
        dtype, np_dtype = PARAMS[name]
        encode = lambda v: v.encode() if isinstance(v, str) else v  # noqa: E731
        values = [encode(v) for v in value] if isinstance(value, (list, tuple)) else [encode(value)]
        if values:
            inputs.append(tensor(name, np.array([values], dtype=np_dtype), dtype))
    if stop:
        inputs.append(tensor("stop", np.array([[s.encode() for s in stop]], dtype=np.object_), "BYTES"))
    return inputs


def _read_result(result) -> tuple[str, list[int], dict[str, int], str]:
    text = result.as_numpy("text_output").reshape(-1)[0].decode("utf-8", errors="replace")
    ids = result.as_numpy("output_ids").reshape(-1).tolist()
    counters = {c: int(result.as_numpy(c).reshape(-1)[0]) for c in COUNTERS}
    finish = result.as_numpy("finish_reason").reshape(-1)[0].decode()
    return text, ids, counters, finish


def grpc_generate(url: str, text: str, *, model: str = "ensemble", timeout_s: float = 300.0,
                  cancel_after_responses: int | None = None, on_chunk=None, **params) -> Generation:
    """One request over a gRPC stream (streaming or not, as params["stream"] says)."""
    import tritonclient.grpc as grpcclient

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    gen, started = Generation(), time.perf_counter()
    try:
        client.async_stream_infer(model, grpc_inputs(text, **params),
                                  enable_empty_final_response=True)
        deadline = started + timeout_s
        while True:
            result, error = answers.get(timeout=max(0.1, deadline - time.perf_counter()))
            if error is not None:
                gen.error = str(error)
                break
            response = result.get_response()
            final = response.parameters.get("triton_final_response")
            if result.as_numpy("text_output") is not None:
                gen.add(*_read_result(result), started)
                if on_chunk:
                    on_chunk(gen.chunks[-1])
            if final is not None and final.bool_param:
                break
            if cancel_after_responses is not None and gen.num_responses >= cancel_after_responses:
                gen.finish_reason = "cancelled-by-client"
                break
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    gen.latency_s = time.perf_counter() - started
    return gen


def request_body(text: str, stop: list[str] | None = None, **params) -> dict:
    """The JSON body of an HTTP /generate or /generate_stream request (unset params left out)."""
    body = {"text_input": text, **{k: v for k, v in params.items() if v is not None}}
    if stop:
        body["stop"] = stop
    return body


def _body(text: str, stop: list[str] | None = None, **params) -> bytes:
    return json.dumps(request_body(text, stop, **params)).encode()


def http_generate(url: str, text: str, *, model: str = "ensemble", timeout_s: float = 300.0,
                  **params) -> Generation:
    """POST /v2/models/<model>/generate: one JSON answer (stream must be false)."""
    gen, started = Generation(), time.perf_counter()
    request = urllib.request.Request(f"http://{url}/v2/models/{model}/generate",
                                     data=_body(text, **params), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            _add_json(gen, json.loads(response.read()), started)
    except urllib.error.HTTPError as error:
        gen.error = json.loads(error.read() or b"{}").get("error", str(error))
    gen.latency_s = time.perf_counter() - started
    return gen


def http_generate_stream(url: str, text: str, *, model: str = "ensemble",
                         timeout_s: float = 300.0, on_chunk=None, **params) -> Generation:
    """POST /v2/models/<model>/generate_stream: server-sent events, one per response."""
    gen, started = Generation(), time.perf_counter()
    request = urllib.request.Request(f"http://{url}/v2/models/{model}/generate_stream",
                                     data=_body(text, **params), method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                gen.error = event["error"]
                break
            _add_json(gen, event, started)
            if on_chunk and gen.chunks:
                on_chunk(gen.chunks[-1])
    gen.latency_s = time.perf_counter() - started
    return gen


def _add_json(gen: Generation, body: dict, started: float) -> None:
    if "error" in body:
        gen.error = body["error"]
        return
    ids = body.get("output_ids", [])
    ids = ids if isinstance(ids, list) else [ids]
    gen.add(body.get("text_output", ""), ids, {c: int(body.get(c, 0)) for c in COUNTERS},
            body.get("finish_reason", ""), started)


def metrics(url: str) -> dict[str, float]:
    """Prometheus text from the metrics port as {"name{labels}": value}."""
    with urllib.request.urlopen(f"http://{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values
