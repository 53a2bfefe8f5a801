"""Tool calls over the API, on the demo fleet's daemon, with the openai client over the socket and
over TCP: a forced call (required, named) that parses and fits its function's parameters, the
tool's result sent back and answered, calls streamed as OpenAI streams them and equal to the whole
answer's; a template that takes no tools, and tools beside structured output, are 400s."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from tests.daemons import Daemon, free_port

KEY = "tools-test-key"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "maximum": 999},
                                                                 "b": {"type": "integer", "maximum": 999}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    port = free_port()
    daemon = Daemon.start(tmp_path_factory.mktemp("tools"), "--host", "127.0.0.1", "--port", str(port),
                          "--api-key", KEY)
    daemon.url = f"http://127.0.0.1:{port}/v1"
    yield daemon
    daemon.kill()


def client(demo, over: str):
    import openai

    return demo.openai() if over == "socket" else openai.OpenAI(base_url=demo.url, api_key=KEY, max_retries=0)


def check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in SCHEMAS
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


@pytest.mark.parametrize("over", ["socket", "tcp"])
def test_a_tools_round_trip_with_the_openai_client(demo, over):
    """A named call, its result sent back as a tool message, and the final answer."""
    c = client(demo, over)
    first = c.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER, ADD], temperature=0,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    check_call(call)
    messages = [*ASK, choice.message,  # the client's own message object, sent back as README does
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    final = c.chat.completions.create(model="upper", messages=messages, tools=[WEATHER, ADD], max_tokens=30,
                                      temperature=0).choices[0]
    assert final.message.tool_calls is None and final.message.content and final.finish_reason in ("stop", "length")


def test_a_required_call_fits_its_tool_whatever_is_drawn(demo):
    """`required` at temperature 1 over several seeds and adapters: every answer is one or more
    calls of the request's tools, each fitting its parameters."""
    c = client(demo, "socket")
    for seed, model in enumerate(["demo", "upper", "reverse", "kebab"] * 2):
        choice = c.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, ADD], tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=200).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls and all(check_call(t) is not None for t in choice.message.tool_calls)


@pytest.mark.parametrize("over", ["socket", "tcp"])
def test_streamed_calls_are_the_whole_answers(demo, over):
    """Streamed, the calls come as OpenAI streams them (id and name, then arguments, by index), and
    put together they are the whole answer's calls; so is the finish reason."""
    c = client(demo, over)
    kw = dict(model="reverse", messages=ASK, tools=[WEATHER, ADD], tool_choice="required", temperature=0,
              max_tokens=200)
    whole = c.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in c.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for d in choice.delta.tool_calls or ():
                got = calls.setdefault(d.index, {"name": "", "arguments": ""})
                got["name"] += (d.function.name or "") if d.function else ""
                got["arguments"] += (d.function.arguments or "") if d.function else ""
    assert [r for r in reasons if r] == ["tool_calls"] == [whole.finish_reason]
    assert [calls[i] for i in sorted(calls)] == [{"name": t.function.name, "arguments": t.function.arguments}
                                                  for t in whole.message.tool_calls]


