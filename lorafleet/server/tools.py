"""OpenAI tools on chat completions: the request's `tools`, `tool_choice` and `parallel_tool_calls`,
the calls in its messages, the grammar that enforces a required or named call, and the calls read
back out of the answer (`model/tool_calls.py` knows the formats).

Decisions, each with its reason:
- `tool_choice: "none"` renders no tools: a model shown tools it may not call writes calls as text.
- `required` and a named function are enforced by a grammar in the template's format, so the
  answer is a call that parses and fits its function's `parameters`; `auto` leaves the model free
  and reads whatever calls it makes.
- Structured output (`response_format`...) beside tools is refused: both would hold one output.
- Assistant messages' `tool_calls[].function.arguments` come as JSON text (OpenAI's form) and go to
  the template as objects (what templates expect: they write them with `tojson`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from lorafleet.errors import InvalidRequestError, shown
from lorafleet.model import tool_calls
from lorafleet.model.grammar import MAX_SPEC_BYTES, Constraint

MAX_TOOLS = 128
MAX_CALLS = 64  # tool_calls an assistant message may carry
NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's function names


def bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


@dataclass(frozen=True)
class Tools:
    """A request's tools as given (OpenAI's {"type": "function", "function": {...}} each), the
    choice ("auto", "required" or a function's name) and whether several calls may come."""

    functions: tuple[dict, ...]
    choice: str
    parallel: bool

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f["name"] for f in self.functions)

    def rendered(self) -> list[dict]:
        return [{"type": "function", "function": f} for f in self.functions]


def _function(tool: Any, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad("tools", f'{where} must be {{"type": "function", "function": {{"name": ...}}}} (only function '
                           "tools are supported)")
    f = tool["function"]
    name = f.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise bad("tools", f"{where}.function.name must be 1 to 64 letters, digits, _, . or -, got {shown(name)}")
    if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
        raise bad("tools", f"{where}.function.parameters must be a JSON schema object")
    if f.get("description") is not None and not isinstance(f["description"], str):
        raise bad("tools", f"{where}.function.description must be a string")
    return {k: v for k, v in f.items() if k in ("name", "description", "parameters", "strict") and v is not None}


def parse(body: dict) -> Tools | None:
    """The request's tools, or None where it has none or its tool_choice is "none"; a 400 naming
    the field at fault."""
    given, choice = body.get("tools"), body.get("tool_choice")
    if given is not None and not isinstance(given, list):
        raise bad("tools", "tools must be a list of function tools")
    if len(given or ()) > MAX_TOOLS:
        raise bad("tools", f"tools takes at most {MAX_TOOLS} functions")
    functions = tuple(_function(t, i) for i, t in enumerate(given or ()))
    if len({f["name"] for f in functions}) != len(functions):
        raise bad("tools", "two tools have the same name")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise bad("tool_choice", 'tool_choice names a function as {"type": "function", "function": {"name": ...}}')
        if name not in {f["name"] for f in functions}:
            raise bad("tool_choice", f"tool_choice names {shown(name)}, which is not one of the request's tools")
        choice = name
    elif choice not in (None, "none", "auto", "required"):
        raise bad("tool_choice", f'tool_choice must be "none", "auto", "required" or a named function, got {shown(choice)}')
    elif choice == "required" and not functions:
        raise bad("tool_choice", 'tool_choice "required" needs tools')
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "parallel_tool_calls must be true or false")
    if not functions or choice == "none":
        return None
    return Tools(functions, choice or "auto", parallel)


def message_calls(m: dict, i: int) -> dict:
    """An assistant message's `tool_calls` checked, their arguments as objects for the template;
    a tool message's `tool_call_id` checked."""
    if m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
        raise bad("messages", f"messages[{i}].tool_call_id must be a string")
    calls = m.get("tool_calls")
    if calls is None:
        return m
    if not isinstance(calls, list) or len(calls) > MAX_CALLS:
        raise bad("messages", f"messages[{i}].tool_calls must be a list of at most {MAX_CALLS} calls")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise bad("messages", f"{where} must be {{\"id\": ..., \"type\": \"function\", \"function\": "
                                  "{\"name\": ..., \"arguments\": ...}}")
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad("messages", f"{where}.function.arguments is not valid JSON") from None
        if not isinstance(args, dict):
            raise bad("messages", f"{where}.function.arguments must be a JSON object")
        out.append({**c, "function": {**f, "arguments": args}})
    return {**m, "tool_calls": out}


def prepare(tools: Tools, template: str | None, params, vocabulary) -> tuple[str, Any]:
    """(the template's tool-call format, the params with the grammar of a required or named call);
    `vocabulary`: the request's tokenizer. A 400 naming `tools` for a template that takes none."""
    fmt = tool_calls.format_of(template) if template else None
    if fmt is None:
        raise bad("tools", "this model's chat template does not take tools (it never reads `tools`)")
    if params.structured is not None:
        raise bad("tools", f"tools and {params.structured.param} both hold this answer: send one of them")
    if tools.choice == "auto":
        return fmt, params
    chosen = [f for f in tools.functions if tools.choice in ("required", f["name"])]
    mark = vocabulary.token_to_id(tool_calls.MISTRAL_MARK) if fmt == "mistral" else None
    text = tool_calls.lark(fmt, chosen, tools.parallel and tools.choice == "required", mark)
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise bad("tools", f"the tools' parameters are over {MAX_SPEC_BYTES >> 10} KiB of schema")
    return fmt, dataclasses.replace(params, structured=Constraint("lark", text, "tools"))


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_json(call: tool_calls.Call) -> dict:
    return {"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
