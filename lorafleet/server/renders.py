"""Chat templates render in processes of their own (`model/template_worker.py`), never on the
daemon's threads. A template is foreign code (a GGUF's metadata, an adapter's chat_template.jinja
loaded by any local client): rendered on a thread, a loop of Python held the interpreter's lock
beside the engine's thread and stalled every stream for as long as it ran. Now:

- render processes are forked by a zygote that has jinja2 imported (milliseconds, where starting
  Python takes 60 ms of CPU, and where the event loop's own subprocess support forks the whole
  daemon: tens of ms of page tables copied while every thread waits);
- a render that passes SLOW_CPU_S of CPU (real templates take about a millisecond) moves itself
  to SCHED_IDLE and says so: it then takes only cores nothing else wants, it frees its one of the
  RENDER_PROCS render slots, so chats behind it do not wait, and its process is retired after it
  (an unprivileged process cannot leave SCHED_IDLE);
- a render stops at RENDER_TIMEOUT_S of CPU time (a slow render given no CPU is not refused for
  waiting), and its process is killed past WALL_LIMIT_S or when its client hangs up;
- at most MAX_RENDERS renders run at once, slow ones included; more wait for a slot.

The pool belongs to the event loop that uses it (one per daemon). The zygote and the render
processes exit when their sockets close, so a daemon that dies leaves none behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import weakref

from lorafleet.errors import InvalidRequestError
from lorafleet.model import chat_template
from lorafleet.model.template_worker import COMMAND, FAILED, FORK, HEADER, KILL, OK, PID, REFUSED, SLOW
from lorafleet.server.protocol import Generation, bad

RENDER_PROCS = 4     # renders at normal scheduling at once
MAX_RENDERS = 16     # renders at once in all, slow ones (SCHED_IDLE) included
ZYGOTE_NICE = 10     # the zygote and its fresh render processes take a tenth of a core beside the engine
SLOW_CPU_S = 0.05    # CPU time past which a render is slow
WALL_LIMIT_S = 30.0  # a render not answered by then (given no CPU meanwhile) is refused
LARGE = 1 << 20      # bytes of prompt past which decoding leaves the loop


class _Zygote:
    """The process that forks render processes; restarted if it has died. Its calls block for a
    few milliseconds: they run on worker threads, one at a time."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._control: socket.socket | None = None

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        # Popen starts it by vfork. -P: the current directory is not searched, so a `lorafleet/`
        # folder there shadows nothing; the priority is lowered before the imports.
        self._proc = subprocess.Popen(
            [sys.executable, "-P", "-c", f"import os; os.nice({ZYGOTE_NICE}); "
             "from lorafleet.model.template_worker import zygote; zygote()"],
            stdin=theirs.fileno(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        theirs.close()
        self._control = ours

    def fork(self) -> tuple[int, socket.socket]:
        """A new render process: its pid and its socket."""
        with self._lock:
            for attempt in (0, 1):
                if self._proc is None or self._proc.poll() is not None:
                    self._start()
                assert self._control is not None  # started with the process
                try:
                    self._control.sendall(FORK + PID.pack(0))
                    raw, fds, _, _ = socket.recv_fds(self._control, PID.size, 1)
                    if len(raw) == PID.size and len(fds) == 1:
                        return PID.unpack(raw)[0], socket.socket(fileno=fds[0])
                except OSError:
                    pass
                self.close()
            raise InvalidRequestError("chat templates cannot be rendered: the render process did not start")

    def kill(self, pid: int) -> None:
        with self._lock, contextlib.suppress(OSError, AttributeError):
            if self._control is not None:  # else no process to kill in
                self._control.sendall(KILL + PID.pack(pid))

    def close(self) -> None:
        if self._control is not None:
            self._control.close()
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(1)  # it exits at the end of its input
        self._proc = self._control = None


assert len(FORK + PID.pack(0)) == COMMAND


class _Worker:
    def __init__(self, pid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.pid, self.reader, self.writer = pid, reader, writer

    async def ask(self, frame: bytes, on_slow) -> tuple[bytes, bytes]:
        self.writer.write(frame)
        await self.writer.drain()
        status = await self.reader.readexactly(1)
        if status == SLOW:
            on_slow()
            status = await self.reader.readexactly(1)
        (size,) = HEADER.unpack(await self.reader.readexactly(HEADER.size))
        return status, await self.reader.readexactly(size)


class RenderPool:
    def __init__(self):
        self._zygote = _Zygote()
        self._idle: list[_Worker] = []
        self._fast = asyncio.Semaphore(RENDER_PROCS)
        self._all = asyncio.Semaphore(MAX_RENDERS)
        self.slow = 0  # renders that went past SLOW_CPU_S

    async def _worker(self) -> _Worker:
        if self._idle:
            return self._idle.pop()
        pid, sock = await asyncio.to_thread(self._zygote.fork)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        return _Worker(pid, reader, writer)

    def _retire(self, worker: _Worker) -> None:
        worker.writer.close()
        asyncio.get_running_loop().run_in_executor(None, self._zygote.kill, worker.pid)

    async def render(self, template: str, variables: dict, max_chars: int | None) -> str:
        """The template's text for `variables`; InvalidRequestError naming the bound or the failure."""
        timeout_s = chat_template.RENDER_TIMEOUT_S
        request = {"template": template, "variables": variables, "max_chars": max_chars, "timeout_s": timeout_s,
                   "slow_s": SLOW_CPU_S}
        frame = await asyncio.to_thread(_frame, request)  # a chat may be megabytes of JSON
        async with self._all:
            await self._fast.acquire()
            fast, worker, done = True, None, False

            def slow() -> None:
                nonlocal fast
                fast = False
                self.slow += 1
                self._fast.release()
            try:
                worker = await self._worker()
                status, text = await asyncio.wait_for(worker.ask(frame, slow), WALL_LIMIT_S)
                done = True
            except TimeoutError:
                raise InvalidRequestError(f"the chat template did not render within {WALL_LIMIT_S:g} s") from None
            except (asyncio.IncompleteReadError, ConnectionError):
                raise InvalidRequestError("the chat template's render process ended without an answer") from None
            finally:
                if fast:
                    self._fast.release()
                if worker is not None:
                    if fast and done:
                        self._idle.append(worker)
                    else:  # slow (SCHED_IDLE for good), timed out, cancelled or broken
                        self._retire(worker)
        prompt = await asyncio.to_thread(_text, text) if len(text) > LARGE else _text(text)
        if status == OK:
            return prompt
        if status in (REFUSED, FAILED):
            raise InvalidRequestError(prompt)
        raise InvalidRequestError("the chat template's render process answered out of protocol")

    def close(self) -> None:
        while self._idle:
            self._idle.pop().writer.close()
        self._zygote.close()


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogatepass")  # as the render process encoded it


def _frame(request: dict) -> bytes:
    raw = json.dumps(request, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return HEADER.pack(len(raw)) + raw


_pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pool() -> RenderPool:
    """This event loop's pool."""
    loop = asyncio.get_running_loop()
    if loop not in _pools:
        _pools[loop] = RenderPool()
    return _pools[loop]


async def render_chat(gen: Generation, tokenizer, max_model_len: int) -> str:
    """`protocol.render_chat` in the pool: the chat's prompt text, bounded in time and in size by
    what the context can hold; a 400 on `messages` naming the bound or the template's failure."""
    if tokenizer is None:
        raise bad("messages", "the served model has no tokenizer; use /v1/completions with token ids")
    try:
        variables = tokenizer.chat_variables(gen.messages, add_generation_prompt=True, **gen.template_extra())
        return await pool().render(tokenizer.chat_template, variables, tokenizer.max_text_bytes(max_model_len))
    except InvalidRequestError as e:
        raise bad("messages", str(e)) from None
