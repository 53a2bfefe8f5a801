"""The daemon's HTTP routes served inside this process, without a socket: what each Ray Serve
replica runs (`deploy/ray.py`).

`InProcessServer` holds an Engine on its `EngineWorker` thread and the daemon's FastAPI app
(`server/app.py`: the same validation, tokenization, OpenAI bodies, SSE and error bodies as
`lorafleet serve`), and calls the app through ASGI directly: `request()` yields the response's
status and headers, then its body chunks as the app sends them, so a stream stays a stream
(httpx's ASGI transport would gather the whole body first). Closing the iterator early is a
client hanging up: the app sees `http.disconnect` and the engine aborts the request, freeing
its pages, as on the socket.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path

from lorafleet.config import ServerConfig
from lorafleet.model.config import generation_defaults
from lorafleet.server.app import create_app
from lorafleet.server.state import ServerState
from lorafleet.server.worker import EngineWorker

log = logging.getLogger("lorafleet.deploy")

FINISH_TIMEOUT_S = 10.0  # after a hang-up, how long the app may take to wind the request down


class InProcessServer:
    def __init__(self, engine, base_name: str, model_path: str | Path, resolver=None,
                 max_pending: int = 1024):
        self.worker = EngineWorker(engine, resolver=resolver)
        self.worker.start()
        config = ServerConfig(socket="(in-process)", served_model_name=base_name, max_pending=max_pending)
        self.state = ServerState(self.worker, config, base_name, str(model_path),
                                 sampling_defaults=generation_defaults(Path(model_path)))
        self.app = create_app(self.state)

    @property
    def engine(self):
        return self.worker.engine

    async def run(self, fn):
        """`fn(engine)` on the engine thread, between two steps."""
        return await asyncio.wrap_future(self.worker.call(fn))

    async def request(self, method: str, path: str, body: bytes = b"") -> AsyncIterator[dict | bytes]:
        """One HTTP request to the app: first {"status", "headers"}, then the body's chunks."""
        messages: asyncio.Queue = asyncio.Queue()
        hung_up = asyncio.Event()
        sent_body = False

        async def receive() -> dict:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await hung_up.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping) -> None:  # ASGI's message type
            messages.put_nowait(message)

        path, _, query = path.partition("?")
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
                 "root_path": "", "server": None, "client": None,
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", str(len(body)).encode())]}
        task = asyncio.create_task(self.app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    yield {"status": message["status"],
                           "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]]}
                elif message["type"] == "http.response.body" and message.get("body"):
                    yield message["body"]
            task.result()  # an exception out of the app is ours: raise it here
        finally:
            hung_up.set()
            if not task.done():
                try:
                    await asyncio.wait_for(task, FINISH_TIMEOUT_S)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    log.warning("a request did not wind down within %gs of its client hanging up", FINISH_TIMEOUT_S)
                except Exception:  # already answered with an error, or the stream was cut
                    pass

    async def call(self, method: str, path: str, body: bytes = b"") -> tuple[int, list, bytes]:
        """The whole response: (status, headers, body)."""
        head, chunks = None, []
        async for item in self.request(method, path, body):
            if isinstance(item, dict):
                head = item
            else:
                chunks.append(item)
        assert head is not None  # the app answered (else its exception was raised above)
        return head["status"], head["headers"], b"".join(chunks)

    def close(self) -> None:
        self.worker.stop()
        self.engine.close()
