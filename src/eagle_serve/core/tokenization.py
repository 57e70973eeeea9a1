"""Text <-> token ids for the preprocess, postprocess and spec_decode models.

`encode_prompt` turns a user message (or a raw prompt) into the ids the target sees.
`decode_delta` is a stateless incremental detokenizer: given a short window of earlier ids and
the new ones, it returns the text the new ones add. Knows nothing about Triton or the engine.

Held-back text: a stream can end a response in the middle of a multi-byte UTF-8 character,
which the tokenizer decodes to U+FFFD. Up to `HOLD` trailing U+FFFD are never emitted early;
the next call re-decodes them from its window (they are in `prev_ids`) and emits them once the
character is complete, or as they are when `final` is set. `HOLD` is 3 because an incomplete
character has at most 3 bytes: byte-level decoders (GPT-2/Llama-3 style) turn it into one
U+FFFD, byte-fallback decoders (SentencePiece/Llama-2 style) into one per byte.

Window: spec_decode sends the `WINDOW` ids before each chunk (`detok_window`), held-back ones
included. A window cut inside a character decodes that character's first (up to 3) bytes as
stray U+FFFD; from there on it decodes exactly like the full text. The deltas are exact when
the held-back tail (<= 3 U+FFFD) lies after those stray bytes, which holds once the window
carries 3 + 7 bytes (7 bytes always decode to 3 characters or to one that is not U+FFFD). Every
id but a skipped special token carries at least one byte, so 16 ids are exact with up to 6 of
those in the window; 8 are not enough (see the counter-example in the tests). The property
"concatenated deltas == decode(all ids)" is tested with hypothesis on the default (byte-level)
tokenizer; byte-fallback decoders turn a whole run of byte tokens into U+FFFD when any of it is
invalid, so for them it holds as long as byte tokens form valid UTF-8 (as a model's text does).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

REPLACEMENT = "\ufffd"
HOLD = 3
WINDOW = 16
# the files a tokenizer is made of (weights excluded): they key text_tokenizer's cache
_TOKENIZER_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
_CACHE_FORMAT = 2  # the fields text_tokenizer saves: a new one means a new key


def load_tokenizer(folder: str | Path):
    """The Hugging Face tokenizer of a model folder (tokenizer.json and chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


@dataclass(frozen=True)
class TextTokenizer:
    """A Hugging Face tokenizer's encode, decode, vocabulary and chat template on the
    `tokenizers` backend alone, for preprocess, postprocess, spec_decode and the OpenAI server:
    transformers' AutoTokenizer imports its config classes and with them torch's compiler and
    distributed packages in every such process at every start (docs/performance.md, "Start-up").
    It is the Hugging Face tokenizer's own backend, saved once per machine by `text_tokenizer`,
    so ids and text are that tokenizer's; it answers the calls the functions below and the
    engine make of one.
    `cache_file` is where it was saved and `folder` the model folder it came from (a grammar's
    vocabulary is built from the Hugging Face tokenizer there once: eagle_serve.core.grammar)."""
    backend: object  # tokenizers.Tokenizer
    chat_template: str | None
    template_tokens: dict  # special_tokens_map: bos_token, eos_token, ... which templates read
    size: int  # len() of the Hugging Face tokenizer
    tool_chat_template: str | None = None  # the one it renders with tools (a "tool_use" template)
    folder: str = ""
    cache_file: str = ""

    def __len__(self) -> int:
        return self.size

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False) -> str:
        assert not clean_up_tokenization_spaces, "decode is additive only without clean-up"
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = False) -> str:
        """What the Hugging Face tokenizer's apply_chat_template(..., tokenize=False) renders."""
        from transformers.utils.chat_template_utils import render_jinja_template

        template = self.chat_template if tools is None else self.tool_chat_template
        assert not tokenize and template
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        rendered, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=template,
                                            add_generation_prompt=add_generation_prompt,
                                            **self.template_tokens)
        return rendered[0]


def text_tokenizer(folder: str | Path, renders_chat: bool = True) -> TextTokenizer:
    """The TextTokenizer of a model folder, from the machine's cache (`tokenizer_cache_file`),
    else from the Hugging Face tokenizer, which then fills the cache (where it cannot be
    written: used uncached). A process reads a cache file once: engines built one after the
    other (benchmarks, tests) share what it holds, which no caller changes. `renders_chat`:
    the caller renders chat templates, whose renderer (transformers') is imported now rather
    than at the first request; a process that only decodes (postprocess) leaves it out."""
    cached = tokenizer_cache_file(folder)
    if cached.exists():
        tokenizer = _read_cached(cached, str(folder))
    else:
        hf = load_tokenizer(folder)
        templated = bool(getattr(hf, "chat_template", None))
        saved = {"backend": hf.backend_tokenizer.to_str(),
                 "chat_template": hf.get_chat_template() if templated else None,
                 "tool_chat_template": hf.get_chat_template(tools=[]) if templated else None,
                 "template_tokens": hf.special_tokens_map, "size": len(hf)}
        write_atomically(cached, json.dumps(saved))
        tokenizer = _text_tokenizer(saved, str(folder), str(cached))
    if renders_chat and tokenizer.chat_template:
        from transformers.utils import chat_template_utils  # noqa: F401
    return tokenizer


