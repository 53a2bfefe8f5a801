"""The pid file beside the socket: created exclusively, replaced only when a dead daemon left it
(its lock free, whatever process has its pid now), deleted on stop only if it is still ours.
Anything else there is refused and left as it was."""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import subprocess
import sys

import pytest

from lorafleet.errors import ConfigError, DaemonRunningError
from lorafleet.server.daemon import PidLock
from tests.daemons import Daemon


@pytest.fixture
def sock(tmp_path):
    return tmp_path / "d.sock"


@pytest.fixture
def pidfile(sock):
    return sock.with_name("d.sock.pid")


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)  # reaped: no process has this pid (until the kernel reuses it, far off)
    return proc.pid


def serve(sock, home) -> subprocess.CompletedProcess:
    """`lorafleet serve` on `sock`: refusals come before the model is built, so this is quick."""
    return subprocess.run([sys.executable, "-m", "lorafleet.cli.main", "serve", "--socket", str(sock)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LORAFLEET_HOME": str(home), "COLUMNS": "200"})


def test_a_new_pid_file_is_0600_and_holds_our_pid(sock, pidfile):
    lock = PidLock(pidfile).acquire(sock)
    try:
        assert pidfile.read_text() == f"{os.getpid()}\n"
        assert stat.S_IMODE(pidfile.stat().st_mode) == 0o600
    finally:
        lock.release()
    assert not pidfile.exists()


@pytest.mark.parametrize("content", ["my notes\n", "", "123", "0\n", "12\n34\n"])
def test_a_file_that_is_not_a_pid_file_is_refused_and_left_unchanged(sock, pidfile, content):
    pidfile.write_text(content)
    with pytest.raises(ConfigError, match="exists and is not a lorafleet pid file; remove it or choose another --socket"):
        PidLock(pidfile).acquire(sock)
    assert pidfile.read_text() == content


def test_a_symlink_is_refused_and_its_target_untouched(sock, pidfile, tmp_path):
    target = tmp_path / "precious"
    target.write_text(f"{dead_pid()}\n")
    pidfile.symlink_to(target)
    with pytest.raises(ConfigError, match="not a lorafleet pid file"):
        PidLock(pidfile).acquire(sock)
    assert pidfile.is_symlink() and target.read_text().endswith("\n")


def test_a_dead_daemons_pid_file_is_replaced(sock, pidfile):
    pidfile.write_text(f"{dead_pid()}\n")
    lock = PidLock(pidfile).acquire(sock)
    try:
        assert pidfile.read_text() == f"{os.getpid()}\n"
    finally:
        lock.release()


def test_a_reused_pid_without_the_lock_is_a_dead_daemons_file_and_replaced(sock, pidfile):
    """The daemon that wrote it died (the lock is free) and its pid went to another process: the
    lock decides, so the file is taken over, and that process is left alone."""
    other = subprocess.Popen(["sleep", "600"])
    try:
        pidfile.write_text(f"{other.pid}\n")
        lock = PidLock(pidfile).acquire(sock)
        try:
            assert pidfile.read_text() == f"{os.getpid()}\n"
        finally:
            lock.release()
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_a_locked_pid_file_means_a_daemon_runs(sock, pidfile):
    pidfile.write_text("4242\n")
    with open(pidfile) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(DaemonRunningError, match="pid 4242.*already serves"):
            PidLock(pidfile).acquire(sock)
    assert pidfile.read_text() == "4242\n"


def test_release_keeps_a_file_that_replaced_ours(sock, pidfile, tmp_path):
    lock = PidLock(pidfile).acquire(sock)
    other = tmp_path / "other"
    other.write_text("someone else's\n")
    other.replace(pidfile)
    lock.release()
    assert pidfile.read_text() == "someone else's\n"


def test_serve_refuses_a_foreign_pid_file_in_one_line_and_leaves_it(sock, pidfile, tmp_path):
    pidfile.write_text("not a pid\n")
    out = serve(sock, tmp_path)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: {pidfile} exists and is not a lorafleet pid file; remove it or choose another --socket")
    assert "Traceback" not in out.stderr
    assert pidfile.read_text() == "not a pid\n"


@pytest.mark.parametrize("left_by", ["a dead pid", "a pid reused by another process"])
def test_serve_replaces_a_stale_pid_file_and_removes_its_own_on_stop(tmp_path, chat_model_dir, left_by):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    pidfile = run / "d.sock.pid"
    other = subprocess.Popen(["sleep", "600"]) if left_by.endswith("process") else None
    pidfile.write_text(f"{other.pid if other else dead_pid()}\n")
    try:
        d = Daemon.start(tmp_path, model=chat_model_dir)
        try:
            assert pidfile.read_text() == f"{d.proc.pid}\n"
            assert "removing stale pid file" in d.log()
            d.signal(signal.SIGTERM)
            assert d.wait(60) == 0
        finally:
            d.kill()
        assert other is None or other.poll() is None  # the process that got the pid is left alone
    finally:
        if other:
            other.kill()
            other.wait()
    assert not pidfile.exists()
