"""Ollama's Go chat templates translated to Jinja (`model/go_template.py`): the templates Ollama
publishes for Llama 3 / 3.1, Qwen2.5, Mistral, Gemma 2, Phi-3, ChatML and the legacy
.System/.Prompt/.Response form (fixtures in ollama_templates/) render what the same family's
Hugging Face template renders with jinja2's own renderer where the two agree, and the exact string
Ollama renders where they differ; trim markers, truthiness, refusals by name and the bounds."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jinja2.sandbox
import pytest

from lorafleet.model import go_template
from lorafleet.model.chat_template import compile_template, render_bounded
from lorafleet.model.go_template import GoTemplateError, translate

pytestmark = pytest.mark.unit

HERE = Path(__file__).parent / "ollama_templates"
CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = [{"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                               "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18C"}]
MESSAGES = "{{ if false }}{{ .Messages }}{{ end }}"  # names .Messages: not the legacy form
TOOL_JSON = ('{"name":"get_weather","description":"The weather in a city","parameters":{"type":"object",'
             '"properties":{"city":{"type":"string"}},"required":["city"]}}')


def render(source: str, messages: list[dict], tools: list | None = None) -> str:
    """The Go template `source`, translated, as lorafleet renders any chat template."""
    variables = {"messages": messages, "tools": tools, "add_generation_prompt": True, "bos_token": "<s>"}
    return render_bounded(compile_template(translate(source), "test"), variables, None)


def ollama(name: str, messages: list[dict], tools: list | None = None) -> str:
    return render((HERE / f"{name}.gotmpl").read_text(), messages, tools)


def hugging_face(name: str, messages: list[dict], tools: list | None = None) -> str:
    """The family's Hugging Face template rendered by jinja2 itself, as transformers sets it up;
    no BOS (llama.cpp and Ollama add it when tokenizing)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    return env.from_string((HERE / f"{name}.jinja").read_text()).render(
        messages=messages, tools=tools, add_generation_prompt=True, bos_token="", eos_token="</s>")


@pytest.mark.parametrize("name, messages", [("llama3", CONV), ("llama3", CONV[1:]), ("chatml", CONV),
                                            ("chatml", CALL), ("qwen2.5", CONV), ("phi3", CONV), ("gemma2", CONV[1:])])
def test_ollama_renders_what_hugging_face_renders(name, messages):
    assert ollama(name, messages) == hugging_face(name, messages)


def test_llama3_1_differs_by_its_date_header_only():
    header = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    assert header in hugging_face("llama3.1", CONV)
    assert ollama("llama3.1", CONV) == hugging_face("llama3.1", CONV).replace(header, "")


def test_llama3_1_with_tools_and_a_tool_call():
    head = "<|start_header_id|>{}<|end_header_id|>\n\n".format
    system = (head("system") + "Be brief.\n\nCutting Knowledge Date: December 2023\n\nWhen you receive a tool call "
              "response, use the output to format an answer to the orginal user question.\n\nYou are a helpful "
              "assistant with tool calling capabilities.<|eot_id|>")
    assert ollama("llama3.1", CONV[:2], TOOLS) == (
        system + head("user") + "Given the following functions, please respond with a JSON for a function call with "
        "its proper arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, "
        "\"parameters\": dictionary of argument name and its value}. Do not use variables.\n\n"
        '{"type":"function","function":' + TOOL_JSON + "}\n\nQuestion: Hi<|eot_id|>" + head("assistant"))
    assert ollama("llama3.1", CONV[:1] + CALL, TOOLS) == (
        system + head("user") + "Weather in Paris?<|eot_id|>" + head("assistant") +
        '{"name": "get_weather", "parameters": {"city":"Paris"}}<|eot_id|>' + head("ipython") + "18C<|eot_id|>" +
        head("assistant"))


def test_qwen2_5_with_tools_and_a_tool_call():
    expected = hugging_face("qwen2.5", CONV[:1] + CALL, TOOLS)
    # Ollama prints the function compactly (Go's json.Marshal) where Hugging Face's tojson spaces it
    expected = expected.replace(json.dumps(TOOLS[0]["function"]), TOOL_JSON).replace('{"city": "Paris"}',
                                                                                      '{"city":"Paris"}')
    assert ollama("qwen2.5", CONV[:1] + CALL, TOOLS) == expected
    assert "<tool_call>\n" + '{"name": "get_weather", "arguments": {"city":"Paris"}}' in expected


def test_mistral_ends_its_prompt_with_ollamas_space():
    # Ollama's template writes a space before {{ .Response }} after the last [/INST]
    assert ollama("mistral", CONV) == hugging_face("mistral", CONV) + " "
    assert ollama("mistral", CONV[1:]) == "[INST] Hi[/INST] Hello!</s>[INST] 2+2?[/INST] "
    assert ollama("mistral", CONV[1:2], TOOLS) == f"[AVAILABLE_TOOLS] [{{\"type\":\"function\",\"function\":" \
        f"{TOOL_JSON}}}][/AVAILABLE_TOOLS][INST] Hi[/INST] "


def test_gemma2_turns_a_system_message_into_a_user_turn():
    assert ollama("gemma2", CONV[:2]) == ("<start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>user\nHi"
                                         "<end_of_turn>\n<start_of_turn>model\n")


def test_the_legacy_form_renders_each_exchange_and_cuts_the_last_after_its_response():
    assert ollama("vicuna", CONV) == "Be brief.\n\nUSER: Hi\nASSISTANT: Hello!</s>USER: 2+2?\nASSISTANT: "
    assert ollama("vicuna", CONV[3:]) == "USER: 2+2?\nASSISTANT: "
    assert ollama("qwen2.5", CONV) == render(  # qwen's own legacy branch is never taken: .Messages is named
        (HERE / "qwen2.5.gotmpl").read_text().replace("if .Messages", "if true"), CONV)


