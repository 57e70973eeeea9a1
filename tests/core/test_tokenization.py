"""Prompt encoding and stateless incremental detokenization on the real default tokenizer."""
import copy
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.convert_slow_tokenizer import bytes_to_unicode

from eagle_serve import paths
from eagle_serve.core.tokenization import (
    WINDOW,
    decode,
    decode_delta,
    detok_window,
    encode_prompt,
    load_tokenizer,
    render_chat,
    stable_prefix,
    text_tokenizer,
    tokenizer_cache_file,
)

EMOJI = "😀"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(paths.default_target_dir())


@pytest.fixture(scope="module")
def byte_ids(tokenizer) -> dict[int, int]:
    """byte -> id of the single-byte token (the vocabulary lacks a few never-used bytes)."""
    vocab = tokenizer.get_vocab()
    return {b: vocab[c] for b, c in bytes_to_unicode().items() if c in vocab}


@pytest.fixture(scope="module")
def partial_ids(tokenizer) -> list[int]:
    """Vocabulary tokens whose bytes end (or start) in the middle of a character."""
    return [i for i in range(tokenizer.vocab_size) if "\ufffd" in decode(tokenizer, [i])]


def as_byte_tokens(byte_ids, data: bytes) -> list[int]:
    return [byte_ids[b] for b in data]


def stream(tokenizer, ids, chunk_sizes, window=WINDOW, check_prompt=False) -> list[str]:
    """The deltas postprocess returns when ids arrive in chunks, each with the `window` ids
    before it; the last chunk is final. With `check_prompt`, also checks that after every
    chunk all the text but an incomplete tail has gone out."""
    deltas, sent = [], 0
    for i, size in enumerate(chunk_sizes):
        new = ids[sent:sent + size]
        prev = ids[max(0, sent - window):sent]
        deltas.append(decode_delta(tokenizer, prev, new, final=i == len(chunk_sizes) - 1))
        sent += len(new)
        if check_prompt and i < len(chunk_sizes) - 1:
            assert "".join(deltas) == stable_prefix(decode(tokenizer, ids[:sent]))
    assert sent == len(ids)
    return deltas


