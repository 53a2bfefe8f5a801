"""`lorafleet stop` signals only a process proven to be its socket's daemon (`cli/ours.py`): the
pid file beside the socket locked, by that pid, which runs `lorafleet serve` as this user and is
the pid the socket reports. A stale pid file, a foreign server's answer, a pid file naming another
program or another daemon, pid 0, 1 or -1: each is refused with one line and exit 1, and nothing
is signalled (signals are recorded, not sent, in those tests, so a regression cannot reach the
machine's processes)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import time

import pytest
from typer.testing import CliRunner

from lorafleet.cli import ours
from lorafleet.cli.main import app
from lorafleet.paths import pidfile_path
from tests.cli.test_odd_daemons import OddServer, http
from tests.daemons import Daemon

runner = CliRunner()


@pytest.fixture
def sent(monkeypatch) -> list:
    """The signals `stop` sends, recorded instead of sent (os.kill's probe, signal 0, still runs)."""
    calls = []
    real_kill = os.kill

    def kill(pid, sig):
        if sig == 0:
            return real_kill(pid, sig)
        calls.append(("kill", pid, sig))

    monkeypatch.setattr(ours.os, "kill", kill)
    monkeypatch.setattr(ours.signal, "pidfd_send_signal", lambda fd, sig, *a: calls.append(("pidfd", fd, sig)))
    return calls


@pytest.fixture
def sleeper():
    """A process that is not a lorafleet daemon; it must outlive every refusal."""
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def sock(tmp_path):
    path = tmp_path / "run" / "a.sock"
    path.parent.mkdir(mode=0o700)
    return path


def foreign(sock, pid) -> OddServer:
    """A server that answers like a daemon's /v1/stats (version, engine, server) and names `pid`."""
    server = {} if pid is None else {"pid": pid}
    body = json.dumps({"version": "9.9", "engine": {}, "server": server}).encode()
    return OddServer(sock, http(200, "application/json", body))


def stop(sock):
    return runner.invoke(app, ["stop", "--socket", str(sock), "--timeout", "60"], catch_exceptions=False)


def refused(out, *words: str) -> None:
    assert out.exit_code == 1, out.output
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "nothing was signalled" in lines[0], out.stderr
    for w in words:
        assert w in lines[0], lines[0]
    assert "Traceback" not in out.output


@pytest.mark.parametrize("reported", ["sleeper", 0, -1, 1, "12", True, None])
def test_a_foreign_answer_without_a_pid_file_is_refused(sock, sleeper, sent, reported):
    reported = sleeper.pid if reported == "sleeper" else reported
    server = foreign(sock, reported)
    try:
        out = stop(sock)
    finally:
        server.close()
    refused(out, "no lorafleet daemon claims", str(pidfile_path(sock)))
    assert sent == [] and sleeper.poll() is None


def test_a_stale_pid_file_naming_another_program_is_refused(sock, sleeper, sent):
    pidfile_path(sock).write_text(f"{sleeper.pid}\n")
    server = foreign(sock, sleeper.pid)
    try:
        out = stop(sock)
    finally:
        server.close()
    refused(out, f"pid {sleeper.pid}", "no process holds the pid file's lock")
    assert sent == [] and sleeper.poll() is None


def test_a_pid_file_locked_by_another_process_than_it_names_is_refused(sock, sleeper, sent):
    pidfile_path(sock).write_text(f"{sleeper.pid}\n")
    server = foreign(sock, sleeper.pid)
    try:
        with open(pidfile_path(sock)) as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # this test holds the lock, not the pid the file names
            out = stop(sock)
    finally:
        server.close()
    refused(out, f"pid {sleeper.pid}")
    assert f"held by pid {os.getpid()}" in out.stderr or "is not `lorafleet serve`" in out.stderr
    assert sent == [] and sleeper.poll() is None


@pytest.mark.parametrize("content", ["0\n", "-1\n", "1\n", "  7\n", "abc\n"])
def test_pid_0_1_and_minus_1_or_no_pid_are_never_signalled(sock, sent, content):
    pidfile_path(sock).write_text(content)
    reported = int(content) if content.strip().lstrip("-").isdigit() else content
    server = foreign(sock, reported)
    try:
        with open(pidfile_path(sock)) as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            out = stop(sock)
    finally:
        server.close()
    refused(out)
    assert "not a lorafleet pid file" in out.stderr or "never signals pid 0 or 1" in out.stderr
    assert sent == []


def test_a_stale_pid_file_naming_another_daemon_leaves_that_daemon_alone(served, sock, sent):
    """Socket A's pid file was left by a dead daemon; its pid is now daemon B's. Nothing answers on
    A, and B holds not A's pid file's lock: no daemon runs on A, and B is not signalled."""
    pidfile_path(sock).write_text(f"{served.proc.pid}\n")
    out = stop(sock)
    assert out.exit_code == 3 and out.stderr.startswith("error: no lorafleet daemon is running on"), out.output
    assert sent == [] and served.proc.poll() is None
    with pytest.raises(ours.NotOurDaemonError, match="no process holds the pid file's lock"):
        ours.proven_daemon(sock, answered=False)
    assert served.stats()["server"]["pid"] == served.proc.pid


def test_a_daemon_answering_with_another_pid_than_its_pid_file_is_refused(served, sent):
    """The socket's own daemon, but a pid file naming someone else (here: this test process)."""
    pidfile = pidfile_path(served.socket)
    kept = pidfile.read_bytes()
    pidfile.write_text(f"{os.getpid()}\n")  # the daemon's lock is on this same file: still held
    try:
        out = stop(served.socket)
    finally:
        pidfile.write_bytes(kept)
    refused(out, f"reports pid {served.proc.pid}")
    assert sent == [] and served.proc.poll() is None


def test_stop_signals_its_own_daemon_once_proven(chat_model_dir, tmp_path):
    daemon = Daemon.start(tmp_path, model=chat_model_dir)
    try:
        proven = ours.proven_daemon(daemon.socket, answered=True, reported=daemon.proc.pid)
        with proven:
            assert proven.pid == daemon.proc.pid and not proven.exited()
        out = stop(daemon.socket)
        assert out.exit_code == 0, out.output
        assert f"stopped the lorafleet daemon (pid {daemon.proc.pid})" in out.stderr
        assert daemon.wait(60) == 0 and not daemon.socket.exists()
    finally:
        daemon.kill()


def test_stop_signals_a_daemon_still_starting(tmp_path):
    """The demo fleet's daemon, stopped as soon as its pid file names it (it may still be loading
    its model, or answer already: either way it is proven and stopped)."""
    daemon = Daemon.start(tmp_path, wait=False)
    pidfile = pidfile_path(daemon.socket)
    try:
        deadline = time.monotonic() + 120
        while not (pidfile.exists() and pidfile.read_text().endswith("\n")):  # claimed: its pid written
            assert daemon.proc.poll() is None and time.monotonic() < deadline, daemon.log()
            time.sleep(0.01)
        out = stop(daemon.socket)
        assert out.exit_code == 0, out.output
        assert daemon.wait(60) == 0 and not pidfile.exists()
    finally:
        daemon.kill()


def test_is_daemon_command():
    assert ours.is_daemon_command([b"/usr/bin/python3", b"-m", b"lorafleet.cli.main", b"serve", b"--socket", b"x", b""])
    assert ours.is_daemon_command([b"/venv/bin/python", b"/venv/bin/lorafleet", b"serve", b""])
    assert not ours.is_daemon_command([b"/venv/bin/python", b"/venv/bin/lorafleet", b"chat", b"serve", b""])
    assert not ours.is_daemon_command([b"sleep", b"600", b""])
    assert not ours.is_daemon_command([b"python", b"-c", b"pass", b"lorafleet-serve", b""])

