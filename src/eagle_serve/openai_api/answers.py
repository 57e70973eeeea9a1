"""The JSON of an answer: whole or as stream chunks, chat or completion, one choice per
(prompt, n) pair, with OpenAI's logprobs formats. Knows nothing about Triton or HTTP."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Literal

from eagle_serve.core.requests import TokenLogprob
from eagle_serve.openai_api.protocol import Chunk, Counters
from eagle_serve.openai_api.tool_parser import ToolCallParser, ToolDelta

FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}  # spec_decode -> OpenAI
FLOOR = -9999.0  # a logprob of -inf (a banned token) in JSON, as vLLM writes it


@dataclass
class Choice:
    """One sequence of an answer as it is assembled."""
    index: int
    prompt_index: int               # which prompt (its tokens count once in the usage)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    last: Chunk | None = None
    echo: str = ""                  # the prompt's text, put before the output (completions)
    prompt_ids: list[int] = field(default_factory=list)  # echoed with logprobs: the prompt's ids
    echo_logprobs: list[TokenLogprob] = field(default_factory=list)  # then: of every prompt token
    #                                 (the first has none: top None)

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.logprobs += chunk.logprobs
        self.last = chunk
        if chunk.prompt_logprobs is not None and self.prompt_ids:
            self.echo_logprobs = [TokenLogprob(self.prompt_ids[0], 0.0, None), *chunk.prompt_logprobs]


def usage(choices: list[Choice]) -> dict:
    """Prompt tokens once per prompt; output and speculative counters summed over choices."""
    firsts = {c.prompt_index: c.last.counters for c in choices if c.last}
    every = [c.last.counters for c in choices if c.last]
    total = Counters(input_tokens=sum(c.input_tokens for c in firsts.values()),
                     output_tokens=sum(c.output_tokens for c in every),
                     draft_tokens=sum(c.draft_tokens for c in every),
                     accepted_tokens=sum(c.accepted_tokens for c in every),
                     rounds=sum(c.rounds for c in every),
                     cached_tokens=sum(c.cached_tokens for c in firsts.values()))
    return total.usage()


class Answer:
    """Builds one request's JSON. token_text: a token id's text (logprobs' `token`)."""

    def __init__(self, kind: Literal["chat", "completion"], model: str,
                 token_text: Callable[[int], str] = str):
        self.kind, self.model, self.token_text = kind, model, token_text
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id, self.created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())

    def _envelope(self, stream: bool) -> dict:
        kinds = {("chat", False): "chat.completion", ("chat", True): "chat.completion.chunk",
                 ("completion", False): "text_completion", ("completion", True): "text_completion"}
        return {"id": self.id, "object": kinds[self.kind, stream], "created": self.created,
                "model": self.model}

    def _choice(self, index: int, text: str | None, finish_reason: str | None, stream: bool,
                logprobs: dict | None, role: bool = False) -> dict:
        if self.kind == "completion":
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        body = {"content": text} if text is not None else {}
        if role or not stream:
            body = {"role": "assistant", **body}
        key = "delta" if stream else "message"
        return {"index": index, key: body, "logprobs": logprobs, "finish_reason": finish_reason}

    def whole(self, choices: list[Choice], with_logprobs: bool, tool_mode=None) -> dict:
        """tool_mode: how tools were offered (openai_api.tools.choice_mode; None: not)."""
        out = []
        for c in choices:
            reason = FINISH_REASONS.get(c.last.finish_reason, "stop")
            lp = self.logprobs(c.echo_logprobs + c.logprobs) if with_logprobs else None
            body = self._choice(c.index, c.echo + c.text, reason, False, lp)
            if tool_mode is not None:
                parser = ToolCallParser(tool_mode)
                parser.feed(c.text)
                parser.finish()
                if parser.calls:
                    body["message"] = {"role": "assistant", "content": parser.content or None,
                                       "tool_calls": parser.calls}
                    body["finish_reason"] = FINISH_REASONS.get(parser.finish_reason(c.last.finish_reason), "tool_calls")
            out.append(body)
        return {**self._envelope(False), "choices": out, "usage": usage(choices)}

    def tool_events(self, index: int, deltas: list[ToolDelta], include_usage: bool) -> list[dict]:
        """A streamed choice offered tools: its content, each call's name, its arguments' fragments."""
        extra = {"usage": None} if include_usage else {}
        out = []
        for d in deltas:
            if d.content:
                out.append(self.chunk(index, d.content, include_usage=include_usage))
            elif d.call is not None:
                out.append(self._delta(index, {"tool_calls": [d.call]}, None, extra))
            else:
                out.append(self._delta(index, {"tool_calls": [{"index": d.index, "function": {"arguments": d.arguments}}]},
                                       None, extra))
        return out

    def _delta(self, index: int, delta: dict, finish_reason: str | None, extra: dict) -> dict:
        return {**self._envelope(True), "choices": [{"index": index, "delta": delta, "logprobs": None,
                                                     "finish_reason": finish_reason}], **extra}

    def chunk(self, index: int, text: str | None, finish_reason: str = "", role: bool = False,
              include_usage: bool = False, logprobs: dict | None = None) -> dict:
        reason = FINISH_REASONS.get(finish_reason, "stop") if finish_reason else None
        body = {**self._envelope(True), "choices": [self._choice(index, text, reason, True, logprobs, role)]}
        return {**body, "usage": None} if include_usage else body

    def usage_chunk(self, choices: list[Choice]) -> dict:
        return {**self._envelope(True), "choices": [], "usage": usage(choices)}

    def logprobs(self, entries: list[TokenLogprob], text_offset: int = 0) -> dict:
        """OpenAI's logprobs object: chat's `content` list, or completions' parallel lists
        (text_offset: where the first token's text starts in the choice's text)."""
        if self.kind == "chat":
            return {"content": [dict(self._entry(x.token_id, x.logprob),
                                     top_logprobs=[self._entry(t, v) for t, v in x.top]) for x in entries]}
        tokens = [self.token_text(x.token_id) for x in entries]
        offsets, at = [], text_offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens,
                "token_logprobs": [None if x.top is None else finite(x.logprob) for x in entries],
                "top_logprobs": [None if x.top is None else {self.token_text(t): finite(v) for t, v in
                                                             [(x.token_id, x.logprob), *x.top]}
                                 for x in entries],
                "text_offset": offsets}

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}


def finite(value: float) -> float:
    return max(value, FLOOR)