def test_encode_prompt_wraps_the_text_as_one_user_message_with_the_assistant_turn_opened(
        tokenizer):
    ids = encode_prompt(tokenizer, "What is 2+2?")
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                             add_generation_prompt=True)["input_ids"]
    assert ids == list(expected)
    assert decode(tokenizer, ids, skip_special_tokens=False).endswith(
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_encode_prompt_without_template_encodes_the_raw_text_and_adds_no_special_tokens(
        tokenizer):
    ids = encode_prompt(tokenizer, "Once upon a time", apply_chat_template=False)
    assert ids == tokenizer.encode("Once upon a time", add_special_tokens=False)
    assert not set(ids) & set(tokenizer.all_special_ids)
    assert decode(tokenizer, ids) == "Once upon a time"


def test_encode_prompt_refuses_the_chat_template_when_the_tokenizer_has_none(tokenizer):
    plain = copy.copy(tokenizer)
    plain.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(plain, "hi")


def test_decode_delta_returns_the_text_the_new_ids_add(tokenizer):
    ids = tokenizer.encode("Hello there, general Kenobi", add_special_tokens=False)
    assert decode_delta(tokenizer, ids[:3], ids[3:], final=False) == decode(
        tokenizer, ids)[len(decode(tokenizer, ids[:3])):]
    assert decode_delta(tokenizer, [], ids, final=False) == "Hello there, general Kenobi"


def test_an_emoji_split_across_tokens_is_held_back_until_complete(tokenizer, byte_ids):
    ids = as_byte_tokens(byte_ids, b"a" + EMOJI.encode())  # a, F0, 9F, 98, 80
    assert decode_delta(tokenizer, [], ids[:3], final=False) == "a"
    assert decode_delta(tokenizer, ids[:3], ids[3:4], final=False) == ""
    assert decode_delta(tokenizer, ids[:4], ids[4:], final=False) == EMOJI


def test_the_final_delta_flushes_an_incomplete_character(tokenizer, byte_ids):
    ids = as_byte_tokens(byte_ids, b"ok" + EMOJI.encode()[:2])
    assert decode_delta(tokenizer, ids[:2], ids[2:], final=False) == ""
    assert decode_delta(tokenizer, ids[:2], ids[2:], final=True) == "\ufffd"
    assert decode_delta(tokenizer, ids, [], final=True) == "\ufffd"


def test_special_tokens_are_skipped_unless_asked_for(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Done.", add_special_tokens=False) + [eos]
    assert decode_delta(tokenizer, [], ids, final=True) == "Done."
    assert decode_delta(tokenizer, [], ids, final=True,
                        skip_special_tokens=False) == "Done." + tokenizer.eos_token


def test_detok_window_is_the_ids_just_before_the_new_ones():
    ids = list(range(100, 140))
    assert detok_window(ids, 0) == []
    assert detok_window(ids, 5) == ids[:5]
    assert detok_window(ids, 30) == ids[30 - WINDOW:30]
    assert len(detok_window(ids, 30)) == WINDOW


def test_a_window_of_8_ids_can_lose_a_held_back_tail_that_the_default_window_keeps(
        tokenizer, byte_ids):
    # the window of 8 starts inside the emoji, then a real U+FFFD and an incomplete char
    ids = as_byte_tokens(byte_ids, b"x" + EMOJI.encode() + "\ufffd".encode() + b"\xe1\x80a")
    whole = decode(tokenizer, ids)
    assert "".join(stream(tokenizer, ids, [10, 1], window=8)) != whole
    assert "".join(stream(tokenizer, ids, [10, 1])) == whole


TEXTS = st.text(alphabet=st.sampled_from("aZ é中😀€\ufffd\n.,ñ𝄞"), min_size=1, max_size=6)


@st.composite
def token_streams(draw, tokenizer, byte_ids, partial_ids):
    """Ids mixing whole-text tokens, single bytes (valid or not), multi-byte characters split
    into byte tokens, vocabulary tokens that end mid-character, and a few special tokens;
    plus how they are chunked into responses (an empty chunk now and then)."""
    byte_values = sorted(byte_ids)
    piece = st.one_of(
        TEXTS.map(lambda t: tokenizer.encode(t, add_special_tokens=False)),
        st.lists(st.sampled_from(byte_values), min_size=1, max_size=4).map(
            lambda bs: [byte_ids[b] for b in bs]),
        TEXTS.map(lambda t: [byte_ids[b] for b in t.encode()]),
        st.sampled_from(partial_ids).map(lambda i: [i]),
    )
    ids = [i for p in draw(st.lists(piece, min_size=1, max_size=20)) for i in p]
    for _ in range(draw(st.integers(0, 6))):
        ids.insert(draw(st.integers(0, len(ids))), draw(st.sampled_from(tokenizer.all_special_ids)))
    sizes = []
    while sum(sizes) < len(ids):
        sizes.append(min(draw(st.integers(0, 6)), len(ids) - sum(sizes)))
    if draw(st.booleans()):
        sizes.append(0)  # a final response that carries no new ids
    return ids, sizes


def test_concatenated_deltas_equal_the_decode_of_all_ids(tokenizer, byte_ids, partial_ids):
    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(token_streams(tokenizer, byte_ids, partial_ids))
    def check(case):
        ids, sizes = case
        assert "".join(stream(tokenizer, ids, sizes, check_prompt=True)) == decode(tokenizer, ids)

    check()


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀 <|im_end|>"},
        {"role": "assistant", "content": "Hello!", "tool_calls": None}, {"role": "user", "content": "2+2?"}]
PROMPTS = ["Once upon a time", "  two  spaces\n\ttab", "<|im_start|>user\nhi<|im_end|>", "中文 é 𝄞 \ufffd",
           "def f(x):\n    return x ** 2  # code", "<|endoftext|>"]


@pytest.fixture(scope="module")
def cached_text_tokenizer(tokenizer, tmp_path_factory):
    """(built from the Hugging Face tokenizer, read back from the cache it wrote)"""
    folder = paths.default_target_dir()
    os.environ["EAGLE_CACHE"], before = str(tmp_path_factory.mktemp("cache")), os.environ.get("EAGLE_CACHE")
    try:
        built = text_tokenizer(folder)
        assert tokenizer_cache_file(folder).exists()
        return built, text_tokenizer(folder)
    finally:
        os.environ.pop("EAGLE_CACHE") if before is None else os.environ.update(EAGLE_CACHE=before)


def test_the_text_tokenizer_encodes_and_renders_chats_as_the_hugging_face_tokenizer(
        tokenizer, cached_text_tokenizer):
    for ours in cached_text_tokenizer:
        assert len(ours) == len(tokenizer) and ours.get_vocab() == tokenizer.get_vocab()
        assert render_chat(ours, CHAT) == render_chat(tokenizer, CHAT)
        for text in PROMPTS + [" padded", "<|im_start|>user"]:
            for special in (True, False):
                assert ours.encode(text, special) == tokenizer.encode(text, add_special_tokens=special)
        for text in PROMPTS:
            for template in (True, False):
                assert encode_prompt(ours, text, template) == encode_prompt(tokenizer, text, template)


def test_a_tool_use_template_renders_tools_as_the_hugging_face_tokenizer(tmp_path, monkeypatch):
    """A tokenizer with named templates renders with "tool_use" when tools are given (the
    OpenAI server's tool_call_template "model"); editing that template changes the cache key."""
    hf = load_tokenizer(paths.default_target_dir())
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))  # the cache files this test writes
    tools_first = "{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
    hf.chat_template = {"default": hf.chat_template, "tool_use": tools_first + hf.chat_template}
    folder = tmp_path / "tokenizer"
    hf.save_pretrained(folder)
    hf = load_tokenizer(folder)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    built, cached = text_tokenizer(folder), text_tokenizer(folder)
    for ours in (built, cached):
        for offered in (tools, None):
            want = hf.apply_chat_template(CHAT, tools=offered, add_generation_prompt=True, tokenize=False)
            assert ours.apply_chat_template(CHAT, tools=offered, add_generation_prompt=True) == want
        assert "[tool weather]" in ours.apply_chat_template(CHAT, tools=tools)
    key = tokenizer_cache_file(folder)
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text(tools_first)
    assert tokenizer_cache_file(folder) != key


