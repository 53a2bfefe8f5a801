"""Chat templates rendered in processes of their own, for the daemon's render pool
(`server/renders.py`). A template is foreign code: in a process, a template that loops holds
neither the daemon's interpreter lock nor, once it is slow, any core another thread wants.

Two kinds of process:
- the zygote (`zygote()`, started once with the control socket as its stdin, at a lowered
  priority): jinja2 imported, it forks a render process per "f" and hands back its pid and one end
  of a socket pair (SCM_RIGHTS), in a few milliseconds; it kills one of its own children on
  "k" + pid (a child not yet reaped, so the pid is surely that child's). It exits when the daemon
  closes the control socket.
- a render process (`serve()`): a request is a 4-byte little-endian length and a JSON object
  {"template", "variables", "max_chars", "timeout_s", "slow_s"}; the answer is one status byte
  (OK, REFUSED, FAILED), a 4-byte length and UTF-8 text: the prompt, or the message naming why
  there is none. A render whose CPU time passes `slow_s` first sends SLOW and moves itself to
  SCHED_IDLE (it then runs only on a core nothing else wants, and yields it the moment another
  thread wakes); one whose CPU time passes `timeout_s` is stopped (`chat_template.CpuDeadline`).
  It exits at the end of its input.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import threading
from collections import OrderedDict

from lorafleet.errors import InvalidRequestError
from lorafleet.model.chat_template import CpuDeadline, RenderBoundError, compile_template, render_bounded

OK, REFUSED, FAILED, SLOW = b"o", b"r", b"f", b"s"
FORK, KILL = b"f", b"k"
HEADER = struct.Struct("<I")
PID = struct.Struct("<q")
COMMAND = 1 + PID.size  # FORK or KILL, then a pid (0 for FORK)
MAX_REQUEST_BYTES = 64 << 20  # the daemon's bodies are capped far below; anything larger is not ours
TEMPLATES_KEPT = 16           # compiled templates cached: the base's and a few adapters'


def _read(sock: socket.socket, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


class _Channel:
    """The render process's socket; SLOW, sent from the deadline's thread, and the answer never
    interleave, and SLOW never follows the answer."""

    def __init__(self, sock: socket.socket):
        self.sock, self._lock, self._answered = sock, threading.Lock(), False

    def slow(self) -> None:
        with self._lock:
            if self._answered:
                return
            for tid in (os.getpid(), threading.get_native_id()):  # the rendering thread (its tid is the pid), this one
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            self.sock.sendall(SLOW)

    def answer(self, status: bytes, text: str) -> None:
        out = text.encode("utf-8", "surrogatepass")
        with self._lock:
            self._answered = True
            self.sock.sendall(status + HEADER.pack(len(out)) + out)

    def next_request(self) -> dict | None:
        self._answered = False
        if (header := _read(self.sock, HEADER.size)) is None:
            return None
        (size,) = HEADER.unpack(header)
        if size > MAX_REQUEST_BYTES or (raw := _read(self.sock, size)) is None:
            return None
        return json.loads(raw)


def render(request: dict, compiled: OrderedDict, channel: _Channel) -> tuple[bytes, str]:
    """(status, text) for one request; `compiled` caches templates by their source."""
    source = request["template"]
    try:
        template = compiled.pop(source, None) or compile_template(source, "the chat template")
    except Exception as e:  # ModelLoadError: a template that does not compile fails its requests
        return FAILED, str(e)
    compiled[source] = template
    while len(compiled) > TEMPLATES_KEPT:
        compiled.popitem(last=False)
    deadline = CpuDeadline(request["timeout_s"], request["slow_s"], channel.slow)
    try:
        return OK, render_bounded(template, request["variables"], request["max_chars"], deadline=deadline)
    except (InvalidRequestError, RenderBoundError) as e:
        return REFUSED, str(e)
    except Exception as e:  # the template is foreign code: any failure means "these messages don't fit"
        return FAILED, f"chat template failed on these messages: {type(e).__name__}: {e}"


def serve(sock: socket.socket) -> None:
    compiled: OrderedDict
    channel, compiled = _Channel(sock), OrderedDict()
    while (request := channel.next_request()) is not None:
        channel.answer(*render(request, compiled, channel))


def zygote() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on `serve` drains the daemon, renders included
    control = socket.socket(fileno=os.dup(0))
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    children: set[int] = set()
    while (command := _read(control, COMMAND)) is not None:
        while children:  # reap the ended: a pid leaves `children` only once reaped
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
        if command[:1] == KILL:
            if (pid := PID.unpack(command[1:])[0]) in children:
                os.kill(pid, signal.SIGKILL)
        elif command[:1] == FORK:
            ours, theirs = socket.socketpair()
            pid = os.fork()
            if pid == 0:
                control.close()
                ours.close()
                try:
                    serve(theirs)
                finally:
                    os._exit(0)
            theirs.close()
            children.add(pid)
            socket.send_fds(control, [PID.pack(pid)], [ours.fileno()])
            ours.close()
