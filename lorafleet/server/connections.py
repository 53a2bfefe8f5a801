"""What a connection may hold: uvicorn's HTTP protocol (httptools) with a header timeout and a cap
on TCP connections, so that idle or half-sent connections cannot take the daemon's file
descriptors from its other clients.

uvicorn closes a keep-alive connection idle after a response (`timeout_keep_alive`, our
`--idle-timeout`), but not one that never sends a whole request: a client that opens
connections and sends half their headers (slowloris) kept each one until they spent the
process's descriptors, after which even Unix-socket clients were reset. Here:
- every connection must complete a request's headers within `header_timeout` seconds of opening,
  or of the first byte of its next request on keep-alive; else it is closed;
- TCP connections beyond `max_tcp` are closed as they open (the Unix socket has no cap: its
  clients are this user's), and `raise_fd_limit` lifts the soft descriptor limit to the hard one
  at start, so the cap, not the limit, is what a flood meets.
"""

from __future__ import annotations

import logging
import resource
import socket
from typing import ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("lorafleet.server")


REFUSALS_LOGGED_EVERY_S = 10.0  # a flood is logged as a count, not a line a connection (every line costs CPU)


def guarded_protocol(header_timeout: float, max_tcp: int) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with these limits (a class of its own: its TCP count is shared
    by the connections of one daemon)."""
    tcp: set = set()
    refused = {"count": 0, "logged": 0.0}

    class Guarded(HttpToolsProtocol):
        tcp_connections: ClassVar[set]  # the open TCP connections (set below: the closure's)
        _header_timer = None
        _refused = False

        def connection_made(self, transport) -> None:  # type: ignore[override]
            sock = transport.get_extra_info("socket")
            is_tcp = sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6)
            if is_tcp and len(tcp) >= max_tcp:  # refused before uvicorn sets anything up: a flood costs little
                self._refused = True
                transport.abort()
                refused["count"] += 1
                now = self.loop.time()
                if now - refused["logged"] >= REFUSALS_LOGGED_EVERY_S:
                    log.warning("TCP connections refused: %d open (`serve --max-tcp-connections`); %d refused so far",
                                len(tcp), refused["count"])
                    refused["logged"] = now
                return
            super().connection_made(transport)
            if is_tcp:
                tcp.add(self)
            self._arm()

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                log.info("connection from %s closed: no complete request headers within %gs",
                         self.client, header_timeout)
                self.transport.abort()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            if self._refused:
                return
            self._disarm()
            tcp.discard(self)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

    Guarded.tcp_connections = tcp
    return Guarded


def raise_fd_limit() -> int:
    """The soft limit on open files raised to the hard one (the kernel's cap for this process);
    returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
        except (ValueError, OSError):
            pass
    return soft
