"""The OpenAI request bodies this server accepts, the JSON it answers, and its error format.

Knows nothing about Triton: requests become `GenerateParams` (spec_decode's inputs by name),
answers are built from `Chunk`s (backend.py). Fields OpenAI defines that this server cannot
honour are refused when set to anything but their default; unknown fields are ignored, as
`user` is.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from eagle_serve.core.requests import (
    MAX_BAD_WORDS,
    MAX_CACHE_SALT_BYTES,
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    TO_THE_END,
    TokenLogprob,
    acceptance_length,
)
from eagle_serve.openai_api.tools import Tool, ToolChoice, choice_mode
from eagle_serve.openai_api.tools import guide as guide_for_tools

# Fields this server cannot honour -> the values that ask for nothing; others get a 400 naming
# the field. The neutral values include what vllm-router adds to every request it forwards
# (logprobs false, skip_special_tokens true, ...: docs/deploy.md).
UNSUPPORTED = {
    "prompt_logprobs": (0,), "allowed_token_ids": ([],),
    "functions": ([],),
    "echo": (False,), "suffix": ("",), "prediction": (), "audio": (),
    "modalities": (["text"],), "reasoning_effort": (), "logits_processors": (), "prompt_embeds": (),
    "return_hidden_states": (False,), "continue_final_message": (False,), "no_stop_trim": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "include_stop_str_in_output": (False,), "separate_reasoning": (True, False),
    "stream_reasoning": (True, False), "include_reasoning": (True, False)}
MAX_TEXT_CHARS = 1 << 20  # /tokenize and /detokenize: bounded work for a client-sized input
MAX_CHOICES = 16          # n x prompts of one request: each is a request of its own
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


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None   # the output always follows the schema here, strict or not
    description: str | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


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
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)  # vLLM's extensions from here
    min_p: float | None = Field(None, ge=0, le=1)
    logit_bias: dict[int, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's, and its older guided_* fields
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
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

    @property
    def top_logprobs_count(self) -> int | None:
        """None: no logprobs; else the alternatives per token (chat and completions differ)."""
        raise NotImplementedError

    @property
    def prompt_logprobs_count(self) -> int | None:
        return None

    def check_supported(self) -> None:
        for name, harmless in UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and value not in harmless:
                raise OpenAIError(400, f"{name} is not supported by this server (got {value!r})", name)

    def params(self) -> "GenerateParams":
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        # OpenAI's range for a bias; vLLM clamps it the same way
        bias = {t: min(100.0, max(-100.0, b)) for t, b in (self.logit_bias or {}).items()}
        return GenerateParams(  # without max_tokens: to the end of the context, as vLLM's
            max_tokens=self.max_completion_tokens or self.max_tokens or TO_THE_END,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=None if self.seed is None else self.seed % 2 ** 64,
            num_speculative_tokens=self.num_speculative_tokens, draft_topk=self.draft_topk,
            draft_depth=self.draft_depth, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            stop=stop, context_lookup=self.context_lookup, corpus_lookup=self.corpus_lookup,
            cache_salt=self.cache_salt, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            min_p=self.min_p, logit_bias_ids=list(bias), logit_bias_values=[bias[t] for t in bias],
            bad_words=list(self.bad_words or []), stop_token_ids=list(self.stop_token_ids or []),
            logprobs=self.top_logprobs_count, prompt_logprobs=self.prompt_logprobs_count,
            **guide_fields(self.guide()))

    def guide(self) -> tuple[str, str] | None:
        """The one structured-output guide the request sets -> (TensorRT-LLM's guide type, the
        guide), or None. Two at once are refused."""
        guides = self.guides()
        if len(guides) > 1:
            raise OpenAIError(400, f"set one structured-output guide, not {sorted(guides)}", sorted(guides)[0])
        return next(iter(guides.values()), None)

    def guides(self) -> dict[str, tuple[str, str]]:
        """{field: (guide type, guide)} of every structured-output field set."""
        guides: dict[str, tuple[str, str]] = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            guides["response_format"] = ("json", "")
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise OpenAIError(400, "response_format json_schema needs json_schema.schema", "response_format")
            guides["response_format"] = ("json_schema", json.dumps(fmt.json_schema.schema_))
        so = self.structured_outputs or StructuredOutputs()
        for name, value, kind in (("guided_json", self.guided_json, "json_schema"),
                                  ("guided_regex", self.guided_regex, "regex"),
                                  ("guided_choice", self.guided_choice, "choice"),
                                  ("guided_grammar", self.guided_grammar, "ebnf_grammar"),
                                  ("structured_outputs", so.json_, "json_schema"),
                                  ("structured_outputs", so.regex, "regex"),
                                  ("structured_outputs", so.choice, "choice"),
                                  ("structured_outputs", so.grammar, "ebnf_grammar")):
            if value is not None:
                text = value if isinstance(value, str) and kind != "choice" else json.dumps(value)
                if kind == "ebnf_grammar" and "::=" not in text:  # vLLM takes Lark grammars there too
                    kind = "lark"
                guides.setdefault(name, (kind, text))
                if guides[name] != (kind, text):
                    raise OpenAIError(400, f"{name} sets more than one guide", name)
        if so.json_object:
            guides.setdefault("structured_outputs", ("json", ""))
        return guides

    def choice_params(self, i: int) -> "GenerateParams":
        """The i-th of n choices: a seeded request's choices use seeds seed, seed + 1, ... (each
        reproducible, and independent of the others)."""
        params = self.params()
        if self.seed is None or i == 0:
            return params
        return replace(params, seed=(self.seed + i) % 2 ** 64)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: dict[str, str]


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None    # an assistant's calls
    tool_call_id: str | None = None             # a tool's result: of which call

    @model_validator(mode="after")
    def has_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (an assistant message may give tool_calls instead)")
        return self

    def as_template_dict(self) -> dict:
        """`developer` is OpenAI's newer name for `system`; text parts are joined."""
        content = self.content if isinstance(self.content, str) or self.content is None else "".join(
            p.text for p in self.content)
        out = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call

    def tool_mode(self):
        """None (no tools in play), "auto", "required", or the named function (openai_api.tools)."""
        return choice_mode(self.tools, self.tool_choice)

    def guides(self) -> dict[str, tuple[str, str]]:
        guides = super().guides()
        tool_guide = guide_for_tools(self.tool_mode(), self.tools or [], self.parallel_tool_calls is not False)
        if tool_guide is not None:
            guides["tool_choice"] = tool_guide
        return guides

    @property
    def top_logprobs_count(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(union_mode="left_to_right")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's own (a BOS where it adds one)

    @field_validator("logprobs", mode="before")
    @classmethod
    def logprobs_false_is_none(cls, value):  # what vllm-router sends: "logprobs": false
        return None if value is False else value

    @property
    def top_logprobs_count(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_count(self) -> int | None:
        """echo with logprobs: the prompt's too."""
        return self.logprobs if self.echo else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, self.n):
            raise OpenAIError(400, f"best_of must equal n ({self.n}): this server returns every "
                                   f"sequence it generates, got {self.best_of}", "best_of")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise OpenAIError(400, f"prompts x n may be at most {MAX_CHOICES}, got "
                                   f"{len(self.prompts())} x {self.n}", "n")

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise OpenAIError(400, "prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        if any(isinstance(x, list) and not x for x in p):
            raise OpenAIError(400, "a token-id prompt must not be empty", "prompt")
        return list(p)

    def text(self) -> str:
        """The one text prompt (render endpoints)."""
        prompts = self.prompts()
        if len(prompts) != 1 or not isinstance(prompts[0], str):
            raise OpenAIError(400, "give one text prompt", "prompt")
        return prompts[0]


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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias_ids: list[int] = ()
    logit_bias_values: list[float] = ()
    bad_words: list[str] = ()
    stop_token_ids: list[int] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    guided_decoding_guide_type: str | None = None
    guided_decoding_guide: str | None = None


def guide_fields(guide: tuple[str, str] | None) -> dict:
    return {} if guide is None else {"guided_decoding_guide_type": guide[0], "guided_decoding_guide": guide[1]}


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
    """One spec_decode response: the new text, running totals, and "" or why it finished;
    the new tokens' logprobs when asked."""
    text: str
    counters: Counters
    finish_reason: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens but the first (asked)
