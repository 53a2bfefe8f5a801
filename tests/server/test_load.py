"""Load, bounded: 200 concurrent streaming requests over 50 adapters, one in five clients hanging
up mid-stream. Everyone else gets exactly the engine's output; afterwards no page is held, the
hung-up requests were aborted (not run to the end), and the daemon still answers."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.daemons import sse_events

N_REQUESTS, N_ADAPTERS, HANG_UP_EVERY = 200, 50, 5
MAX_TOKENS, HANG_UP_MAX_TOKENS = 6, 400


def name_of(i: int) -> str:
    return f"load-{i % N_ADAPTERS:02d}"


def prompt_of(i: int) -> str:
    return f"request {i}: the quick brown fox"


@pytest.fixture(scope="module")
def fleet(served, adapter_dirs):
    """50 adapter names over the five built adapters, loaded into the session daemon."""
    dirs = list(adapter_dirs.values())
    names = {f"load-{k:02d}": dirs[k % len(dirs)] for k in range(N_ADAPTERS)}
    for name, path in names.items():
        served.load(name, path)
    yield names
    with served.http() as c:
        for name in names:
            c.post("/v1/unload_lora_adapter", json={"lora_name": name})


@pytest.fixture(scope="module")
def expected_texts(chat_model_dir, fleet):
    from lorafleet import Engine, SamplingParams

    engine = Engine(chat_model_dir, device="cpu", pool_bytes=64 << 20)
    for name, path in fleet.items():
        engine.load_adapter(name, path)
    keep = [i for i in range(N_REQUESTS) if i % HANG_UP_EVERY]
    outs = engine.generate([prompt_of(i) for i in keep], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                        ignore_eos=True),
                           adapters=[name_of(i) for i in keep])
    if hasattr(engine, "close"):
        engine.close()
    return {i: o.text for i, o in zip(keep, outs)}


async def one_client(http: httpx.AsyncClient, i: int) -> tuple[int, str | None]:
    """Stream request i; a hang-up client leaves after its second text chunk."""
    hang_up = i % HANG_UP_EVERY == 0
    body = {"model": name_of(i), "prompt": prompt_of(i), "temperature": 0,
            "ignore_eos": True, "max_tokens": HANG_UP_MAX_TOKENS if hang_up else MAX_TOKENS}
    text, chunks = [], 0
    async for event in sse_events(http, "/v1/completions", body):
        text.append(event["choices"][0]["text"])
        chunks += 1
        if hang_up and chunks == 2:
            return i, None  # leaving the loop closes the connection mid-stream
    return i, "".join(text)


async def run_all(served) -> list[tuple[int, str | None]]:
    limits = httpx.Limits(max_connections=N_REQUESTS + 10, max_keepalive_connections=N_REQUESTS + 10)
    async with served.async_http(limits=limits, timeout=120.0) as http:
        return await asyncio.gather(*(one_client(http, i) for i in range(N_REQUESTS)))


def test_200_streams_over_50_adapters_with_hang_ups(served, fleet, expected_texts):
    before = served.stats()["engine"]
    t0 = time.perf_counter()
    results = asyncio.run(run_all(served))
    elapsed = time.perf_counter() - t0

    finished = {i: text for i, text in results if text is not None}
    assert finished.keys() == expected_texts.keys()
    wrong = [i for i in finished if finished[i] != expected_texts[i]]
    assert not wrong, f"{len(wrong)} streams differ from the engine, e.g. #{wrong[0]}"

    stats = served.wait_idle(timeout=15)
    eng = stats["engine"]
    assert eng["pool"]["kv_pages"] == 0 and eng["num_running"] == eng["num_waiting"] == 0
    assert stats["server"]["pending"] == 0
    hung_up = N_REQUESTS // HANG_UP_EVERY
    # every hang-up was aborted (an aborted request never also finishes: none ran to its end)
    assert eng["num_requests_aborted"] - before["num_requests_aborted"] == hung_up
    tokens = eng["num_generated_tokens"] - before["num_generated_tokens"]
    print(f"\nload: {N_REQUESTS} streams over {N_ADAPTERS} adapters in {elapsed:.1f}s, "
          f"{tokens} tokens generated ({tokens / elapsed:.0f} tok/s), {hung_up} clients hung up")

    with served.http() as c:
        assert c.get("/health").json()["status"] == "ok"
        ok = c.post("/v1/completions", json={"model": name_of(1), "prompt": prompt_of(1), "max_tokens": MAX_TOKENS,
                                             "temperature": 0, "ignore_eos": True}).json()
        assert ok["choices"][0]["text"] == expected_texts[1]


def test_a_client_that_hangs_up_before_a_whole_answer_is_aborted(served):
    """Not streaming: the answer would come at the end, but the hang-up aborts it at once."""
    import socket

    before = served.stats()["engine"]
    body = json.dumps({"model": "base", "prompt": "hi", "max_tokens": 400, "ignore_eos": True}).encode()
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(served.socket))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        served.wait_running()
    stats = served.wait_idle()
    assert stats["engine"]["num_requests_aborted"] == before["num_requests_aborted"] + 1
    assert stats["engine"]["num_generated_tokens"] - before["num_generated_tokens"] < 400
    assert stats["engine"]["pool"]["kv_pages"] == 0
