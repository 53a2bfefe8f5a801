"""`lorafleet logs [-f] [-n N]`: the log of a daemon started with `serve --detach` (or run as a
service), as `docker logs` prints a container's: all of it by default, `-n N` the last N lines,
`-f` then follows it.

Which file: `--log-file`, else the one `serve --detach` linked beside the socket (`SOCKET.log`,
which names a `--log-file` too), else the socket's default (`paths.log_file`). Following polls
the file's size and identity: a file renamed away or replaced (rotation) is reopened from its
start, one cut shorter (truncation) is read again from its new end's start.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, BinaryIO

import typer

from lorafleet import paths
from lorafleet.cli.common import JsonOption, SocketOption, fail

POLL_S = 0.2  # how often -f looks for new lines: often enough to read as live, rare enough to cost nothing
BLOCK = 1 << 16


def logs(
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing lines as the daemon writes them, "
                                                                "until Ctrl-C.")] = False,
    tail: Annotated[int | None, typer.Option(
        "--tail", "-n", min=0, metavar="N", help="Print only the last N lines (default: all).")] = None,
    socket: SocketOption = None,
    log_file: Annotated[Path | None, typer.Option(
        "--log-file", metavar="PATH", help="Read this file instead (what `serve --detach --log-file` wrote).")] = None,
    as_json: JsonOption = False,
) -> None:
    """Print the daemon's log: the file `lorafleet serve --detach` (or the service) writes. With
    --json, one JSON object a line: {"log": PATH, "line": TEXT}."""
    path = log_file or find_log(paths.socket_path(socket))
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise fail(f"no daemon log at {path}: `lorafleet serve --detach` (or `lorafleet service install`) writes "
                   "it; a daemon in the foreground logs to its terminal") from None
    except OSError as e:
        raise fail(f"cannot read {path}: {e.strerror}") from None
    out = sys.stdout.buffer
    if as_json:
        out = _JsonLines(out, str(path))
    with f:
        write(out, last_lines(f, tail) if tail is not None else f.read())
        if not follow:
            if isinstance(out, _JsonLines):
                out.write(b"\n") if out.held else None  # a last line without its newline is a line too
                out.flush()
            return
        try:
            follow_file(path, f, lambda data: write(out, data), threading.Event())
        except KeyboardInterrupt:  # Ctrl-C is how -f ends
            pass
        except OSError as e:  # the path became a folder, or a file we may not read
            raise fail(f"stopped following {path}: {e.strerror or e}") from None


class _JsonLines:
    """`write`'s output as JSON lines, {"log": PATH, "line": TEXT} each (a part line held back)."""

    def __init__(self, out: BinaryIO, path: str):
        self.out, self.path, self.held = out, path, b""

    def write(self, data: bytes) -> None:
        import json

        lines = (self.held + data).split(b"\n")
        self.held = lines.pop()
        for line in lines:
            self.out.write(json.dumps({"log": self.path, "line": line.decode(errors="replace")},
                                      ensure_ascii=False).encode() + b"\n")

    def flush(self) -> None:
        self.out.flush()


def find_log(sock: Path) -> Path:
    """The log of the daemon on `sock`: what the link beside it names, when it is our own link,
    else the socket's default log file."""
    link = paths.log_link(sock)
    try:
        if link.is_symlink() and link.lstat().st_uid == os.geteuid():
            return Path(os.readlink(link))
    except OSError:
        pass
    return paths.log_file(sock)


def write(out: BinaryIO, data: bytes) -> None:
    """The log's bytes as they are (no console in between: brackets and escapes stay as written)."""
    if data:
        out.write(data)
        out.flush()


def last_lines(f: BinaryIO, n: int) -> bytes:
    """The last `n` lines of `f` (a last line without a newline counts), read backwards in blocks
    from the end; leaves `f` at its end."""
    end = f.seek(0, os.SEEK_END)
    if n == 0:
        return b""
    pos, data = end, b""
    while pos > 0:
        step = min(BLOCK, pos)
        pos -= step
        f.seek(pos)
        data = f.read(step) + data
        # n lines need n newlines before them, plus the last line's own (or its lack)
        if data.count(b"\n", 0, len(data) - 1) >= n:
            break
    f.seek(end)
    lines = data.splitlines(keepends=True)
    return b"".join(lines[-n:])


def follow_file(path: Path, f: BinaryIO, emit: Callable[[bytes], None], stop: threading.Event,
                interval: float = POLL_S) -> None:
    """Emit what is appended to `path` from `f`'s position on, until `stop` is set. When the file
    at `path` is another one (rotated: renamed away, a new one created) the rest of the old one is
    read, then the new one from its start; when it is shorter than what was read (truncated), it
    is read again from its start. When `path` becomes something that is no log (a folder, a
    pipe) or a file it cannot open, raise OSError saying so."""
    try:
        while not stop.is_set():
            data = f.read()
            if data:
                emit(data)
                continue
            try:
                st = os.stat(path)
            except FileNotFoundError:  # between a rotation's rename and the new file: wait for it
                st = None
            if st is not None:
                mine = os.fstat(f.fileno())
                if (st.st_ino, st.st_dev) != (mine.st_ino, mine.st_dev):
                    emit(f.read())  # what the old file got after the last read
                    if not stat.S_ISREG(st.st_mode):  # opening a pipe would block; a folder fails
                        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
                        raise OSError(errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL,
                                      f"it is {kind} now")
                    try:
                        new = open(path, "rb")
                    except FileNotFoundError:  # renamed away again meanwhile: wait for the next one
                        stop.wait(interval)
                        continue
                    f.close()
                    f = new
                    continue
                if st.st_size < f.tell():
                    f.seek(0)
                    continue
            stop.wait(interval)
    finally:
        f.close()
