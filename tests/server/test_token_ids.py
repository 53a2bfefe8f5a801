"""A model without tokenizer.json: prompts are token ids, and the answers carry the generated
token ids (`token_ids`), streamed chunk by chunk as they come, equal to the engine's own."""

from __future__ import annotations

import asyncio
import json

import pytest

from lorafleet import Engine, SamplingParams


@pytest.fixture(scope="module")
def server(llama_dir):
    from lorafleet.deploy.inprocess import InProcessServer

    engine = Engine(llama_dir, device="cpu", pool_bytes=16 << 20)
    assert engine.tokenizer is None
    s = InProcessServer(engine, "tiny", llama_dir)
    yield s
    s.close()


PROMPT = [5, 17, 99, 3, 42, 8]


def reference(server) -> list[int]:
    out = asyncio.run(server.run(lambda e: e.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0,
                                                                               ignore_eos=True))))
    return out[0].token_ids


def test_a_stream_sends_the_token_ids_as_they_come(server):
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()

    async def go():
        return [item async for item in server.request("POST", "/v1/completions", body)]
    items = asyncio.run(go())
    assert items[0]["status"] == 200
    events = [json.loads(line[6:]) for c in items[1:] for line in c.decode().split("\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    ids = [i for e in events for i in e["choices"][0].get("token_ids", [])]
    assert ids == reference(server)
    assert sum(1 for e in events if e["choices"][0].get("token_ids")) > 1, "the ids came in one chunk"


def test_a_whole_answer_carries_the_token_ids(server):
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                       "ignore_eos": True}).encode()
    status, _, raw = asyncio.run(server.call("POST", "/v1/completions", body))
    assert status == 200
    choice = json.loads(raw)["choices"][0]
    assert choice["token_ids"] == reference(server) and choice["text"] == ""
