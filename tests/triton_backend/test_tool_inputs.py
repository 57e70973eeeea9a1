"""The inputs NVIDIA's tools send (genai-perf's TensorRT-LLM requests, Triton's OpenAI frontend),
read by spec_decode's service in-process (fake pb_utils, tiny float64 models)."""
from __future__ import annotations

import fake_pb
import numpy as np
import pytest
from fake_pb import text_request, wait_final

from eagle_serve.testing import tiny_engine
from eagle_serve.triton_backend.service import SpecDecodeService

PROMPT = "Tell me a short story about a lighthouse."


@pytest.fixture
def pb(monkeypatch):
    return fake_pb.install(monkeypatch)


@pytest.fixture
def run(pb, tiny_models):
    """run(*requests) -> the requests, each answered with FINAL (one service for the test)."""
    engine = tiny_engine(tiny_models["target"], tiny_models["eagle3"], num_speculative_tokens=2)
    service = SpecDecodeService(pb, engine, None)

    def answer(*requests):
        for r in requests:
            service.submit(r)
        wait_final(list(requests))
        return requests
    yield answer
    service.shutdown()


def scalar(array) -> np.ndarray:
    return np.array([[array]])


def words(*texts: str) -> np.ndarray:
    return np.array([[t.encode() for t in texts]], object)


def ids(request) -> list[int]:
    assert request.sender.error is None, request.sender.error
    return request.sender.output_ids()


def test_tensorrt_llm_names_are_read_as_ours(run):
    sampled = dict(temperature=scalar(np.float32(0.9)), max_tokens=12)
    seed, random_seed, other_seed = run(
        text_request(PROMPT, seed=scalar(np.uint64(5)), **sampled),
        text_request(PROMPT, random_seed=scalar(np.uint64(5)), **sampled),
        text_request(PROMPT, random_seed=scalar(np.uint64(6)), **sampled))
    assert ids(seed) == ids(random_seed) != ids(other_seed)
    whole, = run(text_request(PROMPT, max_tokens=12))
    text = whole.sender.sent[-1][0].output("text_output").reshape(-1)[0].decode()
    stop_at = text[len(text) // 2:][:3]
    stop, stop_words = run(text_request(PROMPT, max_tokens=12, stop=words(stop_at)),
                           text_request(PROMPT, max_tokens=12, stop_words=words(stop_at)))
    assert ids(stop) == ids(stop_words) and len(ids(stop)) < len(ids(whole))
    min_length, = run(text_request(PROMPT, max_tokens=12, min_length=scalar(np.int32(13))))
    assert "min_tokens must be in [0, max_tokens = 12], got 13" in min_length.sender.error


@pytest.mark.parametrize("inputs, message", [
    (dict(seed=scalar(np.uint64(1)), random_seed=scalar(np.uint64(2))),
     "inputs 'seed' and 'random_seed' mean the same and disagree: 1 vs 2"),
    (dict(min_tokens=scalar(np.int32(1)), min_length=scalar(np.int32(2))),
     "inputs 'min_tokens' and 'min_length' mean the same and disagree"),
    (dict(stop=words("a"), stop_words=words("b")), "inputs 'stop' and 'stop_words' mean the same"),
    (dict(exclude_input_in_output=scalar(False)),
     "exclude_input_in_output=false is not supported: the output never includes the prompt"),
    (dict(frequency_penalty=scalar(np.float32(3))), "frequency_penalty must be in [-2, 2], got 3.0"),
    (dict(presence_penalty=scalar(np.float32(-5))), "presence_penalty must be in [-2, 2], got -5.0"),
    (dict(logit_bias_ids=np.array([[1, 2]], np.int32)), "logit_bias_ids and logit_bias_values go together"),
    (dict(stop_token_ids=np.arange(100, dtype=np.int32).reshape(1, -1)),
     "input 'stop_token_ids' may hold at most 64 values, got 100"),
    (dict(logprobs=scalar(np.int32(21))), "logprobs must be in [0, 20], got 21"),
])
def test_a_tool_input_that_cannot_be_honoured_gets_a_clear_error(run, inputs, message):
    bad, good = run(text_request(PROMPT, max_tokens=4, **inputs), text_request(PROMPT, max_tokens=4))
    assert bad.sender.finals == 1 and message in bad.sender.error, bad.sender.error
    assert good.sender.error is None


def test_the_values_the_tools_send_are_accepted(run):
    agreeing = dict(seed=scalar(np.uint64(3)), random_seed=scalar(np.uint64(3)),
                    stop=words("zz"), stop_words=words("zz"), min_tokens=scalar(np.int32(2)),
                    min_length=scalar(np.int32(2)), exclude_input_in_output=scalar(True),
                    return_num_input_tokens=scalar(True), frequency_penalty=scalar(np.float32(0.5)),
                    presence_penalty=scalar(np.float32(0.2)), return_log_probs=scalar(True))
    request, = run(text_request(PROMPT, max_tokens=4, **agreeing))
    assert len(ids(request)) == 4


def test_return_num_output_tokens_makes_num_output_tokens_count_each_response(run):
    totals, per_response = run(
        text_request(PROMPT, max_tokens=16, stream=True),
        text_request(PROMPT, max_tokens=16, stream=True, return_num_output_tokens=scalar(True)))

    def counts(request, name):
        return [int(r.output(name).reshape(-1)[0]) for r, _ in request.sender.sent if r is not None]

    def sizes(request):
        return [r.output("output_ids").size for r, _ in request.sender.sent if r is not None]
    assert len(sizes(per_response)) > 2 and ids(totals) == ids(per_response)
    assert counts(per_response, "num_output_tokens") == sizes(per_response)
    assert sum(counts(per_response, "num_output_tokens")) == 16
    assert counts(totals, "num_output_tokens") == list(np.cumsum(sizes(totals)))
    assert counts(per_response, "num_input_tokens") == counts(totals, "num_input_tokens")


def test_the_models_generation_config_gives_the_defaults_of_unset_inputs(pb, tmp_path):
    """vLLM's `--generation-config auto`: a model whose authors chose sampling defaults gets
    them where a request sets nothing; what a request sends wins."""
    import json

    from eagle_serve.settings import generation_defaults
    from eagle_serve.triton_backend.client_request import read_params
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 64,
         "do_sample": True, "eos_token_id": 2}))
    defaults = generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 64}
    params, _ = read_params(fake_pb.Request(text_input=np.array([[PROMPT.encode()]], object)), defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty, params.max_tokens) == (
        0.6, pytest.approx(0.9), 20, pytest.approx(1.1), 64)
    params, _ = read_params(text_request(PROMPT, temperature=scalar(np.float32(0)), max_tokens=scalar(np.int32(5))),
                            defaults=defaults)
    assert (params.temperature, params.max_tokens, params.top_k) == (0.0, 5, 20)
    assert generation_defaults(tmp_path / "missing") == {}
