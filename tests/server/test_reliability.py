"""Bad input, exhaustion: a clear error for the bad request, nothing else affected."""
from __future__ import annotations

import concurrent.futures as futures
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from triton_pool import tight_server, tiny_server

from eagle_serve.client import grpc_generate, http_generate, metrics
from eagle_serve.tools.soak import run_soak

pytestmark = pytest.mark.server

PROMPT = "Write a haiku about the sea."


BAD = [
    (dict(max_tokens=0), "max_tokens must be >= 1"),
    (dict(max_tokens=5000), "exceeds max_model_len"),  # the tiny model reads 4,096 tokens
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens must be in [0, 8]"),
    (dict(num_speculative_tokens=9), "num_speculative_tokens must be in [0, 8]"),
]


@pytest.mark.parametrize("model", ["ensemble", "spec_decode"])
def test_each_bad_parameter_gets_its_message_and_the_next_request_is_unchanged(
        triton_server, tiny_models, model):
    server = tiny_server(triton_server, tiny_models, "eagle3")
    before = grpc_generate(server.grpc_url, PROMPT, model=model, max_tokens=16, ignore_eos=True)
    assert before.error is None
    for params, message in BAD:
        bad = grpc_generate(server.grpc_url, PROMPT, model=model, **{"max_tokens": 16, **params})
        assert bad.error is not None and message in bad.error, (params, bad.error)
        after = grpc_generate(server.grpc_url, PROMPT, model=model, max_tokens=16, ignore_eos=True)
        assert after.error is None and after.output_ids == before.output_ids


def raw_stream(url: str, model: str, tensors: dict[str, tuple[np.ndarray, str]]) -> str | None:
    """Send hand-made tensors (to reach errors the typed client cannot make); -> error text."""
    import queue
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: answers.put(error))
    inputs = []
    for name, (array, dtype) in tensors.items():
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        inputs.append(t)
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        error = answers.get(timeout=60)
        return None if error is None else str(error)
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


@pytest.mark.parametrize("tensors, message", [
    ({"text_input": (np.array([[b"\xff\xfe broken"]], dtype=np.object_), "BYTES")}, "not valid UTF-8"),
    ({"text_input": (np.array([[b""]], dtype=np.object_), "BYTES")}, "empty"),
    ({"text_input": (np.array([[b"x" * 70000]], dtype=np.object_), "BYTES")}, "more than the limit"),
    ({"text_input": (np.array([[b"hi"], [b"ho"]], dtype=np.object_), "BYTES")}, "batch size"),
    ({"text_input": (np.array([[b"hi"]], dtype=np.object_), "BYTES"),
      "max_tokens": (np.array([[1.5]], dtype=np.float32), "FP32")}, "max_tokens"),
])
@pytest.mark.parametrize("model", ["ensemble", "spec_decode"])
def test_malformed_input_gets_a_clear_error(triton_server, tiny_models, tensors, message, model):
    server = tiny_server(triton_server, tiny_models, "eagle3")
    error = raw_stream(server.grpc_url, model, tensors)
    assert error is not None and message in error, error
    good = http_generate(server.http_url, PROMPT, max_tokens=8)
    assert good.error is None and good.output_ids




def test_a_request_that_could_never_fit_the_cache_is_refused_and_nothing_else_changes(
        triton_server, tiny_models):
    server = tight_server(triton_server, tiny_models)
    before = grpc_generate(server.grpc_url, PROMPT, max_tokens=16, ignore_eos=True)
    huge = grpc_generate(server.grpc_url, PROMPT, max_tokens=120, ignore_eos=True)
    assert huge.error is not None and "KV positions" in huge.error, huge.error
    after = grpc_generate(server.grpc_url, PROMPT, max_tokens=16, ignore_eos=True)
    assert after.error is None and after.output_ids == before.output_ids


def test_beyond_the_waiting_queue_requests_get_server_busy_and_the_rest_are_exact(
        triton_server, tiny_models):
    server = tight_server(triton_server, tiny_models)
    kw = dict(max_tokens=16, ignore_eos=True, stream=True)
    solo = grpc_generate(server.grpc_url, PROMPT, **kw)
    with futures.ThreadPoolExecutor(8) as pool:
        burst = list(pool.map(lambda _: grpc_generate(server.grpc_url, PROMPT, **kw), range(8)))
    busy = [g for g in burst if g.error is not None]
    served = [g for g in burst if g.error is None]
    assert busy and all("server busy" in g.error for g in busy), [g.error for g in busy]
    assert served and all(g.output_ids == solo.output_ids for g in served)
    idle = {'eagle_kv_pages_free{pool="target"}': 12, 'eagle_kv_pages_free{pool="drafter"}': 12}
    assert wait_for_metrics(server.metrics_url, idle), metrics(server.metrics_url)


def wait_for_metrics(url: str, expected: dict[str, float], deadline_s: float = 30.0) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        m = metrics(url)
        if all(m.get(k) == v for k, v in expected.items()):
            return True
        time.sleep(0.2)
    return False


def test_a_six_second_soak_serves_every_request_and_leaks_nothing(triton_server, tiny_models, tmp_path):
    """The CI-sized version of `python -m eagle_serve.tools.soak` (README: the 10-minute run)."""
    server = tiny_server(triton_server, tiny_models, "eagle3")
    report = run_soak("localhost", server.grpc_port, server.metrics_port, server.process.pid,
                      duration_s=6, users=4, out=tmp_path, log=lambda _: None)
    requests = report["requests"]
    assert requests["stream"]["count"] > 10, requests
    assert all(v["failures"] == 0 for v in requests.values()), (requests, (tmp_path / "locust.log").read_text()[-3000:])
    assert all(v == 0 for v in report["leaked"].values()), report
    assert all(report["model_processes_alive"].values()) and len(report["model_processes_alive"]) >= 3
    assert (tmp_path / "soak.png").stat().st_size > 0


def test_a_burst_of_three_times_the_cache_completes_with_solo_outputs(triton_server, tiny_models):
    server = tiny_server(triton_server, tiny_models, "eagle1")  # SMALL_CACHE
    prompts = [f"Tell me about the number {i}." for i in range(12)]
    kw = dict(max_tokens=24, ignore_eos=True, stream=True)
    solo = [grpc_generate(server.grpc_url, p, num_speculative_tokens=i % 4, **kw)
            for i, p in enumerate(prompts)]
    with futures.ThreadPoolExecutor(12) as pool:  # ~12 x 54 positions = 3x the 192-position pool
        burst = list(pool.map(lambda a: grpc_generate(server.grpc_url, a[1], num_speculative_tokens=a[0] % 4, **kw),
                              enumerate(prompts)))
    for s, b in zip(solo, burst):
        assert s.error is None and b.error is None
        assert b.output_ids == s.output_ids and len(b.output_ids) == kw["max_tokens"]
    assert metrics(server.metrics_url)["eagle_preemptions_total"] > 0  # the burst overflowed the cache
    idle = {'eagle_kv_pages_free{pool="target"}': 24, 'eagle_kv_pages_free{pool="drafter"}': 24}
    assert wait_for_metrics(server.metrics_url, idle), metrics(server.metrics_url)
