"""Tool calls in a model's own format: which one a chat template speaks, the grammar that makes a
model call a tool, and the reading of its output into calls, whole or as it streams.

Formats, those of the families whose templates take `tools`:
- "hermes": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, a block a call
  (Qwen2.5, Qwen3, Hermes, the demo base);
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- "llama3_json": `{"name": ..., "parameters": {...}}`, one call, after an optional `<|python_tag|>`
  (Llama 3.1 and later).

Decisions, each with its reason:
- The format is read from the template's own markers; a template that takes `tools` and shows
  none of them gets "hermes", the most common (a call it forces through the grammar reads back
  either way).
- A call is only a call when it parses whole and names one of the request's tools: anything
  else stays text, so a model that talks about a call is not taken to make one.
- Streamed, text that may begin a call is held back until it does or cannot; a call goes out
  when it is whole (its arguments are re-serialized JSON, known only then).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jinja2.meta

from lorafleet.model.chat_template import compile_template
from lorafleet.model.grammar import JSON_STYLE

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
FORMATS = ("hermes", "mistral", "llama3_json")


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object's text


@lru_cache(maxsize=16)
def format_of(template: str) -> str | None:
    """The tool-call format `template` (a chat template's source) speaks; None: it takes no `tools`."""
    env = compile_template(template, "the chat template").environment
    if "tools" not in jinja2.meta.find_undeclared_variables(env.parse(template)):
        return None
    if MISTRAL_MARK in template:
        return "mistral"
    if HERMES_OPEN in template:
        return "hermes"
    if PYTHON_TAG in template or "<|start_header_id|>" in template:
        return "llama3_json"
    return "hermes"


# -- the grammar that makes a call ----------------------------------------------------------------

def _call_schema(fmt: str, tool: dict) -> dict:
    key = "parameters" if fmt == "llama3_json" else "arguments"
    params = tool.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": tool["name"]}, key: params},
            "required": ["name", key], "additionalProperties": False}


