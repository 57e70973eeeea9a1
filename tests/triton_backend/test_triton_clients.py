"""NVIDIA's tools against the real tritonserver: the exact requests genai-perf 0.0.16 and
Triton's OpenAI frontend (r25.11 and later) build, and the metrics names the dashboards and
aiperf read, checked against the responses' own counters.

genai-perf (`--endpoint-type kserve --backend tensorrtllm --streaming`, TensorRTLLMConverter):
one JSON record per prompt, {text_input: [text], max_tokens: [256 or N], exclude_input_in_output:
[true], stream: [true], min_length: [N] with --output-tokens-mean-deterministic}, which
perf_analyzer sends as tensors of the model's declared types with a batch dimension ([1, 1]),
refusing any key the model does not declare. Triton's OpenAI frontend (engine/utils/triton.py,
_create_trtllm_generate_request, used for every model that is not a vLLM backend model): text_input
BYTES [1, 1] (the prompt it rendered with the chat template itself), stream BOOL, max_tokens INT32,
stop_words BYTES [1, n], top_p / temperature FP32, seed UINT64, frequency_penalty /
presence_penalty FP32 when given, exclude_input_in_output BOOL on /v1/completions with `echo`,
return_num_input_tokens / return_num_output_tokens BOOL; its usage sums num_output_tokens over
the responses of a stream.
"""
from __future__ import annotations

import queue
import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from triton_pool import default_server, tight_server

from eagle_serve.client import metrics
from eagle_serve.core.requests import SamplingParams
from eagle_serve.core.tokenization import decode, encode_prompt
from eagle_serve.local import build_local_engine

pytestmark = pytest.mark.server


def tensor(name: str, value, dtype: str):
    import tritonclient.grpc as grpcclient

    array = np.asarray(value, dtype=np.object_ if dtype == "BYTES" else None)
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


class Refused(Exception):
    """The server answered a request with an error (its message)."""


def send(url: str, model: str, inputs: list, timeout_s: float = 300.0) -> list[dict]:
    """One request over a gRPC stream -> every response, as {output: value} plus "final"
    (Refused if the server answers with an error)."""
    import tritonclient.grpc as grpcclient

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    responses = []
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        deadline = time.monotonic() + timeout_s
        while True:
            result, error = answers.get(timeout=max(0.1, deadline - time.monotonic()))
            if error is not None:
                raise Refused(error.message())
            final = result.get_response().parameters.get("triton_final_response")
            response = {"final": bool(final and final.bool_param)}
            if result.as_numpy("output_ids") is not None:
                response |= {out.name: result.as_numpy(out.name).reshape(-1)
                             for out in result.get_response().outputs}
            responses.append(response)
            if response["final"]:
                return responses
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def genai_perf_request(text: str, max_tokens: int, deterministic: bool) -> list:
    """What TensorRTLLMConverter and perf_analyzer send for one prompt (--streaming)."""
    inputs = [tensor("text_input", [[text.encode()]], "BYTES"),
              tensor("max_tokens", np.array([[max_tokens]], np.int32), "INT32"),
              tensor("exclude_input_in_output", np.array([[True]]), "BOOL"),
              tensor("stream", np.array([[True]]), "BOOL")]
    if deterministic:
        inputs.append(tensor("min_length", np.array([[max_tokens]], np.int32), "INT32"))
    return inputs


def frontend_request(prompt: str, stream: bool, max_tokens: int, *, stop=(), seed=None,
                     temperature=None, top_p=None, echo=None) -> list:
    """What _create_trtllm_generate_request sends (echo: /v1/completions' field)."""
    inputs = [tensor("text_input", [[prompt.encode()]], "BYTES"),
              tensor("stream", np.array([[stream]]), "BOOL"),
              tensor("max_tokens", np.array([[max_tokens]], np.int32), "INT32")]
    if stop:
        inputs.append(tensor("stop_words", [[s.encode() for s in stop]], "BYTES"))
    for name, value, dtype in (("top_p", top_p, np.float32), ("seed", seed, np.uint64),
                               ("temperature", temperature, np.float32)):
        if value is not None:
            inputs.append(tensor(name, np.array([[value]], dtype), "UINT64" if dtype is np.uint64 else "FP32"))
    if echo is not None:
        inputs.append(tensor("exclude_input_in_output", np.array([[not echo]]), "BOOL"))
    return inputs + [tensor(f"return_num_{what}_tokens", np.array([[True]]), "BOOL")
                     for what in ("input", "output")]


def output_ids(responses) -> list[int]:
    return [int(i) for r in responses if "output_ids" in r for i in r["output_ids"]]


def text(responses) -> str:
    return "".join(r["text_output"][0].decode() for r in responses if "text_output" in r)


