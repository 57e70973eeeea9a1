"""Bad input, exhaustion: a clear error for the bad request, nothing else affected."""
from __future__ import annotations

import concurrent.futures as futures

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from eagle_serve.client import grpc_generate, http_generate, metrics
from server import tiny_server

pytestmark = pytest.mark.server

PROMPT = "Write a haiku about the sea."


def small_cache_server(triton_server, tiny_models):
    """24 pages of 8 = 192 positions per pool: a burst overflows it many times."""
    return triton_server("tiny64-small-cache", overrides={"spec_decode": {
        "target_model": str(tiny_models["target"]), "drafter_model": str(tiny_models["eagle3"]),
        "dtype": "float64", "num_speculative_tokens": "3", "page_size": "8",
        "num_target_pages": "24", "num_drafter_pages": "24", "max_running": "8",
        "max_model_len": "160"}})


BAD = [
    (dict(max_tokens=0), "max_tokens must be >= 1"),
    (dict(max_tokens=3000), "exceeds max_model_len"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
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


def test_a_burst_of_three_times_the_cache_completes_with_solo_outputs(triton_server, tiny_models):
    server = small_cache_server(triton_server, tiny_models)
    prompts = [f"Tell me about the number {i}." for i in range(12)]
    kw = dict(max_tokens=40, ignore_eos=True, stream=True)
    solo = [grpc_generate(server.grpc_url, p, num_speculative_tokens=i % 4, **kw)
            for i, p in enumerate(prompts)]
    with futures.ThreadPoolExecutor(12) as pool:  # ~12 x 70 positions = 4x the 192-position pool
        burst = list(pool.map(lambda a: grpc_generate(server.grpc_url, a[1], num_speculative_tokens=a[0] % 4, **kw),
                              enumerate(prompts)))
    for s, b in zip(solo, burst):
        assert s.error is None and b.error is None
        assert b.output_ids == s.output_ids and len(b.output_ids) == 40
    m = metrics(server.metrics_url)
    assert m["eagle_preemptions_total"] > 0  # the burst really overflowed the cache
    assert m['eagle_kv_pages_free{pool="target"}'] == 24