def test_tool_choice_none_and_auto_answer_text(demo):
    """`none` renders no tools (the prompt is the plain chat's); `auto` leaves the answer free and
    reads no call out of text that makes none."""
    with demo.http() as h:
        plain = h.post("/v1/chat/completions", json={"model": "upper", "messages": ASK, "max_tokens": 8}).json()
        none = h.post("/v1/chat/completions", json={"model": "upper", "messages": ASK, "max_tokens": 8,
                                                    "tools": [WEATHER], "tool_choice": "none"}).json()
        auto = h.post("/v1/chat/completions", json={"model": "upper", "messages": ASK, "max_tokens": 8,
                                                    "tools": [WEATHER], "temperature": 0}).json()
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert auto["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]  # the tools were rendered
    assert "tool_calls" not in auto["choices"][0]["message"] and auto["choices"][0]["finish_reason"] != "tool_calls"


@pytest.mark.parametrize("extra,param,named", [
    ({"response_format": {"type": "json_object"}}, "tools", "tools and response_format both hold this answer"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not one of the request's"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                              "function": {"name": "add", "arguments": "{"}}]}]},
     "messages", "arguments is not valid JSON"),
])
def test_what_cannot_be_served_is_a_400_naming_it(demo, extra, param, named):
    with demo.http() as h:
        r = h.post("/v1/chat/completions", json={"model": "demo", "messages": ASK, "tools": [WEATHER], **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param and named in r.json()["error"]["message"]


def test_a_template_that_takes_no_tools_is_a_400_naming_it(tmp_path):
    from lorafleet import Engine
    from lorafleet.deploy.inprocess import InProcessServer
    from tests.fixtures import build_chat_model

    base = build_chat_model(tmp_path / "base")  # a ChatML template that never reads `tools`
    engine = Engine(base, pool_bytes=8 << 20)
    server = InProcessServer(engine, "base", base)
    try:
        body = {"model": "base", "messages": ASK, "tools": [WEATHER], "max_tokens": 4}
        status, _, raw = asyncio.run(server.call("POST", "/v1/chat/completions", json.dumps(body).encode()))
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == "tools" and "does not take tools" in error["message"]
        body["tool_choice"] = "none"  # no tools rendered: served
        status, _, raw = asyncio.run(server.call("POST", "/v1/chat/completions", json.dumps(body).encode()))
        assert status == 200, raw
    finally:
        server.close()
        engine.close()


# A ChatML template written as the Qwen2.5 family's works (not its text): tools listed in the system
# turn, an assistant's calls as <tool_call> blocks of {"name", "arguments"} (arguments written with
# tojson: objects), a tool's result as a <tool_response> in a user turn
QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Call as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% elif m.role == 'assistant' and m.tool_calls is defined %}<|im_start|>assistant\n"
    "{{ m.content }}{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


SMALL_ADD = {"type": "function", "function": {"name": "add", "parameters": {  # bounded: a random model's digits end
    "type": "object", "properties": {k: {"type": "integer", "minimum": 0, "maximum": 99} for k in "ab"},
    "required": ["a", "b"], "additionalProperties": False}}}


def test_a_chatml_model_with_a_qwen_like_template_renders_calls_back_and_is_held_to_a_call(tmp_path):
    """A byte-level BPE model whose template takes tools: a forced call on its vocabulary parses and
    fits the tool, and the conversation sent back (the call, its arguments as an object, the tool's
    result) renders as the template writes it."""
    from lorafleet import Engine
    from lorafleet.deploy.inprocess import InProcessServer
    from tests.fixtures import build_chat_model

    base = build_chat_model(tmp_path / "base")
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": QWEN_LIKE}))
    engine = Engine(base, pool_bytes=8 << 20)
    server = InProcessServer(engine, "base", base)

    def post(body):
        status, _, raw = asyncio.run(server.call("POST", "/v1/chat/completions", json.dumps(body).encode()))
        return status, json.loads(raw)
    try:
        status, out = post({"model": "base", "messages": ASK, "tools": [SMALL_ADD], "temperature": 0,
                            "tool_choice": {"type": "function", "function": {"name": "add"}}, "max_tokens": 120})
        assert status == 200, out
        call = out["choices"][0]["message"]["tool_calls"][0]
        assert out["choices"][0]["finish_reason"] == "tool_calls" and call["function"]["name"] == "add"
        jsonschema.validate(json.loads(call["function"]["arguments"]), SMALL_ADD["function"]["parameters"])
        back = [*ASK, out["choices"][0]["message"], {"role": "tool", "tool_call_id": call["id"], "content": "42"}]
        rendered = engine.tokenizer.apply_chat_template(
            [*ASK, {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "add", "arguments": json.loads(call["function"]["arguments"])}}]},
             {"role": "tool", "content": "42"}], tools=[SMALL_ADD], tokenize=True)
        status, final = post({"model": "base", "messages": back, "tools": [SMALL_ADD], "max_tokens": 2})
        assert status == 200 and final["usage"]["prompt_tokens"] == len(rendered)
    finally:
        server.close()
        engine.close()
