"""The CLI against what is not a lorafleet daemon, and with names and paths that look like markup:
`status` and `top` call a socket that answers HTML, foreign JSON or nothing at all unreachable, in
one line; `pull` on a full disk says so in one line; every verb prints names and paths as they are.
"""

from __future__ import annotations

import errno
import json
import socket
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lorafleet import client as client_mod
from lorafleet.cli.main import app
from lorafleet.errors import DaemonUnreachableError

runner = CliRunner()


class OddServer:
    """A Unix socket that answers every request with `answer` (raw bytes; None: accepts, reads,
    and says nothing until closed)."""

    def __init__(self, path: Path, answer: bytes | None):
        self.answer = answer
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            conn.recv(65536)
            if self.answer is not None:
                conn.sendall(self.answer)
                conn.close()

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def http(status: int, content_type: str, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status} OK\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


ODD = {
    "html": http(200, "text/html", b"<html><body>not here</body></html>"),
    "foreign JSON": http(200, "application/json", json.dumps({"status": "ok", "items": [1, 2]}).encode()),
    "silence": None,
}


@pytest.fixture
def odd(tmp_path, monkeypatch, request):
    monkeypatch.setattr(client_mod, "_STATS_TIMEOUT", client_mod.httpx.Timeout(0.5))
    sock = tmp_path / "odd.sock"
    server = OddServer(sock, ODD[request.param])
    yield sock
    server.close()


@pytest.mark.parametrize("odd", list(ODD), indirect=True)
def test_status_calls_a_socket_that_is_not_a_daemon_unreachable_in_one_line(odd):
    result = runner.invoke(app, ["status", "--socket", str(odd)])
    assert result.exit_code == 3, result.output
    assert "is not a lorafleet daemon" in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("odd", list(ODD), indirect=True)
def test_the_client_calls_what_is_not_a_daemon_unreachable(odd):
    with client_mod.Client(odd) as c, pytest.raises(DaemonUnreachableError, match="not a lorafleet daemon"):
        c.stats()


def test_status_of_a_stats_with_the_right_parts_but_not_a_daemons_is_one_line(tmp_path):
    sock = tmp_path / "odd.sock"
    body = json.dumps({"version": "9", "engine": {"x": 1}, "server": {"y": 2}}).encode()
    server = OddServer(sock, http(200, "application/json", body))
    try:
        result = runner.invoke(app, ["status", "--socket", str(sock)])
    finally:
        server.close()
    assert result.exit_code == 3 and "not a lorafleet daemon" in result.stderr and "Traceback" not in result.output


@pytest.mark.anyio
async def test_top_shows_a_foreign_snapshot_as_not_a_daemon_and_keeps_running():
    from lorafleet.tui.app import NOT_LORAFLEET, TopApp

    app = TopApp(None, "/tmp/test.sock")
    async with app.run_test(size=(80, 24)) as pilot:
        app.ingest({"version": "9", "engine": {"pool": {}}, "server": {"pid": 1}})
        await pilot.pause()
        assert app.is_running and app.stats is None
        assert app.error == NOT_LORAFLEET and app.unreachable


@pytest.fixture
def anyio_backend():
    return "asyncio"


def test_adapter_paths_and_names_print_literally_not_as_markup(tmp_path, monkeypatch):
    """A path with `[/b]` in it, as the daemon reports it: `adapters ls` and `adapters load` print
    it as it is and exit 0."""
    from lorafleet.cli import store as store_cli

    path = str(tmp_path / "mk[/b]x [bold]y")
    held = [{"id": "base"}, {"id": "up", "parent": "base",
                             "lorafleet": {"path": path, "ranks": {"q_proj": 4}, "modules": ["q_proj"],
                                           "tier": "device", "pages": 3, "users": 0}}]
    monkeypatch.setattr(store_cli, "adapters_in_store", lambda: {})
    monkeypatch.setattr(store_cli, "daemon_models", lambda *a: held)
    result = runner.invoke(app, ["adapters", "ls"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert path in result.stdout

    class Loaded:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def load_adapter(self, name, p, lazy=False):
            return {"adapter": {"path": path, "ranks": {"q_proj": 4}, "pages": 3}}
    monkeypatch.setattr(client_mod, "Client", Loaded)
    result = runner.invoke(app, ["adapters", "load", "up", str(tmp_path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert path in result.stderr


def test_pull_on_a_full_disk_is_one_line_naming_the_space(tmp_path, monkeypatch, llama_dir):
    from lorafleet.store import store as store_mod

    monkeypatch.setenv("LORAFLEET_HOME", str(tmp_path / "home"))

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "home" / "store" / "blobs" / "x"))
    monkeypatch.setattr(store_mod.Store, "install", full)
    result = runner.invoke(app, ["pull", str(llama_dir), "--base", "--name", "m"])
    assert result.exit_code == 1, result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in result.output
    assert "no space left" in line and "free" in line and "needs about" in line
