"""Real daemons for the server and CLI tests: `lorafleet serve` in a process of its own, on a
socket under a temporary directory, with LORAFLEET_HOME pointing at another.

Fixtures (registered in tests/conftest.py): `chat_model_dir` and `adapter_dirs` (a tiny chat
model and five PEFT adapters that differ in rank and targets), and `served`, one daemon for the
session on that model, with debug checks (pool integrity after every step) on.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

POOL = "64M"
ADAPTERS = ("attn-r3", "all-r8", "mlp-r24", "rslora-r16", "down-r1")


class Daemon:
    def __init__(self, proc: subprocess.Popen, socket: Path, home: Path, log_path: Path):
        self.proc, self.socket, self.home, self.log_path = proc, socket, home, log_path

    @classmethod
    def start(cls, root: Path, *args: str, model: Path | None = None, env: dict | None = None,
              wait: bool = True, timeout: float = 120.0) -> Daemon:
        """`lorafleet serve [model] --socket root/run/d.sock ...`; returns once /health answers."""
        home, sock, log_path = root / "home", root / "run" / "d.sock", root / "daemon.log"
        home.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "lorafleet.cli.main", "serve", *([str(model)] if model else []),
               "--socket", str(sock), "--device", "cpu", "--pool-bytes", POOL, *args]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "LORAFLEET_HOME": str(home), "COLUMNS": "200",
                                         **(env or {})})
        daemon = cls(proc, sock, home, log_path)
        if wait:
            daemon.wait_ready(timeout)
        return daemon

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with self.http() as c:
                    if c.get("/health").status_code == 200:
                        return
            except httpx.TransportError:
                pass
            time.sleep(0.05)  # a start ready between polls waits for the next: keep it short
        self.kill()
        raise RuntimeError(f"daemon did not answer within {timeout}s:\n{self.log()}")

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)), base_url="http://lorafleet",
                            timeout=kwargs.pop("timeout", 60.0), **kwargs)

    def async_http(self, **kwargs) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport(uds=str(self.socket), limits=kwargs.pop("limits", httpx.Limits()))
        return httpx.AsyncClient(transport=transport, base_url="http://lorafleet",
                                 timeout=kwargs.pop("timeout", 60.0), **kwargs)

    def openai(self):
        import openai

        return openai.OpenAI(base_url="http://lorafleet/v1", api_key="unused", max_retries=0,
                             http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket))))

    def stats(self) -> dict:
        with self.http() as c:
            return c.get("/v1/stats").raise_for_status().json()

    def load(self, name: str, path: Path) -> dict:
        with self.http() as c:
            return c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}).raise_for_status().json()

    def wait_stats(self, done, what: str, timeout: float = 60.0, interval: float = 0.02) -> dict:
        """Poll /v1/stats until `done(stats)` and return them; past `timeout`, fail the test saying
        what did not happen (a daemon that never gets there must fail a test, not hang it)."""
        deadline = time.monotonic() + timeout
        while not done(stats := self.stats()):
            if time.monotonic() > deadline:
                eng = stats["engine"]
                pytest.fail(f"{what}: not within {timeout:g}s (running {eng['num_running']}, waiting "
                            f"{eng['num_waiting']}, KV pages {eng['pool']['kv_pages']}, pending "
                            f"{stats['server']['pending']})")
            time.sleep(interval)
        return stats

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Stats once nothing runs, waits or holds a KV page."""
        def idle(stats):
            eng = stats["engine"]
            return not (eng["num_running"] or eng["num_waiting"] or eng["pool"]["kv_pages"] or stats["server"]["pending"])
        return self.wait_stats(idle, "the daemon going idle", timeout, interval=0.05)

    def wait_running(self, timeout: float = 60.0) -> dict:
        """Stats once a request runs (polled often: short requests run for well under a second)."""
        return self.wait_stats(lambda s: s["engine"]["num_running"] > 0, "a request running", timeout, interval=0.01)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, the drain waited for; killed if it outlives `timeout` (or the wait fails)."""
        self.signal(signal.SIGTERM)
        try:
            self.wait(timeout)
        finally:
            self.kill()


async def sse_events(http: httpx.AsyncClient, path: str, body: dict):
    """The events of one streamed request, parsed, as they arrive (200 and no error event asserted).
    Leaving the loop early closes the connection: the client has hung up."""
    async with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                yield event


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    from tests.fixtures import build_chat_model

    return build_chat_model(tmp_path_factory.mktemp("chat-model"))


@pytest.fixture(scope="session")
def adapter_dirs(chat_model_dir, tmp_path_factory):
    from tests.fixtures import ADAPTER_VARIANTS, build_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {name: build_adapter(chat_model_dir, root / name, seed=i + 1, **ADAPTER_VARIANTS[name])
            for i, name in enumerate(ADAPTERS)}


@contextlib.contextmanager
def chat_daemon(root: Path, chat_model_dir, adapter_dirs, *args: str):
    """A daemon on the chat model (served as "base", integrity checked after every step, `args`
    added to its command line), its adapters loaded under their names; stopped at the end."""
    daemon = Daemon.start(root, "--served-model-name", "base", *args, model=chat_model_dir,
                          env={"LORAFLEET_DEBUG_CHECKS": "1"})
    for name, path in adapter_dirs.items():
        daemon.load(name, path)
    try:
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture(scope="session")
def served(chat_model_dir, adapter_dirs, tmp_path_factory):
    """The session's daemon on the chat model, its five adapters loaded under their names."""
    with chat_daemon(tmp_path_factory.mktemp("d"), chat_model_dir, adapter_dirs) as daemon:
        yield daemon


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (for a daemon's --port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
