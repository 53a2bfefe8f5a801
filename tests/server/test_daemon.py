"""The daemon's life: `serve` with no MODEL (the bundled demo fleet), a stale socket cleared, an owner-only
socket, one daemon per socket, the queue limit, the API key on TCP, and SIGTERM draining
in-flight requests before exiting 0."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import threading

import httpx
import pytest

from tests.daemons import Daemon, free_port


@pytest.fixture(scope="module")
def demo_daemon(tmp_path_factory):
    """`lorafleet serve` without MODEL, on a socket path where a dead daemon left its socket,
    with a small queue limit and a TCP listener."""
    root = tmp_path_factory.mktemp("p")
    (root / "run").mkdir(mode=0o755)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(root / "run" / "d.sock"))
    stale.close()  # bound, never listening, never unlinked: what a killed daemon leaves
    port = free_port()
    daemon = Daemon.start(root, "--max-pending", "3", "--host", "127.0.0.1", "--port", str(port),
                          env={"LORAFLEET_API_KEY": "sekrit"})
    daemon.port = port
    yield daemon
    daemon.kill()


def test_serve_without_a_model_serves_the_demo_fleet(demo_daemon):
    from lorafleet.demo import BASE_DIR, SKILLS

    d = demo_daemon
    stats = d.stats()
    assert stats["server"]["model"] == "demo" and stats["server"]["model_path"] == str(BASE_DIR)
    # the demo base's generation_config.json says greedy: requests naming no temperature get it
    assert stats["server"]["sampling_defaults"] == {"temperature": 0.0}
    with d.http() as c:
        models = {m["id"] for m in c.get("/v1/models").json()["data"]}
        assert models == {"demo", *SKILLS}
        out = c.post("/v1/chat/completions", json={
            "model": "reverse", "messages": [{"role": "user", "content": "hello world"}]})
        base = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "echo: hi there"}]})
    assert out.status_code == 200 and out.json()["model"] == "reverse"
    assert out.json()["choices"][0]["message"]["content"] == "dlrow olleh"
    assert base.json()["choices"][0]["message"]["content"] == "hi there"


def test_the_daemon_serves_on_uvloop(demo_daemon):
    # uvloop is a dependency and uvicorn's Server.run picks it (a plain asyncio.run would not)
    assert "event loop: uvloop.Loop" in demo_daemon.log()


def test_a_stale_socket_is_replaced(demo_daemon):
    assert "removing stale socket" in demo_daemon.log()


def test_socket_and_pid_file_are_owner_only_and_the_directory_keeps_its_mode(demo_daemon):
    sock = demo_daemon.socket
    assert stat.S_ISSOCK(sock.stat().st_mode)
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o755  # made so by the fixture: not ours to change
    pidfile = sock.with_name(sock.name + ".pid")
    assert stat.S_IMODE(pidfile.stat().st_mode) == 0o600
    assert int(pidfile.read_text()) == demo_daemon.proc.pid


def test_a_second_serve_on_the_same_socket_refuses(demo_daemon):
    d = demo_daemon
    out = subprocess.run([sys.executable, "-m", "lorafleet.cli.main", "serve", "--socket", str(d.socket)],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "LORAFLEET_HOME": str(d.home), "COLUMNS": "200"})
    assert out.returncode == 1
    assert f"pid {d.proc.pid}" in out.stderr and "already serves" in out.stderr
    assert d.stats()["server"]["pid"] == d.proc.pid  # the first one is untouched


def test_tcp_needs_the_api_key_on_v1_routes(demo_daemon):
    base = f"http://127.0.0.1:{demo_daemon.port}"
    with httpx.Client(base_url=base, timeout=30) as c:
        assert c.get("/health").status_code == 200
        denied = c.get("/v1/models")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
    with demo_daemon.http() as c:  # the socket needs no key: its mode guards it
        assert c.get("/v1/models").status_code == 200


def test_tcp_without_an_api_key_refuses_to_start(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lorafleet.cli.main", "serve", "--socket", str(tmp_path / "s.sock"),
                          "--host", "127.0.0.1", "--port", "1"], capture_output=True, text=True, timeout=60,
                         env={**{k: v for k, v in os.environ.items() if k != "LORAFLEET_API_KEY"},
                              "LORAFLEET_HOME": str(tmp_path)})
    assert out.returncode == 1 and "API key" in out.stderr


def test_the_queue_limit_answers_429(demo_daemon):
    """--max-pending 3: a fourth concurrent request is refused, not queued."""
    results, start = [], threading.Barrier(6)

    def request():
        with demo_daemon.http() as c:
            start.wait()
            results.append(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 200, "ignore_eos": True}))
    threads = [threading.Thread(target=request) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert codes.count(200) >= 3 and 429 in codes, codes
    refused = next(r for r in results if r.status_code == 429).json()["error"]
    assert refused["code"] == "queue_full" and "--max-pending" in refused["message"]
    assert demo_daemon.wait_idle()["server"]["num_rejected"] >= 1


def signal_during_long_request(d, sig, max_tokens: int, timeout: float):
    """Send `sig` while a long completion is running; returns (its thread, [response or error])."""
    answers = []

    def long_request():
        try:
            with d.http(timeout=timeout) as c:
                answers.append(c.post("/v1/completions",
                                      json={"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True}))
        except httpx.HTTPError as e:
            answers.append(e)
    t = threading.Thread(target=long_request)
    t.start()
    d.wait_running()
    d.signal(sig)
    return t, answers


def test_sigterm_drains_in_flight_requests_then_exits_0(tmp_path, chat_model_dir):
    d = Daemon.start(tmp_path, "--drain-timeout", "60", model=chat_model_dir)
    t, answers = signal_during_long_request(d, signal.SIGTERM, 300, 120)
    assert d.wait(90) == 0
    t.join(30)
    assert answers and answers[0].status_code == 200
    assert answers[0].json()["usage"]["completion_tokens"] == 300  # finished, not cut
    assert not d.socket.exists() and not d.socket.with_name("d.sock.pid").exists()
    assert "draining 1 in-flight request" in d.log()


def test_sigint_past_the_drain_timeout_answers_503_and_still_exits_0(tmp_path, chat_model_dir):
    d = Daemon.start(tmp_path, "--drain-timeout", "0", model=chat_model_dir)
    t, answers = signal_during_long_request(d, signal.SIGINT, 500, 60)
    assert d.wait(60) == 0
    t.join(30)
    cut = answers[0]
    assert cut.status_code == 503 and cut.json()["error"]["code"] == "shutting_down"
    assert "drain timeout" in cut.json()["error"]["message"]
    assert not d.socket.exists()


def test_the_log_of_a_daemon_without_a_terminal_is_one_dated_line_per_event(served):
    """Written to a file (as `--detach` and the service do): every line an event with its date, time,
    level and logger, no rich columns wrapped over several lines."""
    import re

    lines = [line for line in served.log().splitlines() if line.strip()]
    event = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")
    assert any("serving" in line for line in lines)
    assert lines and all(event.match(line) for line in lines), [line for line in lines if not event.match(line)][:5]
