"""Ollama's chat templates (Go's text/template) as Jinja chat templates: `translate(source)` gives a
Jinja template that lorafleet's renderer (`chat_template`) runs with the usual chat variables
(`messages`, `tools`...), in the same bounded sandbox as any Jinja template: the translation only
writes Jinja text, it never runs the Go template. `beside(gguf)` reads the Go template that
`store/ollama.py` links beside an Ollama model's GGUF file (`<name>.gotmpl`), bounded, and
translates it; None (with one warning naming the construct) where it cannot.

The subset taken is what Ollama's templates use: text and actions with trim markers (`{{-` / `-}}`
remove all adjacent whitespace, newlines included), comments, `if / else if / else / end`,
`range` (with `$i, $m :=`, `else`, `break`, `continue`), variables (`$x := ...`, `$x = ...`,
`$`, `$.Field`, `$m.Field`), the fields below, pipelines (`x | f`) and the functions `eq ne lt le
gt ge and or not len index slice json print printf` (printf's verbs %s %v %d only). Anything else
(`with`, `define`, `template`, other functions or fields, character constants) raises
`GoTemplateError` naming the construct.

Decisions, each with its reason:
- **Fields map onto the request's own dicts** (`.Role` is `role`, `.ToolCalls` `tool_calls`,
  `.Function.Arguments` `function.arguments`...): Ollama's message and tool shapes are OpenAI's,
  renamed, so nothing is converted; an unknown field is refused rather than guessed.
- **The root**: `.Messages` the messages as sent (consecutive same-role messages are not merged:
  two tool results stay two), `.Tools` the tools (empty when none), `.System` the system messages'
  contents joined by a blank line, as Ollama joins them, `.Prompt` and `.Response` empty.
- **A template that never names `.Messages` is Ollama's legacy form** and renders as Ollama renders
  it: one pass per exchange with `.System`, `.Prompt` (the user message) and `.Response` (the
  assistant's reply), then the last with everything after its `.Response` cut, so that the prompt
  ends where the reply begins (a `</s>` after `{{ .Response }}` would otherwise end it at once).
- **`add_generation_prompt` is the template's business**, as in Ollama: its own idioms add the
  assistant header after a last message that is not the assistant's.
- **`$last`-style idioms translate literally**: `{{- $last := eq (len (slice $.Messages $i)) 1 }}`
  is `(_Messages[v_i:]|length == 1)`, true at the last message as in Go; no idiom is
  pattern-matched, so every variant that uses these functions works.
- **Variables live in a Jinja namespace** (range variables are the loop's own): `$x = ...` inside
  a range then changes the `$x` declared outside it, as in Go.
- **Printing**: a mapping or list prints as compact JSON (Ollama's tool and argument types print
  themselves so), true / false in Go's spelling, nil as nothing; `json` is compact JSON with the
  request's key order and without Go's HTML escaping (what a model saw in training); arguments
  sent as JSON text print as they are, under `json` too.
- **Truthiness is Jinja's**: empty string, list, map, 0, nil and false are false, as in Go.
- **Bounded before parsing**: `MAX_TEMPLATE_BYTES` of source and `MAX_DEPTH` of nesting (blocks
  and parentheses), as every header value is bounded; real templates are a few KiB, a few deep.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from lorafleet.model.go_template_parser import GoTemplateError, Parser, cut_after_response, emit

MAX_TEMPLATE_BYTES = 64 << 10
MAX_DEPTH = 16
SUFFIX = ".gotmpl"  # the Go template beside a GGUF file: `model.gguf` -> `model.gotmpl`
WS = " \t\r\n"
_JSON = "tojson(separators=(',', ':'))"
# Printing as Go's values print (see the docstring); `_j` is `json`.
_PRELUDE = ("{% macro _p(x) %}{% if x is sameas true %}true{% elif x is sameas false %}false{% elif x is none or "
            "x is not defined %}{% elif x is mapping or (x is iterable and x is not string) %}{{ x|" + _JSON +
            " }}{% else %}{{ x }}{% endif %}{% endmacro %}{% macro _j(x) %}{% if x is defined %}{{ x|" + _JSON +
            " }}{% else %}null{% endif %}{% endmacro %}{% set _Messages = messages %}{% set _Tools = tools or [] %}"
            "{% set _System = messages|selectattr('role', 'equalto', 'system')|map(attribute='content')|"
            "join('\\n\\n') %}")
# Ollama's legacy loop: one pass per exchange, then the last, cut after its .Response.
_LEGACY = ("{% set _s = namespace(system=_System, prompt='', response='') %}{% for m in messages %}"
           "{% set c = m['content'] or '' %}{% if m['role'] == 'system' %}{% if _s.prompt or _s.response %}"
           "{{ _turn(_s.system, _s.prompt, _s.response) }}{% set _s.prompt, _s.response = '', '' %}{% endif %}"
           "{% set _s.system = c %}{% elif m['role'] == 'user' %}{% if _s.response %}"
           "{{ _turn(_s.system, _s.prompt, _s.response) }}{% set _s.system, _s.response = '', '' %}{% endif %}"
           "{% set _s.prompt = c %}{% elif m['role'] == 'assistant' %}{% set _s.response = c %}{% endif %}"
           "{% endfor %}{{ _cut(_s.system, _s.prompt, _s.response) }}")

_OPENS = {"if": 1, "range": 1, "with": 1, "define": 1, "block": 1, "end": -1}  # an action's effect on the depth
log = logging.getLogger("lorafleet.model")


def beside(gguf: str | Path) -> str | None:
    """The Jinja translation of the Go template linked beside `gguf`, None when there is none or it
    cannot be read or translated (then one warning names why)."""
    path = Path(gguf).with_suffix(SUFFIX)
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TEMPLATE_BYTES + 1)  # never more than the bound, whatever the file's size
        if len(raw) > MAX_TEMPLATE_BYTES:
            raise GoTemplateError(f"over {MAX_TEMPLATE_BYTES >> 10} KiB")
        return translate(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, GoTemplateError) as e:
        log.warning("%s: its Ollama chat template is not served (%s); the model has no chat template", path, e)
        return None


def translate(source: str) -> str:
    """The Jinja chat template that renders as the Go template `source` does (see the docstring)."""
    if len(source.encode("utf-8")) > MAX_TEMPLATE_BYTES:
        raise GoTemplateError(f"the template is over {MAX_TEMPLATE_BYTES >> 10} KiB")
    items = _split(source)
    _check_depth(items)
    parser = Parser(items)
    body = parser.block(())
    if not parser.names_messages:
        full, cut = emit(body), emit(cut_after_response(body, [False]))
        return (_PRELUDE + "{% macro _turn(_System, _Prompt, _Response) %}{% set _v = namespace() %}" + full +
                "{% endmacro %}{% macro _cut(_System, _Prompt, _Response) %}{% set _v = namespace() %}" + cut +
                "{% endmacro %}" + _LEGACY)
    return _PRELUDE + "{% set _Prompt, _Response = '', '' %}{% set _v = namespace() %}" + emit(body)


# -- lexing --------------------------------------------------------------------------------------

def _split(src: str) -> list:
    """Text and actions, trim markers applied: [str | (action text, offset)]; comments dropped."""
    items: list = []
    i, trim_next = 0, False
    while True:
        j = src.find("{{", i)
        text = src[i:] if j < 0 else src[i:j]
        k = j + 2
        left = j >= 0 and src[k:k + 1] == "-" and src[k + 1:k + 2] in tuple(WS)
        text = text.lstrip(WS) if trim_next else text
        items.append(text.rstrip(WS) if left else text)
        if j < 0:
            return items
        p, quote = k + (1 if left else 0), ""
        while p < len(src):
            c = src[p]
            if quote:
                p += 2 if c == "\\" and quote == '"' else 1
                quote = "" if c == quote else quote
            elif src.startswith("/*", p):
                end = src.find("*/", p + 2)
                p = len(src) if end < 0 else end + 2
            elif src.startswith("}}", p):
                break
            else:
                quote = c if c in "\"`'" else ""
                p += 1
        else:
            raise GoTemplateError(f"an action at offset {j} is not closed with }}}}")
        body = src[k + (1 if left else 0):p]
        trim_next = len(body) >= 2 and body[-1] == "-" and body[-2] in WS
        body = body[:-1] if trim_next else body
        if not re.fullmatch(r"\s*/\*.*\*/\s*", body, re.S):
            items.append((body, j))
        i = p + 2


def _check_depth(items: list) -> None:
    depth = 0
    for item in items:
        if isinstance(item, tuple):
            words = item[0].split()
            depth += _OPENS.get(words[0] if words else "", 0)
            level = parens = 0
            for c in item[0]:
                level += (c == "(") - (c == ")")
                parens = max(parens, level)
            if depth > MAX_DEPTH or parens > MAX_DEPTH:
                raise GoTemplateError(f"nested over {MAX_DEPTH} deep at offset {item[1]}")