def usage(responses) -> tuple[int, int]:
    """The OpenAI frontend's usage: num_input_tokens of the first response, num_output_tokens
    summed over all of them."""
    counted = [r for r in responses if "num_output_tokens" in r]
    return int(counted[0]["num_input_tokens"][0]), sum(int(r["num_output_tokens"][0]) for r in counted)


# ---- genai-perf ----

def test_the_request_genai_perf_builds_is_served_with_deterministic_lengths(triton_server):
    """min_length = max_tokens (--output-tokens-mean-deterministic) gives exactly that many
    tokens where the model would stop early on its own; without it, EOS ends the answer."""
    server = default_server(triton_server)
    question = "What is the capital of France?"
    free = send(server.grpc_url, "ensemble", genai_perf_request(question, 24, deterministic=False))
    exact = send(server.grpc_url, "ensemble", genai_perf_request(question, 24, deterministic=True))
    for responses in (free, exact):
        assert responses[-1]["final"] and len(responses) > 2
        assert int(responses[-1]["num_output_tokens"][0]) == len(output_ids(responses))
    assert "Paris" in text(free) and free[-1]["finish_reason"][0] == b"stop"
    assert len(output_ids(free)) < 24
    assert len(output_ids(exact)) == 24 and exact[-1]["finish_reason"][0] == b"length"
    assert output_ids(exact)[:len(output_ids(free)) - 1] == output_ids(free)[:-1]  # up to EOS


# ---- Triton's OpenAI frontend ----

@pytest.fixture(scope="module")
def raw_prompt_server(triton_server, tiny_models):
    """A tiny server with the chat template off by default: the frontend templates itself (the
    tight one, whose limits these sequential requests stay within)."""
    return tight_server(triton_server, tiny_models)


@pytest.fixture(scope="module")
def local(tiny_models):
    return build_local_engine(tiny_models["target"], None, dtype="float64", num_target_pages=256)


def rendered(tokenizer, question: str) -> str:
    """The prompt the frontend renders for one user message (add_generation_prompt=True)."""
    return tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": question}],
                                         tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("model", ["ensemble", "spec_decode"])
def test_the_request_tritons_openai_frontend_builds_is_served(raw_prompt_server, local, model):
    prompt = rendered(local.tokenizer, "Write a haiku about the sea.")
    ids = encode_prompt(local.tokenizer, prompt, apply_chat_template=False)
    plain = local.generate([ids], SamplingParams(max_tokens=20, num_speculative_tokens=0))[0].token_ids
    stop = decode(local.tokenizer, plain[8:10]).strip()[:4] or "\n"
    expected = local.generate([ids], SamplingParams(max_tokens=20, num_speculative_tokens=0,
                                                    stop=(stop, "never seen")))[0].token_ids
    assert len(expected) < 20  # the stop string matters
    chat = send(raw_prompt_server.grpc_url, model, frontend_request(
        prompt, True, 20, stop=[stop, "never seen"], seed=7, temperature=0.0, top_p=1.0))
    assert chat[-1]["final"] and len(chat) > 2 and output_ids(chat) == expected
    assert usage(chat) == (len(ids), len(expected))  # no second template; counts summed right
    assert text(chat) == decode(local.tokenizer, expected)

    completion = send(raw_prompt_server.grpc_url, model, frontend_request(
        prompt, False, 12, echo=False))
    assert len(completion) == 1 and completion[0]["final"]  # the frontend accepts 1 or 2
    assert output_ids(completion) == plain[:12] and usage(completion) == (len(ids), 12)

    sampled = [send(raw_prompt_server.grpc_url, model, frontend_request(
        prompt, True, 12, seed=11, temperature=0.8, top_p=0.9)) for _ in range(2)]
    assert output_ids(sampled[0]) == output_ids(sampled[1])
    assert usage(sampled[0])[1] == len(output_ids(sampled[0]))


def test_the_frontends_penalties_are_honoured_and_echo_gets_a_clear_error(raw_prompt_server):
    prompt = "The sea is"
    for name, value, dtype, message in (("frequency_penalty", np.float32(2.5), "FP32", r"must be in \[-2, 2\]"),
                                        ("exclude_input_in_output", False, "BOOL", "never includes")):
        inputs = frontend_request(prompt, False, 4) + [tensor(name, np.array([[value]]), dtype)]
        with pytest.raises(Refused, match=message):
            send(raw_prompt_server.grpc_url, "ensemble", inputs)
    penalised = frontend_request(prompt, False, 4) + [tensor("presence_penalty", np.array([[0.5]], np.float32), "FP32")]
    assert len(output_ids(send(raw_prompt_server.grpc_url, "ensemble", penalised))) == 4


# ---- metrics ----

def stop_inside(responses, start: int, end: int) -> str:
    """The last 3 characters of the text streamed with output tokens [start, end): a stop
    string that ends the same greedy answer before `end` tokens."""
    chunks, count = [], 0
    for r in responses:
        if "output_ids" in r:
            count += len(r["output_ids"])
            if count > start:
                chunks.append(r["text_output"][0].decode())
            if count >= end:
                break
    assert "".join(chunks)[-3:].strip(), chunks
    return "".join(chunks)[-3:]


