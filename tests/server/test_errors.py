"""Every kind of bad request answers a 4xx with OpenAI's error body and a message naming the
problem, and the daemon keeps serving."""

from __future__ import annotations

import json

import pytest


def post(served, path, body=None, raw: bytes | None = None):
    with served.http() as c:
        if raw is not None:
            return c.post(path, content=raw, headers={"Content-Type": "application/json"})
        return c.post(path, json=body)


def assert_error(r, status: int, *words: str, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    for w in words:
        assert w in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b'{"prompt": "x",}'])
def test_malformed_json_is_400(served, raw):
    assert_error(post(served, "/v1/completions", raw=raw), 400, "not valid JSON")


@pytest.mark.parametrize("body", [[1, 2], "prompt", 3])
def test_a_body_that_is_not_an_object_is_400(served, body):
    assert_error(post(served, "/v1/completions", body), 400, "JSON object")


def test_unknown_adapter_is_404_model_not_found(served):
    err = assert_error(post(served, "/v1/completions", {"model": "no-such-adapter", "prompt": "hi"}), 404,
                       "no-such-adapter", "does not exist", param="model")
    assert err["code"] == "model_not_found"
    assert_error(post(served, "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
                 404, "nope")


def test_over_long_prompt_is_400(served):
    r = post(served, "/v1/completions", {"model": "base", "prompt": [5] * 600, "max_tokens": 4})
    assert_error(r, 400, "600 tokens", "context")


@pytest.mark.parametrize("field,value,words", [
    ("temperature", -1, ["temperature"]),
    ("temperature", "hot", ["temperature", "number"]),
    ("max_tokens", 0, ["max_tokens"]),
    ("max_tokens", 2.5, ["max_tokens", "integer"]),
    ("top_p", 1.5, ["top_p"]),
    ("top_k", -3, ["top_k"]),
    ("n", 2, ["n must be 1"]),
    ("logprobs", 99, ["logprobs"]),
    ("stop", [""], ["stop"]),
    ("stop", 7, ["stop"]),
    ("seed", "abc", ["seed"]),
    ("seed", -1, ["seed"]),
    ("stream", "yes", ["stream"]),
    ("echo", True, ["echo"]),
    ("presence_penalty", 0.5, ["presence_penalty"]),
    ("prompt", [], ["prompt"]),
    ("prompt", [1, "two"], ["prompt"]),
    ("prompt", [99999], ["token ids"]),
    ("prompt", None, ["prompt"]),
])
def test_bad_completion_parameters_are_400(served, field, value, words):
    body = {"model": "base", "prompt": "hi", "max_tokens": 2, field: value}
    assert_error(post(served, "/v1/completions", body), 400, *words)


@pytest.mark.parametrize("body,words", [
    ({}, ["messages"]),
    ({"messages": []}, ["messages"]),
    ({"messages": [{"content": "no role"}]}, ["messages[0]"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, ["text parts"]),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, ["top_logprobs", "logprobs: true"]),
    ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, ["stream_options"]),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, ["tools"]),
])
def test_bad_chat_requests_are_400(served, body, words):
    assert_error(post(served, "/v1/chat/completions", {"model": "base", **body}), 400, *words)


def test_broken_adapter_loads_are_400(served, tmp_path, adapter_dirs):
    missing = post(served, "/v1/load_lora_adapter", {"lora_name": "x1", "lora_path": str(tmp_path / "missing")})
    assert_error(missing, 400, "missing")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{oops")
    assert_error(post(served, "/v1/load_lora_adapter", {"lora_name": "x2", "lora_path": str(broken)}), 400, "adapter_config.json")
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    src = adapter_dirs["all-r8"]
    (truncated / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    (truncated / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes()[:500])
    assert_error(post(served, "/v1/load_lora_adapter", {"lora_name": "x3", "lora_path": str(truncated)}), 400)
    assert_error(post(served, "/v1/load_lora_adapter", {"lora_name": "bad name!", "lora_path": str(src)}), 400, "name")
    assert_error(post(served, "/v1/load_lora_adapter", {"lora_name": "base", "lora_path": str(src)}), 400, "base")
    assert_error(post(served, "/v1/load_lora_adapter", {"lora_path": str(src)}), 400, "lora_name", param="lora_name")
    names = [m["id"] for m in json.loads(served.http().get("/v1/models").text)["data"]]
    assert not {"x1", "x2", "x3"} & set(names)


def test_unloading_an_unknown_adapter_is_404(served):
    r = post(served, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert r.status_code == 404 and "never-loaded" in r.json()["error"]["message"]


LONG = "n" * 200_000
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path,body,status", [
    ("/v1/chat/completions", {"model": "base", "adapters": [{"name": LONG}], **CHAT}, 400),  # a mix's entry
    ("/v1/chat/completions", {"model": LONG, "adapters": [{"name": "all-r8"}], **CHAT}, 400),
    ("/v1/chat/completions", {"model": LONG, **CHAT}, 404),
    ("/v1/completions", {"model": "base", "prompt": "hi", "temperature": LONG}, 400),
    ("/v1/unload_lora_adapter", {"lora_name": LONG}, 404),
    ("/v1/load_lora_adapter", {"lora_name": LONG, "lora_path": "/nowhere"}, 400),
], ids=["mix entry", "model beside a mix", "model", "temperature", "unload", "load"])
def test_a_200000_character_name_is_not_echoed_whole(served, path, body, status):
    with served.http() as c:
        r = c.post(path, json=body)
    assert r.status_code == status, r.text[:300]
    message = r.json()["error"]["message"]
    assert len(message) < 600, message[:300]
    assert "n" * 65 not in message  # at most its first 64 characters
    if "n" * 64 in message:
        assert "… (200000 characters)" in message


def test_unknown_routes_and_methods_answer_openai_errors(served):
    with served.http() as c:
        assert_error(c.get("/v1/nothing-here"), 404, "/v1/nothing-here")
        r = c.get("/v1/completions")
        assert r.status_code == 405 and "error" in r.json()


def test_the_daemon_serves_on_after_bad_requests(served):
    for raw in (b"{", b"[]", b'{"prompt": 5}'):
        post(served, "/v1/completions", raw=raw)
    with served.http() as c:
        assert c.get("/health").json() == {"status": "ok"}
        ok = c.post("/v1/completions", json={"model": "base", "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
