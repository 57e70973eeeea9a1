"""An answer offered tools, read as it grows: content, then each call's name as soon as it is
written and its arguments as they are written (how the OpenAI SDK and LangChain read a stream).
A whole answer is the same reading in one piece, so a stream and a whole answer agree.

What the tool choice makes the model write (openai_api.tools):
  - a named function: the arguments object itself;
  - "required": [{"name": ..., "parameters": {...}}, ...], in the grammar's key order;
  - "auto": free text, a call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    (Hermes). The content is the text before the first call (without the whitespace before
    the tag); text after a call is dropped; a block that is no call is content while no call
    came before it. An answer that opens with a bare call, as models whose own templates
    render tools write them (Llama 3's {"name": ..., "parameters": ...} calls, after
    <|python_tag|> or not; Mistral's [TOOL_CALLS][...]), is read as a list of calls.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"{key}"\s*:\s*'
HERMES_HEAD = re.compile(r"\s*" + _NAME.replace("{key}", "arguments"))
LIST_HEAD = re.compile(_NAME.replace("{key}", "(?:parameters|arguments)"))
BARE_CALLS = re.compile(r'\s*(?:<\|python_tag\|>|\[TOOL_CALLS\])?\s*\[?\s*\{\s*"name"\s*:')
DECIDE = 32  # characters read before an answer that could open with a bare call is decided


@dataclass
class ToolDelta:
    """One piece of a streamed answer: content text, a new call (its id and name), or a fragment
    of call `index`'s arguments."""
    content: str = ""
    call: dict | None = None   # {"index", "id", "type", "function": {"name", "arguments": ""}}
    index: int = -1
    arguments: str = ""


class _ValueEnd:
    """Where one JSON value ends, in text fed piece by piece (the value starts at the first
    piece's first character)."""

    def __init__(self):
        self.depth, self.string, self.escape, self.scalar = 0, False, False, False

    def end(self, text: str) -> int | None:
        """-> the index just past the value's end in `text`, None if it goes on past it."""
        for i, ch in enumerate(text):
            if self.string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.string = False
                    if self.depth == 0:
                        return i + 1
            elif self.scalar:  # a number, true, false or null ends before its delimiter
                if ch in ",}] \t\r\n":
                    return i
            elif ch == '"':
                self.string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
            elif self.depth == 0:
                self.scalar = True
        return None


