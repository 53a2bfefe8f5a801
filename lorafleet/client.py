"""A typed client for the daemon: httpx over the Unix socket, or over TCP with an API key (a
daemon started with `serve --host H --port P --api-key KEY`), one method per endpoint.

The CLI and the TUI talk to the daemon only through this. It never imports torch or the engine.
Errors come back as LorafleetErrors: `DaemonUnreachableError` (exit code 3) when nothing answers
at the socket or URL, when what answers is not a lorafleet daemon (not JSON, not its stats), or
when it stays silent past the timeout; `ServerError` carrying the daemon's status, code and
message otherwise.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import httpx

from lorafleet import paths
from lorafleet.errors import ConfigError, DaemonStartingError, DaemonUnreachableError, ServerError
from lorafleet.snapshot import Stats

# generation may take as long as it takes; everything else answers within a step or two
_GENERATE_TIMEOUT = httpx.Timeout(10.0, read=None)
_DEFAULT_TIMEOUT = httpx.Timeout(10.0, read=60.0)
_STATS_TIMEOUT = httpx.Timeout(10.0)  # a snapshot is taken between two steps: a silent daemon is not one
# nothing listens there, the daemon went away mid-answer, or no route to it
_UNREACHABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ConnectTimeout)


class Client:
    """`Client(socket)` talks over the Unix socket (default: `paths.socket_path()`);
    `Client(url=..., api_key=...)` over TCP, sending the key as `Authorization: Bearer KEY`.
    `where` names the one it talks to, for messages."""

    def __init__(self, socket: str | os.PathLike | None = None, url: str | None = None,
                 api_key: str | None = None):
        if url:
            parsed = httpx.URL(url)
            if parsed.scheme not in ("http", "https") or not parsed.host:
                raise ConfigError(f"--url must be an http:// or https:// URL with a host, not {url!r}")
            self.socket, self.where, transport, base_url = None, url, None, url.rstrip("/")
        else:
            self.socket = paths.socket_path(socket)
            self.where, base_url = str(self.socket), "http://lorafleet"
            transport = httpx.HTTPTransport(uds=str(self.socket))
        self._http = httpx.Client(transport=transport, base_url=base_url, timeout=_DEFAULT_TIMEOUT,
                                  headers={"Authorization": f"Bearer {api_key}"} if api_key else {})

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- plumbing ----------------------------------------------------------------------------
    def unreachable(self) -> DaemonUnreachableError:
        if self.socket is not None and (pid := paths.starting_daemon(self.socket)) is not None:
            return DaemonStartingError(
                f"the lorafleet daemon on {self.socket} (pid {pid}) is still starting: it loads its model, "
                "and on a machine's first start builds the CPU kernels (a minute or two); "
                "`lorafleet logs -f` shows where it is", pid)
        if self.socket is None:
            return DaemonUnreachableError(f"no lorafleet daemon answers at {self.where}; start one with "
                                          "`lorafleet serve --host H --port P --api-key KEY`")
        # the socket this command was given is the one a new daemon must take
        elsewhere = f" --socket {shlex.quote(str(self.socket))}" if self.socket != paths.socket_path() else ""
        return DaemonUnreachableError(f"no lorafleet daemon is running on {self.socket}; "
                                      f"start one with `lorafleet serve{elsewhere}`")

    def not_lorafleet(self, why: str) -> DaemonUnreachableError:
        return DaemonUnreachableError(f"what answers at {self.where} is not a lorafleet daemon ({why})")

    def _request(self, method: str, path: str, body: dict | None = None, timeout=None) -> httpx.Response:
        timeout = timeout or _DEFAULT_TIMEOUT
        try:
            r = self._http.request(method, path, json=body, timeout=timeout)
        except _UNREACHABLE as e:
            raise self.unreachable() from e
        except httpx.TimeoutException as e:
            raise self.not_lorafleet(f"no answer to {path} within {timeout.read:g}s") from e
        if r.status_code >= 400:
            raise _server_error(r.status_code, r.content)
        return r

    def _json(self, method: str, path: str, body: dict | None = None, timeout=None) -> Any:
        r = self._request(method, path, body, timeout)
        try:
            return r.json()
        except ValueError:  # HTML, or anything else: not ours
            raise self.not_lorafleet(f"its answer to {path} is not JSON") from None

    def _stream(self, path: str, body: dict) -> Iterator[dict]:
        try:
            with self._http.stream("POST", path, json={**body, "stream": True}, timeout=_GENERATE_TIMEOUT) as r:
                if r.status_code >= 400:
                    raise _server_error(r.status_code, r.read())
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise _server_error(500, json.dumps(event).encode())
                    yield event
        except _UNREACHABLE as e:
            raise self.unreachable() from e

    # -- endpoints ---------------------------------------------------------------------------
    def health(self) -> dict:
        return self._json("GET", "/health")

    def wait_started(self, timeout: float, waiting: Callable[[DaemonStartingError], None] = lambda e: None,
                     poll: float = 0.1) -> None:
        """Return once the daemon answers; while it is starting (`DaemonStartingError`) call
        `waiting` once and poll, up to `timeout` seconds. Any other failure (no daemon at all, or one
        that died while starting) raises at once; still starting at the deadline raises that."""
        deadline, told = time.monotonic() + timeout, False
        while True:
            try:
                self.health()
                return
            except DaemonStartingError as e:
                if time.monotonic() >= deadline:
                    raise
                if not told:
                    waiting(e)
                    told = True
            time.sleep(poll)

    def stats(self) -> Stats:
        """The daemon's /v1/stats; refused as not a lorafleet daemon's unless it has its parts."""
        stats = self._json("GET", "/v1/stats", timeout=_STATS_TIMEOUT)
        if not (isinstance(stats, dict) and isinstance(stats.get("version"), str)
                and isinstance(stats.get("engine"), dict) and isinstance(stats.get("server"), dict)):
            raise self.not_lorafleet("its /v1/stats has no version, engine and server")
        return cast(Stats, stats)  # its parts' shapes are the daemon's word: each front end checks what it reads

    def metrics(self) -> str:
        return self._request("GET", "/metrics").text

    def reset_prefix_cache(self) -> dict:
        return self._json("POST", "/reset_prefix_cache")

    def models(self) -> list[dict]:
        return self._json("GET", "/v1/models")["data"]

    def model(self, name: str) -> dict:
        return self._json("GET", f"/v1/models/{name}")

    def load_adapter(self, name: str, path: str | os.PathLike, lazy: bool = False) -> dict:
        """Load the PEFT adapter folder `path` (resolved here: the daemon's cwd is not ours)."""
        body: dict[str, Any] = {"lora_name": name, "lora_path": str(Path(path).expanduser().resolve())}
        if lazy:
            body["lazy"] = True
        return self._json("POST", "/v1/load_lora_adapter", body, timeout=httpx.Timeout(10.0, read=None))

    def unload_adapter(self, name: str) -> dict:
        return self._json("POST", "/v1/unload_lora_adapter", {"lora_name": name})

    def completion(self, prompt: str | list[int], model: str | None = None, **params) -> dict:
        return self._json("POST", "/v1/completions", _body(model, prompt=prompt, **params), _GENERATE_TIMEOUT)

    def completion_stream(self, prompt: str | list[int], model: str | None = None, **params) -> Iterator[dict]:
        return self._stream("/v1/completions", _body(model, prompt=prompt, **params))

    def chat(self, messages: list[dict], model: str | None = None, **params) -> dict:
        return self._json("POST", "/v1/chat/completions", _body(model, messages=messages, **params),
                          _GENERATE_TIMEOUT)

    def chat_stream(self, messages: list[dict], model: str | None = None, **params) -> Iterator[dict]:
        """The chunks of a streamed chat completion (close the iterator to cancel it)."""
        return self._stream("/v1/chat/completions", _body(model, messages=messages, **params))


def _body(model: str | None, **fields) -> dict:
    body = {k: v for k, v in fields.items() if v is not None}
    if model is not None:
        body["model"] = model
    return body


def _server_error(status: int, content: bytes) -> ServerError:
    try:
        err = json.loads(content)["error"]
        return ServerError(err["message"], status, err.get("code") or "error", err.get("param"))
    except (ValueError, KeyError, TypeError):
        return ServerError(f"the daemon answered {status}: {content[:200].decode(errors='replace')}", status)
