"""The replay loop of the systems that serve over HTTP (`daemon_system.py`, `llamacpp.py`): every
request a streaming call of its own, sent at its arrival time, or, with a workload's
`concurrency`, as a closed loop: at most that many calls in flight, each of the others sent, in
order, as soon as one finishes (its arrival is then the moment it is sent).

A system gives `replay` one coroutine per request, `send(request, http, sent_at)`, which makes
the call (`events` reads its stream) and returns that request's figures (`figures` builds them
from the stream's token timestamps, the bench's own clock for every system); `stop_server` ends
a system's server.

The client is aiohttp (`session`), not httpx as elsewhere in lorafleet: the bench runs on the
same cores as the server it measures, and every millisecond of CPU its client spends is taken
from that server. Reading a stream with aiohttp's C parser measured far less CPU per token than
with httpx, and the daemon served more tokens/s under the aiohttp replay.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from typing import AsyncIterator, Awaitable, Callable

from lorafleet.bench.workloads import BenchRequest


async def replay(http, requests: list[BenchRequest], concurrency: int | None,
                 send: Callable[[BenchRequest, object, float], Awaitable[dict]]) -> tuple[float, list[dict]]:
    """Every request through `send`, in the workload's order; the seconds from the first send to
    the last answer, and the requests' figures in the order of `requests`."""
    start = time.perf_counter()
    gate = asyncio.Semaphore(concurrency) if concurrency is not None else None

    async def one(req: BenchRequest) -> dict:
        if gate is None:
            await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
            return {**await send(req, http, start + req.arrival_s), "arrival_s": req.arrival_s}
        async with gate:  # asyncio's semaphore wakes its waiters first come, first served
            sent_at = time.perf_counter()
            return {**await send(req, http, sent_at), "arrival_s": sent_at - start}

    metrics = await asyncio.gather(*(one(r) for r in requests))
    return time.perf_counter() - start, list(metrics)


def session(base_url: str, limit: int, uds: str | None = None, fresh_connections: bool = False,
            silence_s: float | None = None):
    """The replay's HTTP client: at most `limit` connections, over the Unix socket `uds` or TCP
    (`fresh_connections`: one connection per request, never one the server may have closed);
    a stream that says nothing for `silence_s` seconds fails (None: never)."""
    import aiohttp

    connector = (aiohttp.UnixConnector(path=uds, limit=limit) if uds is not None
                 else aiohttp.TCPConnector(limit=limit, force_close=fresh_connections))
    return aiohttp.ClientSession(base_url=base_url, connector=connector,
                                 timeout=aiohttp.ClientTimeout(total=None, sock_read=silence_s))


async def events(http, path: str, body: dict) -> AsyncIterator[dict]:
    """POST `body` as JSON to `path` and yield the answer's server-sent events, each `data:`
    line parsed as JSON, until `data: [DONE]` or the end of the stream; an HTTP error raises."""
    async with http.post(path, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:  # one line at a time
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                return
            yield json.loads(data)


def figures(req: BenchRequest, sent_at: float, first: float | None, last: float | None, tokens: int,
            **extra) -> dict:
    """One request's figures: TTFT from its arrival (`sent_at`; `replay` gives `arrival_s`), TPOT
    between its first and last token."""
    return {"ttft_s": first - sent_at if first is not None else None,
            "tpot_s": (last - first) / (tokens - 1) if tokens > 1 and first is not None and last is not None else None,
            "queue_s": None, "adapter_wait_s": None, "tokens": tokens, "adapter": req.label, **extra}


def stop_server(proc: subprocess.Popen, timeout: float) -> None:
    """Ask a system's server to stop (SIGTERM); kill it if it has not within `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)