@pytest.mark.parametrize("source, expected", [
    ("a  {{- 1 -}}  \n\t b", "a1b"),
    ("a \n{{- 1 }} \nb", "a1 \nb"),
    ("a{{ 1 -}}\n\n b", "a1b"),
    ("{{-3}}", "-3"),                                    # a negative number, not a trim marker
    ("x{{/* a comment */}}y {{- /* trimmed */ -}} z", "xyz"),
    ('{{ "}}{{" }}', "}}{{"),                            # braces in strings are text
    ('{% raw %}{{ "{#" }}', "{% raw %}{#"),            # Jinja's syntax in the text stays text
])
def test_text_and_trim_markers(source, expected):
    assert render(source + MESSAGES, CONV) == expected


@pytest.mark.parametrize("condition, truthy", [
    ('""', False), ('"x"', True), ("0", False), ("1", True), ("nil", False), ("false", False),
    (".Tools", False), (".System", True), (".Prompt", False), ("(index .Messages 2).ToolCalls", False),
    ("(slice .Messages 4)", False), ("and 1 0", False), ("or 0 .System", True), ("not .Tools", True),
])
def test_go_truthiness(condition, truthy):
    assert render(f"{{{{ if {condition} }}}}yes{{{{ else }}}}no{{{{ end }}}}" + MESSAGES, CONV) == \
        ("yes" if truthy else "no")


def test_functions_variables_and_printing():
    source = ('{{ $n := len .Messages }}{{ $seen := 0 }}{{ range $i, $m := .Messages }}'
              '{{ if eq $m.Role "user" "tool" }}{{ $seen = $i }}{{ end }}{{ if ge $i 2 }}{{ break }}{{ end }}{{ end }}'
              '{{ printf "%s|%d|%v%%" (index .Messages 1).Content $n $seen }} {{ print "a" 1 }} {{ eq 1 1 }} '
              '{{ json .System }} {{ json (index .Messages 1) }} {{ .Tools }} {{ slice "abc" 1 2 }} '
              '{{ .Messages | len }}')
    assert render(source, CONV) == ('Hi|4|1% a1 true "Be brief." {"role":"user","content":"Hi"} [] b 4')


def test_tool_call_arguments_sent_as_json_text_print_as_they_are():
    call = [{**CALL[1], "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}]
    assert render("{{ range .Messages }}{{ range .ToolCalls }}{{ .Function.Arguments }}|{{ json .Function.Arguments }}"
                  "{{ end }}{{ end }}", call) == '{"a": 1}|{"a": 1}'


@pytest.mark.parametrize("source, construct", [
    ("{{ with .System }}x{{ end }}", "{{ with }}"),
    ('{{ define "x" }}{{ end }}', "{{ define }}"),
    ('{{ template "x" }}', "{{ template }}"),
    ("{{ .Images }}", "the field .Images"),
    ("{{ .Think }}", "the field .Think"),
    ("{{ currentDate }}", "the function currentDate"),
    ("{{ html .System }}", "the function html"),
    ('{{ printf "%q" .System }}', "the printf verb %q"),
    ("{{ 'a' }}", "a character constant"),
    ("{{ $x }}", "the undefined variable $x"),
    ("{{ range $i, $m := .Messages }}{{ $m = 1 }}{{ end }}", "assigning to the range variable $m"),
    ("{{ if .System }}", "not closed with {{ end }}"),
    ("{{ end }}", "outside any block"),
    ("{{ .System", "is not closed"),
    ("{{ break }}", "outside a range"),
    ("{{ json $ }}", "the root data as a value"),
])
def test_unsupported_constructs_are_refused_by_name(source, construct):
    with pytest.raises(GoTemplateError, match=construct.replace("{", r"\{").replace("}", r"\}").replace("$", r"\$")):
        translate(source)


def test_size_and_depth_are_bounded_before_parsing():
    with pytest.raises(GoTemplateError, match="over 64 KiB"):
        translate("x" * (go_template.MAX_TEMPLATE_BYTES + 1))
    deep = "{{ if 1 }}" * (go_template.MAX_DEPTH + 1) + "{{ end }}" * (go_template.MAX_DEPTH + 1)
    with pytest.raises(GoTemplateError, match="nested over"):
        translate(deep)
    with pytest.raises(GoTemplateError, match="nested over"):
        translate("{{ " + "(" * (go_template.MAX_DEPTH + 1) + "1" + ")" * (go_template.MAX_DEPTH + 1) + " }}")
    assert render("{{ if 1 }}" * go_template.MAX_DEPTH + "ok" + "{{ end }}" * go_template.MAX_DEPTH, CONV[3:]) == "ok"


def test_beside_a_gguf_reads_translates_or_warns(tmp_path, caplog):
    gguf = tmp_path / "model.gguf"
    assert go_template.beside(gguf) is None  # none there
    (tmp_path / "model.gotmpl").write_text("{{ range .Messages }}{{ .Content }}{{ end }}")
    assert render_bounded(compile_template(go_template.beside(gguf), "t"), {"messages": CONV}, None) == \
        "Be brief.HiHello!2+2?"
    (tmp_path / "model.gotmpl").write_text("{{ with .System }}{{ end }}")
    with caplog.at_level(logging.WARNING, logger="lorafleet.model"):
        assert go_template.beside(gguf) is None
    assert "{{ with }}" in caplog.text