@functools.lru_cache(maxsize=8)
def _read_cached(cached: Path, folder: str) -> TextTokenizer:
    return _text_tokenizer(json.loads(cached.read_text(encoding="utf-8")), folder, str(cached))


def _text_tokenizer(saved: dict, folder: str, cache_file: str) -> TextTokenizer:
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(saved["backend"])
    backend.no_truncation()
    backend.no_padding()
    return TextTokenizer(backend, saved["chat_template"], saved["template_tokens"], saved["size"],
                         saved["tool_chat_template"], folder, cache_file)


def tokenizer_cache_file(folder: str | Path) -> Path:
    """EAGLE_CACHE/tokenizers/<key>.json, keyed by the tokenizer files' bytes (the named chat
    templates in additional_chat_templates/ too), the transformers version (which builds the
    backend) and the format of the saved fields."""
    from importlib.metadata import version

    from eagle_serve import paths

    digest = hashlib.sha256(f"{version('transformers')} {_CACHE_FORMAT}".encode())
    folder = Path(folder)
    for file in sorted([*folder.iterdir(), *folder.glob("additional_chat_templates/*")]):
        if file.suffix in _TOKENIZER_SUFFIXES and file.is_file():
            digest.update(str(file.relative_to(folder)).encode() + b"\0" + file.read_bytes())
    return paths.cache_dir() / "tokenizers" / f"{digest.hexdigest()[:32]}.json"


def write_atomically(path: Path, text: str) -> None:
    """Whole or not at all: the Triton models of a server may write the same cache file at once."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, delete=False, suffix=".tmp") as f:
            f.write(text)
        os.replace(f.name, path)
    except OSError:
        pass


def eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids of a model folder: generation_config.json's, else config.json's (an int or a list),
    read as transformers' GenerationConfig and AutoConfig read them, without importing them."""
    eos = None
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if eos is None and path.is_file():
            config = json.loads(path.read_text(encoding="utf-8"))
            eos = config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer, messages: list[dict[str, str]]) -> str:
    """The prompt text of a conversation ({"role", "content"} dicts) through the tokenizer's
    chat template, with the assistant's turn opened. Encode it with `encode_prompt(...,
    apply_chat_template=False)`: the OpenAI server does, and gets the ids preprocess gets."""
    if not has_chat_template(tokenizer):
        raise ValueError("the tokenizer has no chat template; send apply_chat_template=false")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode_prompt(tokenizer, text: str, apply_chat_template: bool = True) -> list[int]:
    """Ids of `text` as a single user message with the assistant prompt opened, or of the raw
    text when `apply_chat_template` is false. No special tokens beyond the template's."""
    if apply_chat_template:
        text = render_chat(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def decode(tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Plain decode with no space clean-up (clean-up would make decode non-additive)."""
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)


def stable_prefix(text: str) -> str:
    """`text` without up to `HOLD` trailing U+FFFD: the part later ids cannot change."""
    end = len(text)
    while end > max(0, len(text) - HOLD) and text[end - 1] == REPLACEMENT:
        end -= 1
    return text[:end]


def split_delta(tokenizer, prev_ids: Sequence[int], new_ids: Sequence[int],
                skip_special_tokens: bool = True) -> tuple[str, str]:
    """Text added by `new_ids` after `prev_ids` -> (the part later ids cannot change, the held-back
    tail: trailing U+FFFD of an incomplete character). The text is decode(prev + new) minus the
    stable part of decode(prev)."""
    prev_ids, new_ids = list(prev_ids), list(new_ids)
    before = stable_prefix(decode(tokenizer, prev_ids, skip_special_tokens))
    after = decode(tokenizer, prev_ids + new_ids, skip_special_tokens)
    end = max(len(stable_prefix(after)), len(before))
    return after[len(before):end], after[end:]


def decode_delta(tokenizer, prev_ids: Sequence[int], new_ids: Sequence[int], final: bool,
                 skip_special_tokens: bool = True) -> str:
    """Text added by `new_ids` after `prev_ids`; a trailing incomplete character is held back
    unless `final`."""
    done, held = split_delta(tokenizer, prev_ids, new_ids, skip_special_tokens)
    return done + held if final else done


def detok_window(all_output_ids: Sequence[int], num_already_sent: int) -> list[int]:
    """The `prev_ids` spec_decode sends with the ids from `num_already_sent` on: the up to
    `WINDOW` ids before them, including ids whose text postprocess held back."""
    return list(all_output_ids[max(0, num_already_sent - WINDOW):num_already_sent])
