"""Request-parsing helpers of the Python-backend models, against a stand-in for pb_utils."""
import fake_pb
import numpy as np
import pytest

from eagle_serve.core.tokenization import encode_prompt, load_tokenizer
from eagle_serve.testing import write_tiny_tokenizer
from eagle_serve.triton_backend import client_request as cr
from eagle_serve.triton_backend import io as tu


@pytest.fixture
def pb_utils(monkeypatch):
    return fake_pb.install(monkeypatch)


def request(**arrays) -> dict:
    return {name: fake_pb.Tensor(name, np.asarray(a)) for name, a in arrays.items()}


def test_scalar_reads_a_one_value_input_or_falls_back_to_the_default(pb_utils):
    r = request(max_tokens=np.array([[7]], np.int32), stream=np.array([[True]]))
    assert cr.scalar(r, "max_tokens", 128) == 7 and type(cr.scalar(r, "max_tokens")) is int
    assert cr.scalar(r, "stream", False) is True
    assert cr.scalar(r, "temperature", 0.0) == 0.0


def test_a_missing_required_input_is_a_request_error(pb_utils):
    with pytest.raises(cr.RequestError, match="input 'input_ids' is required"):
        cr.row(request(), "input_ids", required=True)


def test_a_batch_of_more_than_one_row_is_refused_with_a_clear_message(pb_utils):
    r = request(input_ids=np.zeros((2, 5), np.int32))
    with pytest.raises(cr.RequestError, match="batch size 2; send one prompt per request"):
        cr.row(r, "input_ids")


def test_a_scalar_input_with_several_values_is_refused(pb_utils):
    with pytest.raises(cr.RequestError, match="exactly one value, got 3"):
        cr.scalar(request(top_k=np.array([[1, 2, 3]], np.int32)), "top_k")


def test_text_decodes_utf8_and_names_the_first_bad_byte_or_the_limit(pb_utils):
    assert cr.text(request(t=np.array([["héllo".encode()]], object)), "t") == "héllo"
    with pytest.raises(cr.RequestError, match=r"not valid UTF-8 \(byte 0xc3 at offset 1\)"):
        cr.text(request(t=np.array([[b"h\xc3"]], object)), "t")
    with pytest.raises(cr.RequestError, match="has 5 bytes, more than the limit of 4"):
        cr.text(request(t=np.array([[b"hello"]], object)), "t", max_bytes=4)
    assert cr.text(request(), "t", default="") == ""


def test_texts_reads_every_string_of_a_list_input(pb_utils):
    r = request(stop=np.array([[b"\n\n", "ñ".encode()]], object))
    assert cr.texts(r, "stop") == ["\n\n", "ñ"]
    assert cr.texts(request(), "stop") == []


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(write_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"), 512))


def test_prompt_ids_encode_text_input_through_the_chat_template_unless_told_not_to(pb_utils, tokenizer):
    text = np.array([[b"Hi there"]], object)
    assert cr.prompt_ids(request(text_input=text), tokenizer, 100) == encode_prompt(tokenizer, "Hi there")
    raw = request(text_input=text, apply_chat_template=np.array([[False]]))
    assert cr.prompt_ids(raw, tokenizer, 100) == encode_prompt(tokenizer, "Hi there", False)
    assert cr.prompt_ids(request(), tokenizer, 100, required=False) is None
    raw_by_default = cr.prompt_ids(request(text_input=text), tokenizer, 100, apply_chat_template=False)
    assert raw_by_default == encode_prompt(tokenizer, "Hi there", False)


@pytest.mark.parametrize("inputs, message", [
    ({}, "input 'text_input' is required"),
    (dict(text_input=np.array([[b""]], object)), "input 'text_input' is empty"),
    (dict(text_input=np.array([[b"hello"]], object)), "has 5 bytes, more than the limit of 4"),
    (dict(text_input=np.array([[b"\xff"]], object)), "not valid UTF-8"),
])
def test_bad_text_input_is_a_request_error_naming_what_is_wrong(pb_utils, tokenizer, inputs, message):
    with pytest.raises(cr.RequestError, match=message):
        cr.prompt_ids(request(**inputs), tokenizer, 4)


def test_a_tokenizer_without_a_chat_template_takes_raw_prompts_only(pb_utils, tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", None)
    with pytest.raises(cr.RequestError, match="no chat template: send apply_chat_template=false"):
        cr.prompt_ids(request(text_input=np.array([[b"Hi"]], object)), tokenizer, 100)
    raw = request(text_input=np.array([[b"Hi"]], object), apply_chat_template=np.array([[False]]))
    assert cr.prompt_ids(raw, tokenizer, 100) == encode_prompt(tokenizer, "Hi", False)


def test_output_tensors_carry_a_batch_dimension_of_one(pb_utils):
    assert tu.ids_tensor("ids", [1, 2, 3]).array.tolist() == [[1, 2, 3]]
    assert tu.ids_tensor("ids", []).array.shape == (1, 0)
    assert tu.int_tensor("n", 4).array.dtype == np.int32
    assert tu.text_tensor("t", "ñ").array.tolist() == [["ñ".encode()]]


def test_respond_each_answers_every_request_and_keeps_failures_to_their_own(pb_utils):
    def handler(r):
        if r["kind"] == "bad":
            raise cr.RequestError("bad input")
        if r["kind"] == "bug":
            raise KeyError("oops")
        return ["ok"]

    responses = tu.respond_each([{"kind": "good"}, {"kind": "bad"}, {"kind": "bug"},
                                 {"kind": "good"}], handler)
    assert [r.output_tensors for r in responses] == [["ok"], [], [], ["ok"]]
    assert (responses[1].error.message(), responses[1].error.code) == ("bad input", "INVALID_ARG")
    assert responses[2].error.code == "INTERNAL"
    assert "internal error (error id" in responses[2].error.message()
    assert "oops" not in responses[2].error.message() and "oops" in pb_utils.logged[0]


def test_instance_count_adds_up_groups_and_gpus():
    config = {"instance_group": [{"kind": "KIND_GPU", "count": 2, "gpus": [0, 1]},
                                 {"kind": "KIND_CPU", "count": 1}]}
    assert tu.instance_count(config) == 5
    with pytest.raises(ValueError, match="exactly one instance, config asks for 5"):
        tu.require_single_instance(config)
    tu.require_single_instance({"instance_group": [{"kind": "KIND_CPU", "count": 1}]})


def test_model_parameters_are_plain_strings():
    config = {"parameters": {"dtype": {"string_value": "float64"}, "x": {}}}
    assert tu.model_parameters(config) == {"dtype": "float64", "x": ""}
    assert tu.flag("True") and tu.flag("1") and not tu.flag("false") and not tu.flag("")
