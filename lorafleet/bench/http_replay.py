"""The replay loop of the systems that serve over HTTP (`daemon_system.py`, `llamacpp.py`): every
request a streaming call of its own, sent at its arrival time, or, with a workload's
`concurrency`, as a closed loop: at most that many calls in flight, each of the others sent, in
order, as soon as one finishes (its arrival is then the moment it is sent).

A system gives `replay` one coroutine per request, `send(request, http, sent_at)`, which makes
the call and returns that request's figures (`figures` builds them from the stream's token
timestamps, the bench's own clock for every system); `stop_server` ends a system's server.
Imports only the standard library and httpx.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from typing import Awaitable, Callable

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


def figures(req: BenchRequest, sent_at: float, first: float | None, last: float | None, tokens: int,
            **extra) -> dict:
    """One request's figures: TTFT from its arrival (`sent_at`; `replay` gives `arrival_s`), TPOT
    between its first and last token."""
    return {"ttft_s": first - sent_at if first is not None else None,
            "tpot_s": (last - first) / (tokens - 1) if tokens > 1 and first is not None else None,
            "queue_s": None, "adapter_wait_s": None, "tokens": tokens, "adapter": req.adapter, **extra}


def stop_server(proc: subprocess.Popen, timeout: float) -> None:
    """Ask a system's server to stop (SIGTERM); kill it if it has not within `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)
