"""Tool calls in the models' own formats (model/tool_calls.py): a template's format, the calls read
out of an output whole and as it streams in any split, and the grammars that force a call,
checked against llguidance token by token; the request's tools fields (server/tools.py)."""

from __future__ import annotations

import json
import random

import pytest

from lorafleet.errors import InvalidRequestError
from lorafleet.model import tool_calls
from lorafleet.model.grammar import Constraint, compile
from lorafleet.model.tool_calls import Call, ToolStream, format_of, parse
from lorafleet.server import tools

pytestmark = pytest.mark.unit

NAMES = frozenset({"get_weather", "add"})
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                 "required": ["city"], "additionalProperties": False}}
ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                     "required": ["a", "b"], "additionalProperties": False}}


@pytest.mark.parametrize("template,fmt", [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    ("{% if tools %}{{ tools | tojson }}<tool_call>{% endif %}{{ messages[0].content }}", "hermes"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}{% endif %}[TOOL_CALLS]", "mistral"),
    ("<|start_header_id|>{% if tools %}{{ tools | tojson }}{% endif %}", "llama3_json"),
    ("{% if tools %}{{ tools | tojson }}{% endif %}", "hermes"),  # takes tools, shows no format: the common one
])
def test_a_templates_format_is_read_off_its_markers(template, fmt):
    assert format_of(template) == fmt


def test_calls_read_out_of_whole_outputs():
    hermes = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
              '<tool_call>{"name": "nope", "arguments": {}}</tool_call>')
    left, calls = parse("hermes", hermes, NAMES)
    assert calls == [Call("get_weather", '{"city": "Paris"}'), Call("add", '{"a": 1, "b": 2}')]
    assert left == 'Let me look.\n\n<tool_call>{"name": "nope", "arguments": {}}</tool_call>'  # no such tool: text
    assert parse("hermes", "no call here", NAMES) == ("no call here", [])
    assert parse("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}', NAMES)[1] == []  # cut: no call
    mistral = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {}}]'
    assert parse("mistral", mistral, NAMES) == (None, [Call("add", '{"a": 1, "b": 2}'), Call("get_weather", "{}")])
    assert parse("mistral", '[{"name": "add", "arguments": {}}, {"name": "x", "arguments": {}}]', NAMES)[1] == []
    llama = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert parse("llama3_json", llama, NAMES) == (None, [Call("get_weather", '{"city": "Oslo"}')])
    assert parse("llama3_json", '{"a": 1}', NAMES) == ('{"a": 1}', [])