def test_a_process_that_only_decodes_imports_no_transformers():
    """postprocess: its tokenizer leaves transformers (the chat template renderer) out; a
    renderer (preprocess, spec_decode) imports it with its tokenizer, not at a first request."""
    import subprocess
    import sys

    text_tokenizer(paths.default_target_dir())  # the machine's cache holds it from now on
    script = ("import sys\nfrom eagle_serve import paths\n"
              "from eagle_serve.core.tokenization import text_tokenizer\n"
              "renders = sys.argv[1] == 'chat'\n"
              "ours = text_tokenizer(paths.default_target_dir(), renders_chat=renders)\n"
              "assert ours.decode(ours.encode('Hello there')) == 'Hello there'\n"
              "assert ('transformers' in sys.modules) == renders, sorted(sys.modules)\n")
    for mode in ("decode", "chat"):
        done = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True)
        assert done.returncode == 0, (mode, done.stderr[-2000:])


def test_the_text_tokenizer_decodes_any_ids_as_the_hugging_face_tokenizer(
        tokenizer, cached_text_tokenizer, byte_ids, partial_ids):
    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(token_streams(tokenizer, byte_ids, partial_ids), st.booleans())
    def check(case, skip):
        ids, _ = case
        for ours in cached_text_tokenizer:
            assert decode(ours, ids, skip) == decode(tokenizer, ids, skip)

    check()


def test_an_edited_tokenizer_file_is_a_new_cache_entry(tmp_path, monkeypatch):
    default = paths.default_target_dir()
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "tok"
    folder.mkdir()
    for file in default.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (folder / file.name).write_bytes(file.read_bytes())
    before = tokenizer_cache_file(folder)
    assert text_tokenizer(folder).chat_template and before.exists()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    assert tokenizer_cache_file(folder) != before
    assert render_chat(text_tokenizer(folder), CHAT[:2]) == "[Be brief.][Hi 😀 <|im_end|>]"


def test_a_grammars_vocabulary_from_the_text_tokenizer_is_the_hugging_face_tokenizers(
        tokenizer, cached_text_tokenizer, monkeypatch):
    """xgrammar's TokenizerInfo, built from the Hugging Face tokenizer once and then read back
    from the cache (spec_decode's TextTokenizer has no Hugging Face tokenizer to build it)."""
    import xgrammar as xgr

    from eagle_serve.core import grammar, tokenization

    want = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152, stop_token_ids=[2])
    built, read = cached_text_tokenizer
    got = [grammar.tokenizer_info(built, 49152, (2,))]
    monkeypatch.setattr(tokenization, "load_tokenizer", lambda folder: pytest.fail("not cached"))
    got.append(grammar.tokenizer_info(read, 49152, (2,)))
    for info in got:
        assert info.decoded_vocab == want.decoded_vocab and info.vocab_size == want.vocab_size
        assert (info.vocab_type, info.add_prefix_space) == (want.vocab_type, want.add_prefix_space)
        assert info.stop_token_ids == want.stop_token_ids and info.special_token_ids == want.special_token_ids


def test_eos_ids_and_vocabulary_size_are_read_as_transformers_reads_them(tmp_path):
    from transformers import AutoConfig, GenerationConfig

    from eagle_serve.core.tokenization import eos_token_ids
    from eagle_serve.settings import model_vocab_size

    default = paths.default_target_dir()
    assert eos_token_ids(default) == (GenerationConfig.from_pretrained(default).eos_token_id,)
    assert model_vocab_size(default) == AutoConfig.from_pretrained(default).vocab_size
    config = json.loads((default / "config.json").read_text())
    for eos, want in ((7, (7,)), ([3, 4], (3, 4)), (None, ())):
        (tmp_path / "config.json").write_text(json.dumps(config | {"eos_token_id": eos}))
        assert eos_token_ids(tmp_path) == want  # no generation_config.json: config.json's
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
        assert eos_token_ids(tmp_path) == (9,)
        (tmp_path / "generation_config.json").unlink()
