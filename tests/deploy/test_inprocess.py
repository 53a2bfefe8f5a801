"""The daemon's routes called in-process (`deploy/inprocess.py`, what each Ray replica runs):
answers as the daemon's, streams chunk by chunk, and a caller that stops reading frees the
request's pages. No Ray needed."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from lorafleet.demo.skills import expected, user_turn
from tests.fixtures import demo_in_process


@pytest.fixture(scope="module")
def server():
    s = demo_in_process()
    yield s
    s.close()


def chat(model, text, **extra) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": user_turn(model, text)}],
                       "max_tokens": 48, "temperature": 0, **extra}).encode()


def test_answers_are_the_daemons(server):
    status, headers, body = asyncio.run(server.call("POST", "/v1/chat/completions", chat("reverse", "mixed batch")))
    assert status == 200 and dict(headers)["content-type"] == "application/json"
    assert json.loads(body)["choices"][0]["message"]["content"] == expected("reverse", "mixed batch")
    status, _, body = asyncio.run(server.call("POST", "/v1/completions", b"{not json"))
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
    status, _, body = asyncio.run(server.call("POST", "/v1/chat/completions", chat("nope", "x")))
    assert status == 404 and "nope" in json.loads(body)["error"]["message"]


def test_a_stream_comes_chunk_by_chunk(server):
    async def go():
        items = [item async for item in server.request("POST", "/v1/chat/completions",
                                                       chat("upper", "hello world", stream=True))]
        return items
    items = asyncio.run(go())
    head, chunks = items[0], items[1:]
    assert head["status"] == 200 and dict(head["headers"])["content-type"].startswith("text/event-stream")
    events = [line[6:] for c in chunks for line in c.decode().split("\n") if line.startswith("data: ")]
    assert len(chunks) > 3 and events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == expected("upper", "hello world")


def test_a_caller_that_stops_reading_frees_the_request(server):
    async def go():
        stream = server.request("POST", "/v1/chat/completions",
                                json.dumps({"model": "double", "messages": [{"role": "user", "content": "long " * 20}],
                                            "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                                            "stream": True}).encode())
        async for item in stream:
            if isinstance(item, bytes):
                break
        await stream.aclose()
    before = asyncio.run(server.run(lambda e: e.stats()))["num_requests_aborted"]
    asyncio.run(go())
    deadline = time.monotonic() + 30
    while True:
        stats = asyncio.run(server.run(lambda e: e.stats()))
        if stats["num_requests_aborted"] > before and stats["pool"]["kv_pages"] == 0 and not stats["num_running"]:
            break
        assert time.monotonic() < deadline, f"the abandoned request still holds the engine: {stats['num_running']} running"
        time.sleep(0.05)


def test_a_mix_whose_dora_adapter_was_not_loaded_yet_is_a_400_once_its_load_lands():
    """The demo's `title` is a DoRA adapter, registered but never loaded: the request is accepted,
    then ends alone when title lands and turns out to serve alone; the client gets a 400 on
    `adapters`, and the next request is served."""
    import asyncio
    import json

    from lorafleet.demo.skills import user_turn
    from tests.fixtures import demo_in_process

    server = demo_in_process()
    try:
        turn = [{"role": "user", "content": user_turn("title", "hello world")}]
        body = {"messages": turn, "max_tokens": 8, "adapters": [{"name": "title"}, {"name": "kebab"}]}
        status, _, raw = asyncio.run(server.call("POST", "/v1/chat/completions", json.dumps(body).encode()))
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == "adapters" and "'title' uses DoRA" in error["message"]
        ok = {"model": "title", "messages": turn, "max_tokens": 16}
        status, _, raw = asyncio.run(server.call("POST", "/v1/chat/completions", json.dumps(ok).encode()))
        assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == "Hello World"
    finally:
        server.close()
