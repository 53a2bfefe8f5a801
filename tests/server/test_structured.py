"""Structured output over the API, on the demo fleet's daemon, as clients ask for it: the openai
client's `chat.completions.parse` with a pydantic model, `response_format` json_object and
json_schema, vLLM's `structured_outputs` and `guided_*` fields on both routes, streamed or not;
what cannot be served is a 400 naming the field and the feature, and no field that constrains
the output is ignored."""

from __future__ import annotations

import json
import re

import pytest

from tests.daemons import Daemon

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
ASK = [{"role": "user", "content": "echo: hello world"}]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    daemon = Daemon.start(tmp_path_factory.mktemp("structured"))
    yield daemon
    daemon.kill()


def test_the_openai_client_parses_into_a_pydantic_model(demo):
    import pydantic

    class Trip(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        city: str = pydantic.Field(max_length=8)
        days: int = pydantic.Field(ge=1, le=9)

    out = demo.openai().chat.completions.parse(model="upper", messages=ASK, response_format=Trip, max_tokens=60,
                                               temperature=0)
    trip = out.choices[0].message.parsed
    assert isinstance(trip, Trip) and 1 <= trip.days <= 9 and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_and_json_object_on_chat(demo, stream):
    """A schema's answer parses and fits it; `json_object`'s is an object as far as it goes (a
    random demo model may fill a key until max_tokens: then it is cut, "length", as OpenAI's is)."""
    client = demo.openai()
    for fmt in ({"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}},
                {"type": "json_object"}):
        kw = dict(model="reverse", messages=ASK, response_format=fmt, max_tokens=60, temperature=0)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            choice = client.chat.completions.create(**kw).choices[0]
            text, reason = choice.message.content, choice.finish_reason
        if fmt["type"] == "json_schema":
            value = json.loads(text)
            assert reason == "stop" and set(value) == {"city", "days"} and 1 <= value["days"] <= 9, text
        else:
            assert text.startswith("{") and (reason == "length" or isinstance(json.loads(text), dict)), text


def test_vllms_fields_on_both_routes(demo):
    with demo.http() as c:
        def ask(route, **extra):
            body = ({"model": "demo", "prompt": "hello", "max_tokens": 16, "temperature": 0.8, "seed": 1, **extra}
                    if route == "completions" else
                    {"model": "title", "messages": ASK, "max_tokens": 16, "temperature": 0, **extra})
            r = c.post(f"/v1/{route}" if route == "completions" else "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice.get("text", (choice.get("message") or {}).get("content")), choice["finish_reason"]

        for route in ("completions", "chat"):
            assert ask(route, structured_outputs={"choice": ["alpha", "beta"]})[0] in ("alpha", "beta")
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", ask(route, structured_outputs={"regex": r"[0-9]{3}-[a-z]{2}"})[0])
            assert ask(route, guided_choice=["up", "down"]) in (("up", "stop"), ("down", "stop"))
            assert re.fullmatch(r"x[0-9]", ask(route, guided_grammar='root ::= "x" [0-9]')[0])
            assert set(json.loads(ask(route, guided_json=SCHEMA, max_tokens=60)[0])) == {"city", "days"}
            assert json.loads(ask(route, structured_outputs={"json": SCHEMA}, max_tokens=60)[0])["days"] >= 1


@pytest.mark.parametrize("extra, param, named", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format", "not"),
    ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs.regex", "look-around"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
    ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs.choice", "one structured output"),
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "guided_json", "one structured output"),
    ({"response_format": {"type": "yaml"}}, "response_format", "text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs an object with a schema"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
    ({"guided_choice": []}, "guided_choice", "non-empty strings"),
])
def test_what_cannot_be_served_is_a_400_naming_it(demo, extra, param, named):
    with demo.http() as c:
        r = c.post("/v1/chat/completions", json={"model": "demo", "messages": ASK, "max_tokens": 4, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and named in err["message"], err
        assert c.post("/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 2}).status_code == 200
