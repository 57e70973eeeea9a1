"""Tool calling: OpenAI's `tools` and `tool_choice`, with the conversation's tool turns.

Tools reach the model through its chat template: the target's own where it renders `tools`,
else the Hermes convention (which SmolLM2, Qwen and many others were trained on) written into
the conversation here: the functions' signatures in the system turn inside <tools></tools>, a
call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, a result in a user turn inside
<tool_response></tool_response>; the `tool_call_template` setting picks one. `tool_choice`:
  - "none": the tools are left out of the prompt (OpenAI's meaning: no call);
  - a named function: the output is constrained to its parameters' schema (a grammar guide),
    and becomes that call's arguments;
  - "required": the output is constrained to a JSON list of calls [{"name", "parameters"}]
    (vLLM's form), one at least (one only with parallel_tool_calls false);
  - "auto" (the default with tools): free text, read for <tool_call> blocks as it is written.
An answer's calls are read out of it by openai_api.tool_parser.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

MAX_TOOLS = 64
TEMPLATES = ("auto", "model", "hermes")


class FunctionDef(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def choice_mode(tools: list[Tool] | None, choice: ToolChoice | None) -> str | FunctionDef | None:
    """None (no tools in play), "auto", "required", or the named function."""
    from eagle_serve.openai_api.protocol import OpenAIError  # (protocol imports this module)
    if not tools or choice == "none":
        if isinstance(choice, NamedToolChoice) or choice == "required":
            raise OpenAIError(400, "tool_choice names a tool but no tools are given", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise OpenAIError(400, f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}", "tools")
    if isinstance(choice, NamedToolChoice):
        named = next((t.function for t in tools if t.function.name == choice.function.name), None)
        if named is None:
            raise OpenAIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                              "tool_choice")
        return named
    return choice or "auto"


def guide(mode: str | FunctionDef | None, tools: list[Tool], parallel: bool = True) -> tuple[str, str] | None:
    """The grammar guide a tool choice constrains the output with (None: free text); parallel
    False: one call at most."""
    if isinstance(mode, FunctionDef):
        return "json_schema", json.dumps(mode.parameters)
    if mode == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "parameters": t.function.parameters},
                  "required": ["name", "parameters"]} for t in tools]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return "json_schema", json.dumps(array if parallel else {**array, "maxItems": 1})
    return None


def hermes_messages(messages: list[dict], tools: list[Tool] | None) -> list[dict]:
    """The conversation with the tools written in (Hermes): a system turn listing them, calls
    as <tool_call> text, results as <tool_response> user turns."""
    out = []
    if tools:
        listed = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in tools)
        system = ("You may call one or more functions to assist with the user query.\n\nYou are provided "
                  f"with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
                  "For each function call, return a json object with function name and arguments within "
                  "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                  '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
        if messages and messages[0]["role"] == "system":
            system = messages[0]["content"] + "\n\n" + system
            messages = messages[1:]
        out.append({"role": "system", "content": system})
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join(f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': _loads(c['function']['arguments'])})}\n</tool_call>"
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + calls).strip()})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    return out


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (TypeError, json.JSONDecodeError):
        return arguments
