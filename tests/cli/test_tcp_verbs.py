"""The client verbs over TCP: `--url URL --api-key KEY` (and LORAFLEET_URL / LORAFLEET_API_KEY)
reach a daemon started with `serve --host --port --api-key`. Every verb runs as a subprocess whose
LORAFLEET_SOCKET names a path where nothing listens, so none can pass by the socket."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.daemons import Daemon, free_port

KEY = "tcp-verbs-key"
ADAPTER = "all-r8"
TIMEOUT = 120  # seconds any one CLI run may take (a shared CPU box: imports alone can be slow)


@pytest.fixture(scope="module")
def tcp_daemon(tmp_path_factory, chat_model_dir, adapter_dirs):
    """One daemon for the module, on its socket and on TCP with an API key, one adapter loaded."""
    port = free_port()
    daemon = Daemon.start(tmp_path_factory.mktemp("tcp"), "--host", "127.0.0.1", "--port", str(port),
                          "--api-key", KEY, model=chat_model_dir)
    daemon.url = f"http://127.0.0.1:{port}"
    try:
        daemon.load(ADAPTER, adapter_dirs[ADAPTER])
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture(scope="module")
def nowhere(tmp_path_factory):
    """A socket path nothing listens on, and a LORAFLEET_HOME of the tests' own."""
    root = tmp_path_factory.mktemp("client")
    (root / "home").mkdir()
    return root


def lf(nowhere, *args: str, env: dict | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("LORAFLEET_URL", "LORAFLEET_API_KEY")}
    base.update({"LORAFLEET_HOME": str(nowhere / "home"), "LORAFLEET_SOCKET": str(nowhere / "nobody.sock"),
                 "COLUMNS": "200"})
    return subprocess.run([sys.executable, "-m", "lorafleet.cli.main", *args], env={**base, **(env or {})},
                          input=input, capture_output=True, text=True, timeout=TIMEOUT)


def over_tcp(d) -> list[str]:
    return ["--url", d.url, "--api-key", KEY]


def test_the_socket_really_is_dead(tcp_daemon, nowhere):
    out = lf(nowhere, "status", "--json")
    assert out.returncode == 3 and "nobody.sock" in out.stderr


def test_status_over_tcp(tcp_daemon, nowhere):
    out = lf(nowhere, "status", *over_tcp(tcp_daemon), "--json")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["server"]["pid"] == tcp_daemon.proc.pid
    assert stats["server"]["tcp"]  # the daemon says it listens on TCP too
    text = lf(nowhere, "status", *over_tcp(tcp_daemon))
    assert text.returncode == 0, text.stderr
    assert f"pid {tcp_daemon.proc.pid}" in text.stdout


def test_status_over_tcp_through_the_environment(tcp_daemon, nowhere):
    out = lf(nowhere, "status", "--json", env={"LORAFLEET_URL": tcp_daemon.url, "LORAFLEET_API_KEY": KEY})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["server"]["pid"] == tcp_daemon.proc.pid


@pytest.mark.parametrize("key", [["--api-key", "wrong"], []], ids=["wrong-key", "no-key"])
@pytest.mark.parametrize("verb", [["status", "--json"], ["adapters", "ls", "--json"]], ids=["status", "adapters-ls"])
def test_a_wrong_or_missing_key_exits_1_naming_the_key(tcp_daemon, nowhere, verb, key):
    out = lf(nowhere, *verb, "--url", tcp_daemon.url, *key)
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "API key" in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == ""


def test_no_daemon_at_the_url_exits_3_naming_it(tcp_daemon, nowhere):
    url = f"http://127.0.0.1:{free_port()}"
    out = lf(nowhere, "status", "--url", url, "--api-key", KEY)
    assert out.returncode == 3, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and url in lines[0] and "no lorafleet daemon" in lines[0]


