"""preprocess and postprocess served by the real tritonserver, over HTTP and gRPC."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from transformers.convert_slow_tokenizer import bytes_to_unicode
from triton_pool import prepost_server
from tritonclient.utils import InferenceServerException

from eagle_serve import paths
from eagle_serve.core.tokenization import decode, detok_window, encode_prompt, load_tokenizer

pytestmark = pytest.mark.server

EMOJI = "😀"
PROTOCOLS = ["http", "grpc"]


@pytest.fixture(scope="module")
def server(triton_server):
    return prepost_server(triton_server)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(paths.default_target_dir())


def infer(server, protocol: str, model: str, inputs: dict[str, np.ndarray]) -> dict:
    """Outputs of one request; `inputs` maps names to arrays with the batch dimension."""
    lib = httpclient if protocol == "http" else grpcclient
    url = server.http_url if protocol == "http" else server.grpc_url
    tensors = []
    for name, array in inputs.items():
        dtype = {np.dtype(object): "BYTES", np.dtype(bool): "BOOL"}.get(array.dtype, "INT32")
        tensor = lib.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    client = lib.InferenceServerClient(url)
    try:
        result = client.infer(model, tensors)
    finally:
        client.close()
    output_name = "input_ids" if model == "preprocess" else "text_output"
    return {output_name: result.as_numpy(output_name)}


def text_input(text: str | bytes, template: bool | None = None) -> dict[str, np.ndarray]:
    raw = text.encode() if isinstance(text, str) else text
    inputs = {"text_input": np.array([[raw]], dtype=object)}
    if template is not None:
        inputs["apply_chat_template"] = np.array([[template]], dtype=bool)
    return inputs


def ids_input(new_ids, prev_ids=(), finish_reason: str = "") -> dict[str, np.ndarray]:
    return {"output_ids": np.array([list(new_ids)], dtype=np.int32),
            "prev_ids": np.array([list(prev_ids)], dtype=np.int32),
            "finish_reason": np.array([[finish_reason.encode()]], dtype=object)}


def detokenize(server, protocol, new_ids, prev_ids=(), finish_reason="") -> str:
    out = infer(server, protocol, "postprocess", ids_input(new_ids, prev_ids, finish_reason))
    assert out["text_output"].shape == (1, 1)
    return out["text_output"][0, 0].decode()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("template", [True, False])
def test_preprocess_returns_the_ids_of_encode_prompt(server, tokenizer, protocol, template):
    prompt = "Write a haiku about caches. Ünïcödé 😀"
    out = infer(server, protocol, "preprocess", text_input(prompt, template))
    assert out["input_ids"].dtype == np.int32
    assert out["input_ids"].tolist() == [encode_prompt(tokenizer, prompt, template)]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_preprocess_applies_the_chat_template_by_default(server, tokenizer, protocol):
    out = infer(server, protocol, "preprocess", text_input("Hi"))
    assert out["input_ids"].tolist() == [encode_prompt(tokenizer, "Hi")]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("raw, message", [
    (b"caf\xe9", "is not valid UTF-8 (byte 0xe9 at offset 3)"),
    (b"", "is empty"),
    (b"x" * 65537, "65537 bytes, more than the limit of 65536"),
])
def test_preprocess_rejects_bad_text_clearly_and_keeps_serving(server, tokenizer, protocol, raw,
                                                               message):
    with pytest.raises(InferenceServerException, match="text_input") as error:
        infer(server, protocol, "preprocess", text_input(raw))
    assert message in error.value.message()
    out = infer(server, protocol, "preprocess", text_input("still fine", False))
    assert out["input_ids"].tolist() == [encode_prompt(tokenizer, "still fine", False)]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_preprocess_rejects_a_request_with_two_prompts(server, protocol):
    two = {"text_input": np.array([[b"a"], [b"b"]], dtype=object)}
    with pytest.raises(InferenceServerException) as error:
        infer(server, protocol, "preprocess", two)
    assert "batch size 2; send one prompt per request" in error.value.message()


def test_preprocess_answers_each_of_many_concurrent_requests_on_its_own(server, tokenizer):
    prompts = [f"prompt number {i}" if i % 3 else b"\xff bad" for i in range(12)]

    def one(prompt):
        try:
            return infer(server, "grpc", "preprocess", text_input(prompt, False))["input_ids"]
        except InferenceServerException as error:
            return error.message()

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, prompts))
    for prompt, result in zip(prompts, results):
        if isinstance(prompt, bytes):
            assert "not valid UTF-8" in result
        else:
            assert result.tolist() == [encode_prompt(tokenizer, prompt, False)]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_postprocess_turns_ids_into_their_text(server, tokenizer, protocol):
    text = "The cache was warm."
    ids = tokenizer.encode(text, add_special_tokens=False)
    head = decode(tokenizer, ids[:2])
    assert detokenize(server, protocol, ids[2:], ids[:2]) == text[len(head):]
    assert detokenize(server, protocol, ids + [tokenizer.eos_token_id], (), "stop") == text


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_postprocess_holds_back_an_incomplete_character_until_it_completes(server, tokenizer,
                                                                           protocol):
    vocab = tokenizer.get_vocab()
    byte_token = {b: vocab[c] for b, c in bytes_to_unicode().items() if c in vocab}
    ids = tokenizer.encode("ok", add_special_tokens=False) + [byte_token[b]
                                                              for b in EMOJI.encode()]
    assert detokenize(server, protocol, ids[:-2]) == "ok"
    assert detokenize(server, protocol, ids[-2:-1], ids[:-2]) == ""
    assert detokenize(server, protocol, ids[-1:], ids[:-1]) == EMOJI
    assert detokenize(server, protocol, ids[-2:-1], ids[:-2], "length") == "\ufffd"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_stream_of_postprocess_deltas_adds_up_to_the_whole_text(server, tokenizer, protocol):
    ids = tokenizer.encode("Grüße aus 東京 😀🎉 — done", add_special_tokens=False)
    deltas, sent = [], 0
    while sent < len(ids):
        new = ids[sent:sent + 2]
        last = sent + len(new) == len(ids)
        deltas.append(detokenize(server, protocol, new, detok_window(ids, sent),
                                 "length" if last else ""))
        sent += len(new)
    assert "".join(deltas) == decode(tokenizer, ids)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_postprocess_rejects_ids_outside_the_vocabulary(server, tokenizer, protocol):
    with pytest.raises(InferenceServerException) as error:
        detokenize(server, protocol, [5, len(tokenizer)])
    assert "outside the vocabulary" in error.value.message()
    fine = tokenizer.encode("fine", add_special_tokens=False)
    assert detokenize(server, protocol, fine) == "fine"


def test_the_server_became_ready_in_reasonable_time(server):
    assert 0 < server.ready_after_s < 120
