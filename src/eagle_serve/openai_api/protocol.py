"""The OpenAI request bodies this server accepts, the JSON it answers, and its error format.

Knows nothing about Triton: requests become `GenerateParams` (spec_decode's inputs by name),
answers are built from `Chunk`s (backend.py). Fields OpenAI defines that this server cannot
honour are refused when set to anything but their default; unknown fields are ignored, as
`user` is.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from eagle_serve.requests import MAX_CACHE_SALT_BYTES, TO_THE_END, acceptance_length

# Fields this server cannot honour -> the values that ask for nothing; others get a 400 naming
# the field. The neutral values include what vllm-router adds to every request it forwards
# (logprobs false, skip_special_tokens true, ...: docs/deploy.md).
UNSUPPORTED = {
    "logprobs": (False, 0), "top_logprobs": (0,), "prompt_logprobs": (0,), "logit_bias": ({},),
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
    "min_p": (0,), "stop_token_ids": ([],), "bad_words": ([],), "allowed_token_ids": ([],),
    "tools": ([],), "functions": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False),
    "response_format": ({"type": "text"},), "guided_json": (), "guided_regex": (),
    "guided_choice": (), "guided_grammar": (), "structured_outputs": (),
    "best_of": (1,), "echo": (False,), "suffix": ("",), "prediction": (), "audio": (),
    "modalities": (["text"],), "reasoning_effort": (), "logits_processors": (), "prompt_embeds": (),
    "return_hidden_states": (False,), "continue_final_message": (False,), "no_stop_trim": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "include_stop_str_in_output": (False,), "separate_reasoning": (True, False),
    "stream_reasoning": (True, False), "include_reasoning": (True, False)}
MAX_TEXT_CHARS = 1 << 20  # /tokenize and /detokenize: bounded work for a client-sized input
FINISH_REASONS = {"stop": "stop", "length": "length"}  # spec_decode -> OpenAI


class OpenAIError(Exception):
    """An answer in OpenAI's error format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What chat and completion requests share; the speculative knobs, top_k, ignore_eos and
    min_tokens (vLLM's: no EOS or stop string ends the output before it) are extensions (the
    `extra_body` of the openai client)."""
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name; wins
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-2 ** 63, lt=2 ** 64)
    stop: str | list[str] | None = None
    n: int | None = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None                      # accepted and ignored
    top_k: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    num_speculative_tokens: int | None = Field(None, ge=0)
    draft_topk: int | None = Field(None, ge=1)
    draft_depth: int | None = Field(None, ge=1)
    context_lookup: bool | None = None
    corpus_lookup: bool | None = None
    cache_salt: str | None = Field(None, max_length=MAX_CACHE_SALT_BYTES)  # vLLM's: caches shared within a salt

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise OpenAIError(400, f"n must be 1 (this server returns one choice), got {self.n}", "n")
        for name, harmless in UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and value not in harmless:
                raise OpenAIError(400, f"{name} is not supported by this server (got {value!r})", name)

    def params(self) -> "GenerateParams":
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return GenerateParams(  # without max_tokens: to the end of the context, as vLLM's
            max_tokens=self.max_completion_tokens or self.max_tokens or TO_THE_END,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=None if self.seed is None else self.seed % 2 ** 64,
            num_speculative_tokens=self.num_speculative_tokens, draft_topk=self.draft_topk,
            draft_depth=self.draft_depth, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            stop=stop, context_lookup=self.context_lookup, corpus_lookup=self.corpus_lookup,
            cache_salt=self.cache_salt)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_dict(self) -> dict[str, str]:
        """`developer` is OpenAI's newer name for `system`; text parts are joined."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str]

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise OpenAIError(400, "prompt must be one string (batches of prompts are not "
                                   f"supported), got {len(self.prompt)}", "prompt")
        return self.prompt[0]


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt (with the tokenizer's special tokens unless told not to), or
    chat messages rendered as a chat request would be."""
    model: str | None = None
    prompt: str | None = Field(None, max_length=MAX_TEXT_CHARS)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self

    def as_chat(self) -> ChatCompletionRequest:
        return ChatCompletionRequest(model=self.model, messages=self.messages)


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_TEXT_CHARS)


@dataclass(frozen=True)
class GenerateParams:
    """spec_decode's optional inputs by name (None = not sent: spec_decode's default)."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    num_speculative_tokens: int | None = None
    draft_topk: int | None = None
    draft_depth: int | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop: list[str] = ()
    context_lookup: bool | None = None
    corpus_lookup: bool | None = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class Counters:
    """spec_decode's running totals for one request."""
    input_tokens: int = 0
    output_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    cached_tokens: int = 0

    def usage(self) -> dict:
        """OpenAI's usage, with the speculative counters in the extension field `speculative`
        (acceptance length = tokens per verify round = (accepted + rounds) / rounds)."""
        length = acceptance_length(self.accepted_tokens, self.rounds) if self.rounds else None
        return {"prompt_tokens": self.input_tokens, "completion_tokens": self.output_tokens,
                "total_tokens": self.input_tokens + self.output_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                "speculative": {"draft_tokens": self.draft_tokens,
                                "accepted_tokens": self.accepted_tokens, "rounds": self.rounds,
                                "acceptance_length": length}}


@dataclass(frozen=True)
class Chunk:
    """One spec_decode response: the new text, running totals, and "" or why it finished."""
    text: str
    counters: Counters
    finish_reason: str = ""


class Answer:
    """Builds the JSON of one request's answer: whole or as stream chunks, chat or completion."""

    def __init__(self, kind: Literal["chat", "completion"], model: str):
        self.kind, self.model = kind, model
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id, self.created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())

    def _envelope(self, stream: bool) -> dict:
        kinds = {("chat", False): "chat.completion", ("chat", True): "chat.completion.chunk",
                 ("completion", False): "text_completion", ("completion", True): "text_completion"}
        return {"id": self.id, "object": kinds[self.kind, stream], "created": self.created,
                "model": self.model}

    def _choice(self, text: str | None, finish_reason: str | None, stream: bool,
                role: bool = False) -> dict:
        if self.kind == "completion":
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        body = {"content": text} if text is not None else {}
        if role or not stream:
            body = {"role": "assistant", **body}
        key = "delta" if stream else "message"
        return {"index": 0, key: body, "logprobs": None, "finish_reason": finish_reason}

    def whole(self, text: str, last: Chunk) -> dict:
        reason = FINISH_REASONS.get(last.finish_reason, "stop")
        return {**self._envelope(False), "choices": [self._choice(text, reason, False)],
                "usage": last.counters.usage()}

    def chunk(self, text: str | None, finish_reason: str = "", role: bool = False,
              include_usage: bool = False) -> dict:
        reason = FINISH_REASONS.get(finish_reason, "stop") if finish_reason else None
        body = {**self._envelope(True), "choices": [self._choice(text, reason, True, role)]}
        return {**body, "usage": None} if include_usage else body

    def usage_chunk(self, last: Chunk) -> dict:
        return {**self._envelope(True), "choices": [], "usage": last.counters.usage()}
