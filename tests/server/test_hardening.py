"""Hostile and malformed clients against the real server: internal models refuse them, bad ids and
missing inputs are refused by name, stop strings are bounded, admin APIs need the key, a stuck
model process fails its requests within the timeout and takes the server down for a restart."""
from __future__ import annotations

import concurrent.futures as futures
import queue
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from triton_pool import hang_file, tiny_server, wait_until

from eagle_serve.client import grpc_generate
from eagle_serve.server.health import in_flight
from eagle_serve.testing import TINY_VOCAB

pytestmark = pytest.mark.server

PROMPT = "Write a haiku about the sea."


def tensor(name: str, array: np.ndarray, dtype: str):
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def stream_responses(url: str, model: str, inputs: list, settle_s: float = 1.0,
                     deadline_s: float = 120.0) -> tuple[list, int, str | None]:
    """Every response of one streamed request, until FINAL and `settle_s` more -> (responses,
    number of FINAL flags, last error)."""
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    responses, finals, error = [], 0, None
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            try:
                result, err = answers.get(timeout=settle_s if finals else 5.0)
            except queue.Empty:
                if finals:
                    break
                continue
            if err is not None:
                error, finals = str(err), finals + 1  # an error response closes the stream
                continue
            responses.append(result)
            final = result.get_response().parameters.get("triton_final_response")
            finals += int(final is not None and final.bool_param)
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    return responses, finals, error


def long_streams(url: str, n: int = 2, max_tokens: int = 48):
    """n streamed greedy requests running in threads -> (start, results)."""
    pool = futures.ThreadPoolExecutor(n)
    kw = dict(model="spec_decode", max_tokens=max_tokens, ignore_eos=True, stream=True)
    return [pool.submit(grpc_generate, url, f"{PROMPT} ({i})", **kw) for i in range(n)], kw


_SOLO: dict[tuple, list[list[int]]] = {}


def solo(url: str, n: int, kw: dict) -> list[list[int]]:
    """The long streams' outputs, each request alone (float64 greedy: the same on every call,
    so once per server)."""
    key = (url, n, tuple(sorted(kw.items())))
    if key not in _SOLO:
        _SOLO[key] = [grpc_generate(url, f"{PROMPT} ({i})", **kw).output_ids for i in range(n)]
    return _SOLO[key]


def i64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def hostile_inputs(model: str, feature_size: int) -> list:
    """A complete, well-formed call that would overwrite KV slots 0..7 (the first page, which
    the running requests hold) with garbage. Tiny servers run float64: features are FP64."""
    t = [tensor("input_ids", i64(range(100, 108)), "INT64"),
         tensor("positions", i64(range(8)), "INT64"),
         tensor("cu_seqlens", i64([0, 8]), "INT64"), tensor("seq_lens", i64([8]), "INT64"),
         tensor("block_tables", i64([[0]]), "INT64"), tensor("slot_mapping", i64(range(8)), "INT64"),
         tensor("temperature", np.zeros(1, np.float32), "FP32"), tensor("top_k", i64([0]), "INT64"),
         tensor("top_p", np.ones(1, np.float32), "FP32"), tensor("seeds", i64([0]), "INT64")]
    if model == "eagle_target":
        return t + [tensor("logit_rows", i64([7]), "INT64")]
    return t + [tensor("features", np.ones((8, feature_size)) * 50, "FP64"),
                tensor("num_drafts", i64([2]), "INT64"), tensor("draft_topk", i64([1]), "INT64"),
                tensor("draft_depth", i64([2]), "INT64"),
                tensor("draft_min_prob", np.zeros(1, np.float32), "FP32"),
                tensor("draft_expand_prob", np.zeros(1, np.float32), "FP32")]


@pytest.mark.parametrize("model", ["eagle_target", "eagle_drafter"])
def test_a_client_call_to_an_internal_model_is_refused_and_changes_no_kv(triton_server, tiny_models, model):
    server = tiny_server(triton_server, tiny_models, "eagle3")
    running, kw = long_streams(server.grpc_url)
    time.sleep(1.0)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    for _ in range(3):
        with pytest.raises(Exception, match="is internal: only spec_decode may call it"):
            client.infer(model, hostile_inputs(model, feature_size=3 * 64))
    outputs = [f.result(timeout=300) for f in running]
    assert all(g.error is None for g in outputs)
    assert [g.output_ids for g in outputs] == solo(server.grpc_url, 2, kw)


@pytest.mark.parametrize("bad_ids", [[5, -3, 7], [5, TINY_VOCAB, 7], [2 ** 31 - 1]])
def test_out_of_vocabulary_ids_are_refused_while_other_streams_run_unaffected(
        triton_server, tiny_models, bad_ids):
    server = tiny_server(triton_server, tiny_models, "eagle3")
    running, kw = long_streams(server.grpc_url)
    time.sleep(0.5)
    inputs = [tensor("input_ids", np.array([bad_ids], np.int32), "INT32"),
              tensor("max_tokens", np.array([[8]], np.int32), "INT32")]
    _, finals, error = stream_responses(server.grpc_url, "spec_decode", inputs)
    assert finals == 1 and error is not None and f"token ids must be in [0, {TINY_VOCAB})" in error, error
    outputs = [f.result(timeout=300) for f in running]
    assert all(g.error is None for g in outputs)
    assert [g.output_ids for g in outputs] == solo(server.grpc_url, 2, kw)


