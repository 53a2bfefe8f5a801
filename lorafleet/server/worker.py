"""EngineWorker: the one thread that owns the Engine, and the only way the server reaches it.

The Engine is not thread-safe. Everything crosses to its thread through one thread-safe command
queue: `call(fn)` runs `fn(engine)` between two steps and answers through a future; `submit`
adds a request and registers its `Sink`; `abort` drops one. Between steps the thread runs every
queued command, so a request aborted (say, by a client that hung up) is gone before the next
step and its pages are free. A step's outputs go back to their requests' asyncio queues in one
`loop.call_soon_threadsafe` hop for the whole step (not one per request).

An exception out of `engine.step()` is a bug of ours, not of a request: it is logged, every
in-flight request is answered with an error and aborted, and the thread keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable

from lorafleet.errors import LorafleetError, RequestNotFoundError, ShuttingDownError

if TYPE_CHECKING:
    from lorafleet.engine.api import EngineAPI

log = logging.getLogger("lorafleet.server")

_STOP = object()


class EngineFailure(LorafleetError):
    """The engine raised while stepping; the requests of that step are answered with this."""

    code = "engine_error"


class Sink:
    """Where one request's outputs go: an asyncio queue living on `loop`. The engine thread
    puts RequestOutputs (deltas, the whole answer in the final one) and, at worst, one exception;
    the request's handler awaits them."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any) -> None:
        deliver([(self, item)])


def deliver(batch: list[tuple[Sink, Any]]) -> None:
    """Hand (sink, item) pairs to their event loops: one cross-thread hop per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for sink, item in batch:
        by_loop.setdefault(sink.loop, []).append((sink.queue, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _put_all(items: list) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)


class EngineWorker:
    def __init__(self, engine: EngineAPI, idle_wait: float = 0.5, resolver=None):
        """`resolver` (a `store.resolver.StoreResolver`, or None): adapters named by requests are
        looked up in the store before the request is added."""
        self.engine = engine  # read only immutable things (tokenizer, max_model_len) off-thread
        self.resolver = resolver
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._idle_wait = idle_wait
        self._thread = threading.Thread(target=self._run, name="lorafleet-engine", daemon=True)
        self.steps_failed = 0

    # -- any thread ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn: Callable[[Any], Any]) -> Future:
        """Run `fn(engine)` on the engine thread between steps; its result or exception lands
        in the returned future."""
        future: Future = Future()
        self._commands.put((fn, future))
        return future

    def submit(self, prompt, params, adapter, request_id: str, sink: Sink, grammar=None) -> Future:
        """Queue a prepared request (`completions.prepare_request`: its stored adapters already
        registered, its prompt tokenized) whose outputs go to `sink`; `adapter`: a name, an
        `adapters.mix.Mix` or None; `grammar`: its structured output compiled. The future holds its id, or the engine's refusal
        (InvalidRequestError, AdapterNotFoundError...)."""

        def add(engine):
            rid = engine.add_request(prompt, params, adapter=adapter, request_id=request_id, grammar=grammar)
            self._sinks[rid] = sink
            return rid
        return self.call(add)

    def abort(self, request_id: str) -> None:
        """Drop a request before the next step; a request that already finished is left alone."""
        self._commands.put((lambda engine: self._abort(request_id), None))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is left, then end the thread."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            if not self._run_commands(block=not engine.has_unfinished()):
                break
            if engine.has_unfinished():
                self._step()
        gone = ShuttingDownError("the daemon stopped before this request finished")
        for rid in list(self._sinks):
            self._sinks[rid].put(gone)
            self._abort(rid)

    def _run_commands(self, block: bool) -> bool:
        """Run every queued command (waiting for one when `block`); False once told to stop."""
        try:
            item = self._commands.get(timeout=self._idle_wait) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is _STOP:
                return False
            fn, future = item
            if future is None:
                fn(self.engine)
            elif future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as e:  # noqa: BLE001 - the caller gets whatever it raised
                    future.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - a bug of ours must not take the daemon down
            self.steps_failed += 1
            log.exception("engine step failed; answering its %d request(s) with an error", len(self._sinks))
            failure = EngineFailure(f"the engine failed while generating: {type(e).__name__}: {e}")
            for rid in list(self._sinks):
                self._sinks[rid].put(failure)
                self._abort(rid)
            return
        batch = []
        for out in outputs:
            sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
            if sink is not None:
                batch.append((sink, out))
        deliver(batch)

    def _abort(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        try:
            self.engine.abort(request_id)
        except RequestNotFoundError:
            pass
        except Exception:  # noqa: BLE001
            log.exception("aborting %s failed", request_id)