@pytest.mark.parametrize("fmt,text", [
    ("hermes", 'Sure <tool_ <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> and '
               '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call><tool_call>{"bad'),
    ("hermes", "plain text with < and <tool but no call"),
    ("mistral", '  [TOOL_CALLS][{"name": "add", "arguments": {"a": 5, "b": 6}}]'),
    ("mistral", "[not a call] at all"),
    ("mistral", "Hello there"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Lima"}}'),
    ("llama3_json", '{"name": "unknown", "parameters": {}}'),
    ("llama3_json", "It is sunny."),
    ("llama3_json", " " * 1500 + '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),  # past the held spaces
    ("hermes", "x" * 3000 + '<tool_call>{"name": "add", "arguments": {"a": "' + "y" * 3000 + '"}}</tool_call>'),
])
def test_a_streamed_output_gives_the_whole_outputs_calls_in_any_split(fmt, text):
    """Fed in random pieces, the text given out and the calls come to what the whole output gives:
    the same calls, and the text the whole parse keeps (which it strips at both ends)."""
    want_left, want_calls = parse(fmt, text, NAMES)
    rng = random.Random(7)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        stream, out, calls = ToolStream(fmt, NAMES), [], []
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            piece, got = stream.feed(text[a:b])
            out.append(piece)
            calls += got
        piece, got = stream.finish()
        out.append(piece)
        calls += got
        assert calls == want_calls
        if not want_calls:
            assert "".join(out) == text
        else:
            assert "".join(out).strip() == (want_left or "")  # the text given out is the text kept, but for spaces


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A byte-level BPE chat tokenizer with `[TOOL_CALLS]` as a special token of its own."""
    from lorafleet.model.tokenizer import Tokenizer
    from tests.fixtures import build_chat_model

    folder = build_chat_model(tmp_path_factory.mktemp("tools"))
    raw = json.loads((folder / "tokenizer.json").read_text())
    top = max(t["id"] for t in raw["added_tokens"])
    raw["added_tokens"].append({"id": top + 1, "content": tool_calls.MISTRAL_MARK, "single_word": False,
                                "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(raw))
    return Tokenizer.from_pretrained(folder)


def _accepts(matcher, ids) -> bool:
    return all(matcher.accept(t) is None for t in ids) and matcher.done


@pytest.mark.parametrize("fmt", tool_calls.FORMATS)
def test_the_grammar_of_a_call_takes_a_call_of_the_chosen_tools_only(tokenizer, fmt):
    """The forced call's grammar, token by token through llguidance: a call of a chosen tool with
    fitting arguments is taken to its end; a call of another tool, or arguments that break the
    parameters' schema, are refused at the token that breaks them."""
    mark = tokenizer.token_to_id(tool_calls.MISTRAL_MARK) if fmt == "mistral" else None
    key = "parameters" if fmt == "llama3_json" else "arguments"
    width = tokenizer.vocab_size
    grammar = compile(Constraint("lark", tool_calls.lark(fmt, [WEATHER], parallel=False, mark_token=mark), "tools"),
                      tokenizer, width)

    def ids(name: str, args: dict) -> list[int]:
        call = json.dumps({"name": name, key: args})
        if fmt == "hermes":
            return tokenizer.encode(f"<tool_call>\n{call}\n</tool_call>", add_special_tokens=False)
        if fmt == "mistral":
            return [mark, *tokenizer.encode(f"[{call}]", add_special_tokens=False)]
        return tokenizer.encode(call, add_special_tokens=False)

    assert _accepts(grammar.matcher(), ids("get_weather", {"city": "Paris"}))
    assert not _accepts(grammar.matcher(), ids("add", {"city": "Paris"}))
    assert not _accepts(grammar.matcher(), ids("get_weather", {"city": 3}))
    assert not _accepts(grammar.matcher(), ids("get_weather", {"town": "Paris"}))


@pytest.mark.parametrize("body,param,named", [
    ({"tools": {"a": 1}}, "tools", "tools must be a list"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "only function tools are supported"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools", "parameters must be"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools", "same name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 129}, "tools", "at most 128"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"}, "tool_choice", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not one of the request's tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
])
def test_malformed_tools_fields_are_400s_naming_the_field(body, param, named):
    with pytest.raises(InvalidRequestError) as e:
        tools.parse(body)
    assert e.value.param == param and named in str(e.value)


def test_the_tools_a_request_has_and_the_calls_its_messages_carry():
    f = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "extra": 1}}
    assert tools.parse({}) is None and tools.parse({"tools": [f], "tool_choice": "none"}) is None
    got = tools.parse({"tools": [f], "tool_choice": {"type": "function", "function": {"name": "f"}},
                       "parallel_tool_calls": False})
    assert got == tools.Tools(({"name": "f", "parameters": {"type": "object"}},), "f", False)
    m = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}
    assert tools.message_calls(m, 0)["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    for calls, named in (([{"function": {"name": "f", "arguments": "{x"}}], "not valid JSON"),
                         ([{"function": {"name": "f", "arguments": "[1]"}}], "must be a JSON object"),
                         ([{"id": "c"}], "must be {")):
        with pytest.raises(InvalidRequestError, match="messages\\[3\\].tool_calls\\[0\\]") as e:
            tools.message_calls({**m, "tool_calls": calls}, 3)
        assert named in str(e.value) and e.value.param == "messages"
    with pytest.raises(InvalidRequestError, match="tool_call_id must be a string"):
        tools.message_calls({"role": "tool", "content": "4", "tool_call_id": 4}, 1)


def _out(text: str, finished: bool = True, reason: str | None = "stop"):
    from types import SimpleNamespace

    return SimpleNamespace(text=text, token_ids=[1], logprobs=None, finish_reason=reason if finished else None,
                           prompt_token_ids=[1], metrics=None, new_text=text, new_token_ids=[1], new_logprobs=None,
                           finished=finished)


@pytest.mark.parametrize("parallel", [True, False])
def test_the_answers_calls_whole_and_streamed_with_parallel_calls_on_or_off(parallel):
    """A chat answer with two calls: both as `tool_calls` ("tool_calls" finish), or the first alone
    under parallel_tool_calls false; streamed in pieces, the same calls by index, then the finish."""
    from lorafleet.server import responses
    from lorafleet.server.protocol import Generation
    from lorafleet.engine.request import SamplingParams

    fns = tuple({"name": n} for n in sorted(NAMES))
    gen = Generation("chat", "m", None, [], SamplingParams(), tools=tools.Tools(fns, "auto", parallel),
                     tool_format="hermes")
    text = ('ok <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    body = responses.chat_response(gen, "id", 0, [_out(text)], str)
    choice = body["choices"][0]
    want = [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Rome"}')][:2 if parallel else 1]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == want
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "ok"
    stream, chunks = ToolStream("hermes", NAMES), []
    for i in range(0, len(text), 9):
        last = i + 9 >= len(text)
        chunks += responses.tool_chunks(gen, "id", 0, stream, _out(text[i:i + 9], finished=last), str)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for t in d.get("tool_calls", ()):
            calls.setdefault(t["index"], ["", ""])
            calls[t["index"]][0] += t.get("function", {}).get("name", "") or ""
            calls[t["index"]][1] += t.get("function", {}).get("arguments", "") or ""
    assert [tuple(calls[i]) for i in sorted(calls)] == want
    assert "".join(d.get("content", "") for d in deltas).strip() == "ok"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["tool_calls"]