def test_the_ensemble_refuses_a_request_without_text_input(triton_server, tiny_models):
    server = tiny_server(triton_server, tiny_models, "eagle3")
    inputs = [tensor("max_tokens", np.array([[8]], np.int32), "INT32")]
    responses, finals, error = stream_responses(server.grpc_url, "ensemble", inputs)
    assert error is not None and "input 'text_input' is required" in error, (error, responses)
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/ensemble/generate",
                                     data=b'{"max_tokens": 8}', method="POST")
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=60)
    assert raised.value.code == 400 and b"text_input" in raised.value.read()


def test_stop_strings_beyond_the_limits_are_refused_and_at_the_limits_are_served_beside_others(
        triton_server, tiny_models):
    """The cost of stop strings is bounded by the limits and by scanning each new character
    once (test_stopping); here: the limits are enforced and a request at them is served."""
    server = tiny_server(triton_server, tiny_models, "eagle3")
    url = server.grpc_url
    many = grpc_generate(url, PROMPT, max_tokens=8, stop=[f"s{i}" for i in range(33)])
    assert many.error is not None and "at most 32 stop strings" in many.error
    long = grpc_generate(url, PROMPT, max_tokens=8, stop=["x" * 3000, "y" * 3000])
    assert long.error is not None and "at most 4096 bytes" in long.error
    heavy = [f"{i:03d}" + "z" * 125 for i in range(32)]  # exactly the limits: 32 strings, 4096 bytes

    def beside(stop):
        with futures.ThreadPoolExecutor(2) as pool:
            other = pool.submit(grpc_generate, url, "Count to fifty.", max_tokens=64,
                                ignore_eos=True, stop=stop, num_speculative_tokens=0)
            mine = grpc_generate(url, PROMPT, max_tokens=24, ignore_eos=True, num_speculative_tokens=0)
            assert other.result().error is None and mine.error is None
        assert other.result().counters["num_output_tokens"] == 64
        assert mine.counters["num_output_tokens"] == 24
        return mine.latency_s

    plain, loaded = beside(None), beside(heavy)
    print(f"a 24-token request beside one with 32 x 128-byte stop strings: {loaded:.2f} s, beside "
          f"one without: {plain:.2f} s ({loaded / plain:.2f}x; measured, not asserted)")


def test_admin_apis_need_the_admin_key(triton_server, tiny_models):
    server = tiny_server(triton_server, tiny_models, "eagle3")
    for path in ("/v2/models/stats", "/v2/models/spec_decode/config", "/v2/logging",
                 "/v2/systemsharedmemory/status", "/v2/trace/setting"):
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(f"http://{server.http_url}{path}", timeout=10)
        assert raised.value.code == 403, path
        keyed = urllib.request.Request(f"http://{server.http_url}{path}",
                                       headers={"eagle-admin-key": server.admin_key})
        assert urllib.request.urlopen(keyed, timeout=10).status == 200, path
    repo = urllib.request.Request(f"http://{server.http_url}/v2/repository/index", method="POST")
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(repo, timeout=10)
    assert raised.value.code == 403
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(Exception, match="(?i)permission|unavailable|restricted|denied"):
        client.get_inference_statistics("spec_decode")
    keyed = {"triton-grpc-protocol-eagle-admin-key": server.admin_key}  # gRPC prefixes the header
    assert client.get_inference_statistics("spec_decode", headers=keyed)
    assert client.is_server_ready() and client.get_model_metadata("ensemble")


def test_streams_end_with_exactly_one_final_on_success_and_on_bad_input(triton_server, tiny_models):
    server = tiny_server(triton_server, tiny_models, "eagle3")
    text = tensor("text_input", np.array([[PROMPT.encode()]], object), "BYTES")
    good = [text, tensor("max_tokens", np.array([[12]], np.int32), "INT32"),
            tensor("stream", np.array([[True]]), "BOOL")]
    bad = [text, tensor("temperature", np.array([[np.nan]], np.float32), "FP32")]
    for model in ("ensemble", "spec_decode"):
        responses, finals, error = stream_responses(server.grpc_url, model, good)
        assert finals == 1 and error is None and len(responses) > 1
        responses, finals, error = stream_responses(server.grpc_url, model, bad)
        assert finals == 1 and "temperature must be a finite number" in error


@pytest.mark.parametrize("model", ["eagle_drafter", "eagle_target"])
def test_a_model_call_that_hangs_fails_its_requests_in_time_and_turns_readiness_red(
        triton_server, tiny_models, model):
    """The drafter hangs in the EAGLE-1 tiny server, the target in the EAGLE-3 one: the last test
    on each in their xdist unit (SHARED_SERVERS, this module last)."""
    server = tiny_server(triton_server, tiny_models, "eagle1" if model == "eagle_drafter" else "eagle3")
    hang = hang_file(triton_server, server.name, model)
    results: dict = {}

    def run(i):
        results[i] = grpc_generate(server.grpc_url, f"{PROMPT} {i}", model="spec_decode",
                                   max_tokens=48, ignore_eos=True, stream=True, timeout_s=120)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert wait_until(lambda: in_flight(server.metrics_url) == 2, 30, 0.05), "the streams never ran"
    hang.touch()  # the next call of the model stalls: neither stream can end before it
    hung_at = time.monotonic()
    try:
        for t in threads:
            t.join(60)
        failed_after = max(time.monotonic() - hung_at, 0.0)
        assert all(r.error is not None and "did not answer within 3 s" in r.error
                   for r in results.values()), [r.error for r in results.values()]
        assert failed_after < 30
        red = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not red:
            try:
                with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=2) as r:
                    red = r.status != 200
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                red = True
            time.sleep(0.2)
        assert red, "readiness stayed green with a stuck model process"
        print(f"{model} hung: requests failed after {failed_after:.1f} s, then the server stopped")
    finally:
        hang.unlink(missing_ok=True)
        triton_server.discard(server.name)  # stopped: asked for again, it starts anew