class ToolCallParser:
    """mode: "auto", "required" or the named function (anything with a `name`)."""

    def __init__(self, mode):
        self.mode = mode
        self.calls: list[dict] = []
        self.content = ""
        self._text = ""  # everything fed
        self._buf, self._held, self._raw = "", "", ""  # unread text; whitespace held back; a block read so far
        self._value: _ValueEnd | None = None
        self._cut = False  # the last call's arguments had not ended when the answer did
        self._hermes = False  # inside <tool_call> blocks (not a list of calls)
        self._state = "start" if mode == "auto" else "between" if mode == "required" else "named"

    def feed(self, text: str) -> list[ToolDelta]:
        self._buf += text
        self._text += text
        out: list[ToolDelta] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[ToolDelta]:
        """The answer is whole: what was held back, or a block that was no call, as content."""
        out: list[ToolDelta] = []
        self._cut = self._state == "args"
        if self._state == "start":
            self._state = "between" if BARE_CALLS.match(self._buf) else "content"
            while self._step(out):
                pass
        if self._state == "content":
            self._content(out, self._buf, final=True)
        elif self._state == "head":
            self._block(out, self._buf, closed=False)
        elif self._state == "between" and not self.calls:  # cut before its first call: the text
            self._content(out, self._text, final=True)
        self._buf, self._state = "", "done"
        return out

    def finish_reason(self, reason: str) -> str:
        """The model's finish reason -> the answer's: "tool_calls" when calls came whole."""
        return reason if not self.calls or (self._cut and reason == "length") else "tool_calls"

    def _step(self, out: list[ToolDelta]) -> bool:
        """Read what the unread text allows; -> whether to read on."""
        buf = self._buf
        if self._state == "start":  # a bare call, or text (Hermes calls inside)?
            if BARE_CALLS.match(buf):
                self._state = "between"
                return True
            if len(buf.strip()) < DECIDE and "\n" not in buf.strip():
                return False
            self._state = "content"
            return True
        if self._state == "named":
            self._start_call(out, self.mode.name)
            return True
        if self._state == "content":
            at = buf.find(OPEN)
            if at < 0:  # hold back what may be the start of a tag
                keep = next((n for n in range(min(len(OPEN) - 1, len(buf)), 0, -1) if OPEN.startswith(buf[-n:])), 0)
                self._content(out, buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return False
            self._content(out, buf[:at])
            self._buf, self._raw, self._state, self._hermes = buf[at + len(OPEN):], OPEN, "head", True
            return True
        if self._state == "head":
            head = HERMES_HEAD.match(buf)
            if head:
                self._buf = buf[head.end():]
                self._start_call(out, json.loads(f'"{head.group(1)}"'))
                return True
            close = buf.find(CLOSE)
            if close < 0:
                return False
            self._block(out, buf[:close], closed=True)
            self._buf, self._state = buf[close + len(CLOSE):], "content"
            return True
        if self._state == "args":
            if self._value is None:  # the value starts at its first non-space character
                buf = self._buf = buf.lstrip()
                if not buf:
                    return False
                self._value = _ValueEnd()
            end = self._value.end(buf)
            piece = buf if end is None else buf[:end]
            if piece:
                self.calls[-1]["function"]["arguments"] += piece
                out.append(ToolDelta(index=len(self.calls) - 1, arguments=piece))
            self._buf = "" if end is None else buf[end:]
            if end is None:
                return False
            self._value = None
            self._state = ("done" if not isinstance(self.mode, str)  # a named function's
                           else "tail" if self._hermes else "between")
            return True
        if self._state == "tail":  # after a call's arguments: up to its closing tag
            close = buf.find(CLOSE)
            self._buf = buf[close + len(CLOSE):] if close >= 0 else buf[-(len(CLOSE) - 1):]
            if close >= 0:
                self._state = "content"
            return close >= 0
        if self._state == "between":  # a list of calls: the next call's name
            head = LIST_HEAD.search(buf)
            if head is None:
                return False
            self._buf = buf[head.end():]
            self._start_call(out, json.loads(f'"{head.group(1)}"'))
            return True
        self._buf = ""  # done: what follows a named call's arguments
        return False

    def _start_call(self, out: list[ToolDelta], name: str) -> None:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        out.append(ToolDelta(call={"index": len(self.calls) - 1, **call,
                                   "function": {"name": name, "arguments": ""}}))
        self._state, self._value = "args", None

    def _block(self, out: list[ToolDelta], block: str, closed: bool) -> None:
        """A block whose head did not read as a call: parsed whole (keys in another order), else
        content while no call came before it."""
        try:
            value = json.loads(block)
            name, arguments = value["name"], value.get("arguments", {})
            assert isinstance(name, str)
        except (json.JSONDecodeError, KeyError, TypeError, AssertionError):
            self._content(out, self._raw + block + (CLOSE if closed else ""), final=not closed)
            return
        self._start_call(out, name)  # (the caller moves on from the block)
        text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        self.calls[-1]["function"]["arguments"] = text
        out.append(ToolDelta(index=len(self.calls) - 1, arguments=text))

    def _content(self, out: list[ToolDelta], text: str, final: bool = False) -> None:
        """Content before any call; whitespace is held back until text follows it (before a
        tag it is dropped)."""
        if self.calls:
            return
        text = self._held + text
        keep = text if final else text.rstrip()
        self._held = "" if final else text[len(keep):]
        if keep:
            self.content += keep
            out.append(ToolDelta(content=keep))


def parse(text: str, mode) -> tuple[str | None, list[dict]]:
    """A whole answer's text -> (content, tool calls), as the tool choice shaped it."""
    parser = ToolCallParser(mode)
    parser.feed(text)
    parser.finish()
    return (parser.content or None) if parser.calls else parser.content, parser.calls
