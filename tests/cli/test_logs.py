"""`lorafleet logs`: all of the log, its last N lines, following it (appends, rotation,
truncation, Ctrl-C), which file for which socket, and the one line when there is none. Decided
by what was printed and by events, never by how long anything took."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time

import pytest
from typer.testing import CliRunner

from lorafleet import paths
from lorafleet.cli import logs as logs_cli
from lorafleet.cli.main import app

runner = CliRunner()
LINES = b"".join(b"line %d [not markup]\n" % i for i in range(1, 8))


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A LORAFLEET_HOME of its own, and a default socket in it."""
    home = tmp_path / "home"
    monkeypatch.setenv("LORAFLEET_HOME", str(home))
    monkeypatch.setenv("LORAFLEET_SOCKET", str(tmp_path / "run" / "default.sock"))
    (home / "logs").mkdir(parents=True)
    return home


def logs(*args):
    return runner.invoke(app, ["logs", *args], catch_exceptions=False)


def test_prints_all_of_the_log_or_its_last_n_lines(home):
    (home / "logs" / "daemon.log").write_bytes(LINES)
    assert logs().stdout.encode() == LINES  # brackets printed as written, not eaten as markup
    assert logs("-n", "2").stdout.encode() == b"line 6 [not markup]\nline 7 [not markup]\n"
    assert logs("--tail", "100").stdout.encode() == LINES
    assert logs("-n", "0").stdout == ""


@pytest.mark.parametrize("n", [0, 1, 2, 5, 9])
def test_last_lines_reads_backwards_across_blocks(tmp_path, monkeypatch, n):
    monkeypatch.setattr(logs_cli, "BLOCK", 4)  # several blocks per line
    lines = [b"first\n", b"\n", b"a longer line\n", b"x\n", b"no newline at the end"]
    path = tmp_path / "f.log"
    path.write_bytes(b"".join(lines))
    with open(path, "rb") as f:
        assert logs_cli.last_lines(f, n) == b"".join(lines[-n:] if n else [])
        assert f.tell() == path.stat().st_size  # -f goes on from the end


def test_no_log_file_is_one_line_naming_where_it_looked(home):
    out = logs()
    assert out.exit_code == 1 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1
    assert str(home / "logs" / "daemon.log") in lines[0] and "lorafleet serve --detach" in lines[0]


def test_another_socket_has_a_log_of_its_own_and_the_link_beside_it_wins(home, tmp_path):
    other = tmp_path / "elsewhere" / "x.sock"
    own = paths.log_file(other)
    assert own.parent == home / "logs" and own.name.startswith("daemon-x-") and own != paths.log_file(paths.socket_path())
    assert paths.log_file(tmp_path / "another" / "x.sock") != own  # same name, other folder: another file
    (home / "logs" / "daemon.log").write_bytes(b"the default daemon\n")
    own.write_bytes(b"the daemon on x.sock\n")
    assert logs("--socket", str(other)).stdout == "the daemon on x.sock\n"
    assert logs().stdout == "the default daemon\n"

    chosen = tmp_path / "chosen.log"  # serve --detach --log-file chosen.log links it beside the socket
    chosen.write_bytes(b"the file --log-file named\n")
    other.parent.mkdir()
    paths.log_link(other).symlink_to(chosen)
    assert logs("--socket", str(other)).stdout == "the file --log-file named\n"


class Collected:
    """What the follower emitted, and a wait for some text to show up (an event, with a deadline
    that only turns a hang into a failure)."""

    def __init__(self):
        self.data = b""
        self.changed = threading.Condition()

    def emit(self, data: bytes) -> None:
        with self.changed:
            self.data += data
            self.changed.notify_all()

    def wait_for(self, text: bytes, timeout: float = 30.0) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: text in self.data, timeout), f"{text!r} never came; got {self.data!r}"


def test_follow_prints_appends_and_survives_rotation_and_truncation(tmp_path):
    path = tmp_path / "daemon.log"
    path.write_bytes(b"before\n")
    f = open(path, "rb")
    f.seek(0, os.SEEK_END)
    got, stop = Collected(), threading.Event()
    follower = threading.Thread(target=logs_cli.follow_file, args=(path, f, got.emit, stop, 0.005))
    follower.start()
    try:
        with open(path, "ab") as log:
            log.write(b"one\n")
        got.wait_for(b"one\n")

        path.rename(tmp_path / "daemon.log.1")  # rotated: the daemon still writes the old file a little
        with open(tmp_path / "daemon.log.1", "ab") as log:
            log.write(b"last of the old file\n")
        path.write_bytes(b"two\n")
        got.wait_for(b"two\n")

        path.write_bytes(b"x\n")  # truncated (shorter than what was read), then written
        got.wait_for(b"x\n")
    finally:
        stop.set()
        follower.join(30)
    assert not follower.is_alive()
    assert got.data == b"one\nlast of the old file\ntwo\nx\n"


def test_logs_f_follows_until_ctrl_c(tmp_path):
    path = tmp_path / "daemon.log"
    path.write_bytes(LINES)
    proc = subprocess.Popen([sys.executable, "-m", "lorafleet.cli.main", "logs", "-f", "-n", "1", "--log-file", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = b""

    def read_until(text: bytes, timeout: float = 60.0) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while text not in seen:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([proc.stdout], [], [], max(left, 0))
            assert ready and left > 0, f"{text!r} not printed; got {seen!r}"
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, f"logs -f ended; got {seen!r}, stderr {proc.stderr.read()!r}"
            seen += chunk
    try:
        read_until(b"line 7")
        with open(path, "ab") as log:
            log.write(b"appended while following\n")
        read_until(b"appended while following\n")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    assert seen == b"line 7 [not markup]\nappended while following\n"
    assert b"Traceback" not in proc.stderr.read()


def test_follow_raises_when_the_path_becomes_a_directory(tmp_path):
    path = tmp_path / "daemon.log"
    path.write_bytes(b"before\n")
    f = open(path, "rb")
    f.seek(0, os.SEEK_END)
    got, stop, failed = Collected(), threading.Event(), []

    def follow():
        try:
            logs_cli.follow_file(path, f, got.emit, stop, 0.005)
        except OSError as e:
            failed.append(e)
    follower = threading.Thread(target=follow)
    follower.start()
    try:
        with open(path, "ab") as log:
            log.write(b"one\n")
        got.wait_for(b"one\n")
        path.rename(tmp_path / "daemon.log.1")
        path.mkdir()
        follower.join(30)
    finally:
        stop.set()
        follower.join(30)
    assert not follower.is_alive() and f.closed
    assert len(failed) == 1 and "a directory" in str(failed[0])


def test_logs_f_says_in_one_line_when_the_log_becomes_a_directory(tmp_path):
    path = tmp_path / "daemon.log"
    path.write_bytes(LINES)
    proc = subprocess.Popen([sys.executable, "-m", "lorafleet.cli.main", "logs", "-f", "-n", "1", "--log-file", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)  # it printed the last line: it follows now
        assert ready and b"line 7" in os.read(proc.stdout.fileno(), 4096)
        path.rename(tmp_path / "daemon.log.1")
        path.mkdir()
        assert proc.wait(60) == 1
    finally:
        proc.kill()
    err = proc.stderr.read().decode()
    assert "Traceback" not in err and err.strip().splitlines() == [
        f"error: stopped following {path}: it is a directory now"]