def lark(fmt: str, tools: list[dict], parallel: bool, mark_token: int | None = None) -> str:
    """A Lark grammar (llguidance's, with `%json`) for one or more calls of `tools` (each a
    function's {name, parameters}) in `fmt`; `mark_token`: the id of the Mistral marker where the
    vocabulary holds it as a special token."""
    one = {"anyOf": [_call_schema(fmt, t) for t in tools]} if len(tools) > 1 else _call_schema(fmt, tools[0])
    one = {**one, "x-guidance": JSON_STYLE}  # JSON as json.dumps lays it out, as structured output does
    if fmt == "hermes":
        more = ' ("\\n" call)*' if parallel else ""
        return (f"start: call{more}\ncall: {json.dumps(HERMES_OPEN + chr(10))} obj {json.dumps(chr(10) + HERMES_CLOSE)}"
                f"\nobj: %json {json.dumps(one)}\n")
    if fmt == "mistral":
        mark = f"<[{mark_token}]>" if mark_token is not None else json.dumps(MISTRAL_MARK)
        calls = {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        return f"start: {mark} calls\ncalls: %json {json.dumps(calls)}\n"
    return f"start: obj\nobj: %json {json.dumps(one)}\n"  # llama3_json: one call


# -- reading calls out of the output --------------------------------------------------------------

def _call(value: Any, names: frozenset[str]) -> Call | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = value.get("arguments", value.get("parameters"))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(value["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _whole_calls(fmt: str, text: str, names: frozenset[str]) -> list[Call] | None:
    """The calls `text` is, all of it (mistral, llama3_json), or None where it is not calls."""
    t = text.strip()
    if fmt == "mistral":
        value = _loads(t[len(MISTRAL_MARK):] if t.startswith(MISTRAL_MARK) else t)
        items = value if isinstance(value, list) else [value]
    else:
        items = [_loads(t[len(PYTHON_TAG):] if t.startswith(PYTHON_TAG) else t)]
    calls = [_call(v, names) for v in items]
    return [c for c in calls if c is not None] if items and None not in calls else None


_HERMES_RE = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.DOTALL)


def parse(fmt: str, text: str, names: frozenset[str]) -> tuple[str | None, list[Call]]:
    """(the text left, None where none; the calls) of a whole output."""
    if fmt != "hermes":
        calls = _whole_calls(fmt, text, names)
        return (None, calls) if calls else (text, [])
    calls, kept, at = [], [], 0
    for m in _HERMES_RE.finditer(text):
        call = _call(_loads(m.group(1).strip()), names)
        if call is not None:
            calls.append(call)
            kept.append(text[at:m.start()])
            at = m.end()
    kept.append(text[at:])
    left = "".join(kept).strip() if calls else text
    return (left or None), calls


MAX_LEADING_SPACE = 1024  # whitespace held before an output shows whether it is a call: past it, given out


class ToolStream:
    """Reads calls out of an output as it streams: `feed(new_text)` and, at its end, `finish()`
    each give (text that is surely no call, the calls completed). Each feed costs what its text
    does: held text is kept in pieces and joined once, and a marker is looked for in the new text
    and the few characters before it, never in all that is held (an answer may be long)."""

    def __init__(self, fmt: str, names: frozenset[str]):
        self.fmt, self.names = fmt, names
        self.parts: list[str] = []  # held text: a call's body (hermes), or the whole output (the others)
        self.tail = ""              # hermes: the last characters seen, where a marker may be cut in two
        self.open = False           # hermes: inside a <tool_call> block
        self.state = "undecided"    # mistral, llama3_json: "holding" (it began as a call may) or "text"
        self.calls = 0              # calls streamed so far: the next one's index (`responses.tool_chunks`)

    def feed(self, text: str) -> tuple[str, list[Call]]:
        if self.fmt == "hermes":
            return self._hermes(text)
        if self.state == "text":
            return text, []
        self.parts.append(text)
        if self.state == "holding":
            return "", []
        held = "".join(self.parts)  # undecided: a few characters, or whitespace up to its bound
        stripped = held.lstrip()
        openers = (MISTRAL_MARK, "[") if self.fmt == "mistral" else (PYTHON_TAG, "{")
        if any(stripped.startswith(o) for o in openers):
            self.state = "holding"
            return "", []
        if not stripped:  # whitespace alone: held up to its bound, then given out as text (still undecided)
            self.parts = [held] if len(held) <= MAX_LEADING_SPACE else []
            return ("", []) if self.parts else (held, [])
        if any(o.startswith(stripped) for o in openers):
            self.parts = [held]
            return "", []
        self.state, self.parts = "text", []
        return held, []

    def _hermes(self, text: str) -> tuple[str, list[Call]]:
        out: list[str] = []
        calls: list[Call] = []
        pending, self.tail = self.tail + text, ""
        while True:
            marker = HERMES_CLOSE if self.open else HERMES_OPEN
            at = pending.find(marker)
            if at < 0:
                keep = next((k for k in range(min(len(marker) - 1, len(pending)), 0, -1)
                            if marker.startswith(pending[-k:])), 0)
                (self.parts if self.open else out).append(pending[:len(pending) - keep])
                self.tail = pending[len(pending) - keep:]
                return "".join(out), calls
            (self.parts if self.open else out).append(pending[:at])
            pending = pending[at + len(marker):]
            if self.open:
                body, self.parts, self.open = "".join(self.parts), [], False
                call = _call(_loads(body.strip()), self.names)
                if call is None:
                    out.append(HERMES_OPEN + body + HERMES_CLOSE)
                else:
                    calls.append(call)
            else:
                self.open = True

    def finish(self) -> tuple[str, list[Call]]:
        """What is left at the output's end: an unclosed block, or held text that is not calls, as text."""
        held, self.parts, tail, self.tail = "".join(self.parts), [], self.tail, ""
        if self.fmt == "hermes":
            return (HERMES_OPEN + held + tail if self.open else tail), []
        if self.state == "text" or not held.strip():
            return held, []
        calls = _whole_calls(self.fmt, held, self.names)
        return ("", calls) if calls else (held, [])
