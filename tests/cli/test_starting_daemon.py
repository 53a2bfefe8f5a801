"""A daemon that claimed its socket (the pid file) but does not answer yet is "starting", not
absent: the client says so with its pid, `wait_started` waits for it, and one that dies while
starting is absent again at once."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from typer.testing import CliRunner

from lorafleet.cli.main import app
from lorafleet.client import Client
from lorafleet.errors import DaemonStartingError, DaemonUnreachableError
from lorafleet.paths import pidfile_path
from tests.daemons import Daemon


# A process that looks like a starting daemon: its command line is `lorafleet serve`'s, and it holds
# the flock of the pid file its last argument names ("-": none)
FAKE_SERVE = ("import fcntl, sys\nif sys.argv[-1] != '-': fcntl.flock(f := open(sys.argv[-1], 'rb'), fcntl.LOCK_EX)\n"
              "print('ready', flush=True)\nsys.stdin.read()")


def fake_serve(pidfile, locked: bool = True) -> subprocess.Popen:
    pidfile.write_bytes(b"")
    proc = subprocess.Popen([sys.executable, "-c", FAKE_SERVE, "-m", "lorafleet.cli.main", "serve",
                             str(pidfile) if locked else "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"
    pidfile.write_bytes(b"%d\n" % proc.pid)
    return proc


@pytest.fixture
def claimed(tmp_path):
    """A socket path whose pid file names a live process that looks like a starting daemon, and
    nothing listening."""
    sock = tmp_path / "run" / "d.sock"
    sock.parent.mkdir()
    proc = fake_serve(pidfile_path(sock))
    yield sock, proc
    proc.kill()
    proc.wait()


def test_a_claimed_socket_with_a_live_daemon_is_starting(claimed):
    sock, proc = claimed
    with Client(sock) as c, pytest.raises(DaemonStartingError) as e:
        c.health()
    assert e.value.pid == proc.pid and f"(pid {proc.pid}) is still starting" in str(e.value)
    assert e.value.exit_code == 3  # still "unreachable" to scripts that test the code


def test_a_pid_file_whose_lock_its_process_does_not_hold_is_no_daemon_starting(tmp_path):
    """A stale pid file naming a live process whose command line is `lorafleet serve` (its pid
    reused by another daemon, say): no daemon starting, as `status` says."""
    sock = tmp_path / "run" / "d.sock"
    sock.parent.mkdir()
    proc = fake_serve(pidfile_path(sock), locked=False)
    try:
        with Client(sock) as c, pytest.raises(DaemonUnreachableError) as e:
            c.health()
        assert not isinstance(e.value, DaemonStartingError)
        out = CliRunner().invoke(app, ["status", "--socket", str(sock)], catch_exceptions=False)
        assert out.exit_code == 3 and "no lorafleet daemon is running" in out.stderr, out.output
    finally:
        proc.kill()
        proc.wait()


def test_a_pid_file_of_another_program_or_a_dead_one_is_no_daemon(tmp_path, claimed):
    sock, proc = claimed
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        pidfile_path(sock).write_text(f"{other.pid}\n")  # alive, but not lorafleet
        with Client(sock) as c, pytest.raises(DaemonUnreachableError) as e:
            c.health()
        assert not isinstance(e.value, DaemonStartingError)
    finally:
        other.kill()
        other.wait()
    pidfile_path(sock).write_text(f"{other.pid}\n")  # dead
    with Client(sock) as c, pytest.raises(DaemonUnreachableError) as e:
        c.health()
    assert not isinstance(e.value, DaemonStartingError)


def test_waiting_for_a_daemon_that_dies_while_starting_ends_at_once(claimed):
    sock, proc = claimed
    told = []

    def waiting(e):
        told.append(e.pid)
        proc.kill()  # it dies while starting
        proc.wait()
    with Client(sock) as c, pytest.raises(DaemonUnreachableError) as e:
        c.wait_started(timeout=600, waiting=waiting, poll=0.01)
    assert told == [proc.pid] and not isinstance(e.value, DaemonStartingError)


def test_still_starting_at_the_deadline_raises_that(claimed):
    sock, _ = claimed
    with Client(sock) as c, pytest.raises(DaemonStartingError):
        c.wait_started(timeout=0, poll=0.01)


def test_waiting_for_a_real_start_returns_once_it_answers(tmp_path):
    daemon = Daemon.start(tmp_path, wait=False)
    try:
        deadline = time.monotonic() + 60
        while not pidfile_path(daemon.socket).exists():  # it claimed the socket: from here it is starting
            assert daemon.proc.poll() is None and time.monotonic() < deadline, daemon.log()
            time.sleep(0.01)
        with Client(daemon.socket) as c:
            c.wait_started(timeout=120, poll=0.05)
            assert c.health()
    finally:
        daemon.kill()