def scrape(url: str) -> dict:
    """{(name, labels as sorted tuple): value} via prometheus_client's parser (aiperf's):
    counter families lose the `_total` suffix there, samples keep it."""
    import urllib.request
    with urllib.request.urlopen(f"http://{url}/metrics", timeout=10) as response:
        families = list(text_string_to_metric_families(response.read().decode()))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples} | {
        ("family", f.name): f.type for f in families}


def test_vllm_names_and_the_new_metrics_agree_with_the_responses(raw_prompt_server):
    server = raw_prompt_server  # (counts alone are compared: the chat template does not matter)
    model = (("model_name", "tiny-llama"),)
    jobs = [dict(max_tokens=16, k=3), dict(max_tokens=12, k=2, temperature=0.7, seed=3),
            dict(max_tokens=10, k=0), dict(max_tokens=14, k=3, stop=True)]
    before = scrape(server.metrics_url)
    answers = []
    for job in jobs:
        inputs = genai_perf_request("Tell me about lighthouses.", job["max_tokens"], deterministic=False)
        inputs.append(tensor("num_speculative_tokens", np.array([[job["k"]]], np.int32), "INT32"))
        if "temperature" in job:
            inputs += [tensor("temperature", np.array([[job["temperature"]]], np.float32), "FP32"),
                       tensor("random_seed", np.array([[job["seed"]]], np.uint64), "UINT64")]
        if job.get("stop"):  # greedy k=3 repeats the first answer: stop inside its tokens 4-8
            inputs += [tensor("stop_words", [[stop_inside(answers[0], 3, 8).encode()]], "BYTES"),
                       tensor("min_length", np.array([[2]], np.int32), "INT32")]
        answers.append(send(server.grpc_url, "ensemble", inputs))
    last = [a[-1] for a in answers]

    def total(name):
        return sum(int(r[name][0]) for r in last)
    after = scrape(server.metrics_url)

    def delta(name, labels=()):
        key = (name, tuple(sorted(model + labels)) if name.startswith("vllm:") else tuple(sorted(labels)))
        return after[key] - before.get(key, 0.0)

    drafts = delta("vllm:spec_decode_num_drafts_total")
    assert delta("vllm:spec_decode_num_draft_tokens_total") == total("num_draft_tokens") > 0
    assert delta("eagle_spec_decode_draft_tokens_total") == total("num_draft_tokens")
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == total("num_accepted_tokens")
    assert delta("eagle_spec_decode_drafts_total") == drafts
    rounds, n = total("num_rounds"), len(jobs)
    speculative_rounds = sum(int(r["num_rounds"][0]) for r, job in zip(last, jobs) if job["k"])
    assert speculative_rounds - 2 * 3 <= drafts <= speculative_rounds - 3 and rounds > drafts
    positions = [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(j)),))
                 for j in range(8)]
    assert sum(positions) == total("num_accepted_tokens") and positions[0] <= drafts
    assert positions == [delta("eagle_spec_decode_accepted_tokens_per_position_total",
                               (("position", str(j + 1)),)) for j in range(8)]
    accepted = after[("vllm:spec_decode_num_accepted_tokens_total", model)]
    assert after[("eagle_spec_decode_mean_acceptance_length", ())] == pytest.approx(
        1 + accepted / after[("vllm:spec_decode_num_drafts_total", model)])
    reasons = [r["finish_reason"][0].decode() for r in last]
    for reason in ("stop", "length"):
        assert delta("vllm:request_success_total", (("finished_reason", reason),)) == reasons.count(reason)
        assert delta("eagle_requests_finished_total", (("finish_reason", reason),)) == reasons.count(reason)
    assert reasons.count("stop") >= 1
    for ours, theirs, counter in (("eagle_prompt_tokens_total", "vllm:prompt_tokens_total", "num_input_tokens"),
                                  ("eagle_generation_tokens_total", "vllm:generation_tokens_total",
                                   "num_output_tokens")):
        assert delta(ours) == delta(theirs) == total(counter)
    for ours, theirs in (("eagle_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds"),
                         ("eagle_request_queue_time_seconds", "vllm:request_queue_time_seconds"),
                         ("eagle_time_to_first_token_seconds", "vllm:time_to_first_token_seconds")):
        assert delta(ours + "_count") == delta(theirs + "_count") == n
        assert delta(ours + "_sum") == pytest.approx(delta(theirs + "_sum"))
    assert after[("family", "vllm:spec_decode_num_drafts")] == "counter"
    assert after[("family", "eagle_spec_decode_mean_acceptance_length")] == "gauge"
    assert metrics(server.metrics_url)["eagle_spec_decode_rounds_total"] >= rounds  # old names stay
