"""Chat-template renders run on a few threads of their own, never the default executor: a slow
template then delays other chats only, never the tokenization of plain prompts or the decoding
of bodies; and the threads are daemon threads, so shutdown never waits on one."""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

# Renders are bounded in time (`model/chat_template.py`), so a few threads serve any load; a
# hostile template can hold at most these for that long.
RENDER_THREADS = 4


class DaemonExecutor:
    """A fixed pool of daemon threads taking calls from one queue (started on first use)."""

    def __init__(self, threads: int, name: str):
        self._threads, self._name = threads, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False
        self._lock = threading.Lock()

    def _start(self) -> None:
        with self._lock:
            if self._started:
                return
            for i in range(self._threads):
                threading.Thread(target=self._run, name=f"{self._name}-{i}", daemon=True).start()
            self._started = True

    def _run(self) -> None:
        while True:
            future, fn, args = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the awaiting request
                future.set_exception(e)
            del future, fn, args

    def submit(self, fn: Callable, *args: Any) -> Future:
        self._start()
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future


RENDERS = DaemonExecutor(RENDER_THREADS, "lorafleet-render")


async def render(fn: Callable, *args: Any) -> Any:
    """`fn(*args)` on a render thread."""
    return await asyncio.wrap_future(RENDERS.submit(fn, *args))
