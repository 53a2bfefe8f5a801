"""A streamed answer, put together, is the whole answer: text, finish reason, usage and logprobs
(tokens, their logprobs, the top ones and the text offsets), chunk by chunk from the engine's
deltas, the whole one from its final outputs. In process (`deploy/inprocess.py`), no socket."""

from __future__ import annotations

import asyncio
import json

import pytest

from lorafleet import Engine

PARAMS = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(chat_model_dir):
    from lorafleet.deploy.inprocess import InProcessServer

    s = InProcessServer(Engine(chat_model_dir, device="cpu", pool_bytes=16 << 20), "base", chat_model_dir)
    yield s
    s.close()


def whole(server, path: str, body: dict) -> dict:
    status, _, raw = asyncio.run(server.call("POST", path, json.dumps(body).encode()))
    assert status == 200, raw
    return json.loads(raw)


def streamed(server, path: str, body: dict) -> list[dict]:
    async def go():
        return [item async for item in server.request("POST", path, json.dumps({**body, "stream": True}).encode())]
    items = asyncio.run(go())
    assert items[0]["status"] == 200
    events = [json.loads(line[6:]) for c in items[1:] for line in c.decode().split("\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert events and all("error" not in e for e in events)
    return events


@pytest.mark.parametrize("stop", [[], ["never-seen"]], ids=["no-stop", "held-back"])
def test_streamed_completions_add_up_to_the_whole_ones(server, stop):
    """Two prompts in one request (each request's offsets are its own); with a stop string that
    never comes, text is held back, then handed out."""
    body = {"model": "base", "prompt": ["hello world", "the quick brown fox"], "logprobs": 2, "stop": stop,
            "stream_options": {"include_usage": True}, **PARAMS}
    want = whole(server, "/v1/completions", {k: v for k, v in body.items() if k != "stream_options"})
    events = streamed(server, "/v1/completions", body)
    assert events[-1]["usage"] == want["usage"] and events[-1]["usage"]["completion_tokens"] == 48
    for choice in want["choices"]:
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [c["finish_reason"] for c in mine][-1] == choice["finish_reason"] == "length"
        got = {key: [x for c in mine if c["logprobs"] for x in c["logprobs"][key]]
               for key in ("tokens", "token_logprobs", "top_logprobs")}
        assert got["tokens"] == choice["logprobs"]["tokens"]
        # the two prompts may share a step in one call and not in the other, and a step's row count
        # may change the order of the base's sums (AMD's layout): logprobs agree to ulps, not bits
        assert got["token_logprobs"] == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-5)
        for mine_top, want_top in zip(got["top_logprobs"], choice["logprobs"]["top_logprobs"], strict=True):
            assert mine_top.keys() == want_top.keys() and mine_top == pytest.approx(want_top, abs=1e-5)
        sent = 0  # a chunk's text offsets start at the text streamed before it (held-back text not yet)
        for c in mine:
            if c["logprobs"] and c["logprobs"]["text_offset"]:
                assert c["logprobs"]["text_offset"][0] == sent
            sent += len(c["text"])


def test_streamed_chat_adds_up_to_the_whole_answer(server):
    body = {"model": "base", "messages": [{"role": "user", "content": "hello there"}], "logprobs": True,
            "top_logprobs": 2, **PARAMS}
    want = whole(server, "/v1/chat/completions", body)["choices"][0]
    chunks = [e["choices"][0] for e in streamed(server, "/v1/chat/completions", body)]
    assert "".join(c["delta"].get("content", "") for c in chunks) == want["message"]["content"]
    assert [x for c in chunks if c["logprobs"] for x in c["logprobs"]["content"]] == want["logprobs"]["content"]
    assert chunks[-1]["finish_reason"] == want["finish_reason"]