@pytest.mark.parametrize("verb", [["status"], ["adapters", "ls"], ["chat", "hi"], ["top"]])
def test_a_bad_url_is_one_clear_line(tcp_daemon, nowhere, verb):
    out = lf(nowhere, *verb, "--url", "ftp://x", "--api-key", KEY)
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), out.stderr
    assert "--url" in lines[0] and "ftp://x" in lines[0] and "http://" in lines[0]


def test_adapters_over_tcp(tcp_daemon, nowhere, adapter_dirs):
    listed = lf(nowhere, "adapters", "ls", *over_tcp(tcp_daemon), "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {a["name"]: a for a in json.loads(listed.stdout)}
    assert rows[ADAPTER]["loaded"] and not rows[ADAPTER]["in_store"]
    assert rows[ADAPTER]["path"] == str(adapter_dirs[ADAPTER])

    loaded = lf(nowhere, "adapters", "load", "tcp-made", str(adapter_dirs["attn-r3"]), *over_tcp(tcp_daemon), "--json")
    assert loaded.returncode == 0, loaded.stderr
    shown = lf(nowhere, "adapters", "show", "tcp-made", *over_tcp(tcp_daemon), "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["path"] == str(adapter_dirs["attn-r3"])
    unloaded = lf(nowhere, "adapters", "unload", "tcp-made", *over_tcp(tcp_daemon))
    assert unloaded.returncode == 0, unloaded.stderr
    names = [a["name"] for a in json.loads(lf(nowhere, "adapters", "ls", *over_tcp(tcp_daemon), "--json").stdout)]
    assert ADAPTER in names and "tcp-made" not in names


def test_chat_over_tcp(tcp_daemon, nowhere):
    from lorafleet.client import Client

    with Client(tcp_daemon.socket) as c:  # the same question through the socket, for the answer to expect
        want = c.chat([{"role": "user", "content": "hello over tcp"}], ADAPTER, max_tokens=4,
                      temperature=0)["choices"][0]["message"]["content"]
    streamed = lf(nowhere, "chat", *over_tcp(tcp_daemon), "--adapter", ADAPTER, "-n", "4", "-t", "0",
                  "hello over tcp", input="")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == want + "\n"
    piped = lf(nowhere, "chat", "--adapter", ADAPTER, "-n", "4", "-t", "0", "--json", input="hello over tcp",
               env={"LORAFLEET_URL": tcp_daemon.url, "LORAFLEET_API_KEY": KEY})
    assert piped.returncode == 0, piped.stderr
    answer = json.loads(piped.stdout)
    assert answer["model"] == ADAPTER and answer["choices"][0]["message"]["content"] == want


def test_top_over_tcp_shows_the_daemon(tcp_daemon):
    """`lorafleet top --url --api-key`'s app on the real client over TCP: the daemon's pid and
    its adapter on screen; with a wrong key, the key's refusal (and no data)."""
    import asyncio
    import time

    from lorafleet.client import Client
    from lorafleet.tui.app import TopApp

    pid = tcp_daemon.stats()["server"]["pid"]

    async def run(key: str) -> tuple[str, list[str]]:
        with Client(url=tcp_daemon.url, api_key=key) as c:
            app = TopApp(c.stats, c.where, interval=0.2)
            async with app.run_test(size=(100, 30)) as pilot:
                deadline = time.monotonic() + 30
                while app.stats is None and app.error is None:
                    assert time.monotonic() < deadline, "no snapshot and no error within 30s"
                    await pilot.pause(0.1)
                await pilot.pause()
                return (str(app.query_one("#status").render()), [r["name"] for r in app.rows], app.error,
                        str(app.query_one("#nodaemon").render()))

    status, rows, error, _ = asyncio.run(run(KEY))
    assert f"pid {pid}" in status and ADAPTER in rows and error is None
    status, rows, error, screen = asyncio.run(run("wrong"))
    assert rows == [] and "API key" in error and "refused" in status
    assert "refused" in screen and "No lorafleet daemon" not in screen
