"""Which process `lorafleet stop` may signal: the daemon of its socket, proven so, never a pid
merely reported by whatever answers on the socket or left in a file.

A pid is the socket's daemon when all of these hold:

1. the pid file beside the socket (`paths.pidfile_path`) is a regular file of this user's holding
   one pid as the daemon writes it (digits and a newline), greater than 1;
2. its lock is held, and by that pid where `/proc/locks` names the holder. The daemon flocks the
   file for its whole life (the kernel drops the lock when it dies) and writes its pid only once
   it holds it, so a file with a pid in it and a free lock was left by a daemon that died: its pid
   may be anyone's by now. For the same reason, testing the lock (a shared lock taken and dropped
   at once) never disturbs a daemon's start;
3. the process runs as this user and its command line is lorafleet's `serve` (`/proc/PID/cmdline`);
4. what answers on the socket, when anything does, reports that same pid in `/v1/stats`.

The process is held by a pidfd from before checks 2 and 3 on: if it exits and its pid is reused
meanwhile, the signal finds the old process gone instead of reaching the new one.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import stat
from pathlib import Path

from lorafleet.errors import LorafleetError
from lorafleet.paths import PID_FILE, is_daemon_command, lock_holders, pidfile_path


class NotOurDaemonError(LorafleetError):
    """`stop` found nothing it can prove is this socket's daemon: nothing was signalled."""

    code = "not_our_daemon"


class Daemon:
    """A proven daemon process: `terminate()` it, then `exited(wait)` until it is gone."""

    def __init__(self, pid: int, pidfd: int | None):
        self.pid, self.pidfd = pid, pidfd

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def terminate(self) -> bool:
        """SIGTERM; False if it had exited already."""
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGTERM)
            else:
                os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return False
        return True

    def exited(self, wait: float = 0.0) -> bool:
        """Whether it has exited, waiting up to `wait` seconds for that (a pidfd turns readable
        when its process ends)."""
        if self.pidfd is not None:
            return bool(select.select([self.pidfd], [], [], wait)[0])
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        select.select([], [], [], wait)
        return False


def proven_daemon(sock: Path, answered: bool, reported: object = None) -> Daemon:
    """The daemon of `sock`, proven (see the module's doc), or NotOurDaemonError naming what is
    missing. `answered`: something answered on the socket, and reported the pid `reported`."""
    pidfile = pidfile_path(sock)
    answer = f" (what answers on it reports pid {_short(reported)})" if answered else ""
    nothing = "nothing was signalled; if a lorafleet daemon of yours does run there, stop it by its pid (`kill PID`)"
    try:
        fd = os.open(pidfile, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise NotOurDaemonError(f"no lorafleet daemon claims {sock}{answer}: {pidfile} does not exist; "
                                f"{nothing}") from None
    except OSError as e:
        raise NotOurDaemonError(f"cannot read {pidfile} ({e.strerror}); {nothing}") from None
    try:  # the lock is tested on the very file the pid was read from
        st = os.fstat(fd)
        content = os.read(fd, 32)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or not PID_FILE.fullmatch(content):
            raise NotOurDaemonError(f"{pidfile} is not a lorafleet pid file of yours (a file of yours holding "
                                    f"one pid); {nothing}")
        pid = int(content)

        def refuse(why: str) -> NotOurDaemonError:
            return NotOurDaemonError(f"pid {pid} (named by {pidfile}) is not proven to be the lorafleet daemon of "
                                     f"{sock}: {why}; nothing was signalled")

        if pid <= 1:
            raise refuse("lorafleet never signals pid 0 or 1")
        if answered and (isinstance(reported, bool) or not isinstance(reported, int) or reported != pid):
            raise refuse(f"what answers on the socket reports pid {_short(reported)}")
        pidfd = _pidfd(pid)
        try:
            if not _locked(fd):
                raise refuse("no process holds the pid file's lock, so the daemon that wrote it is gone (the "
                             "file is stale, and the pid may be another process's by now)")
            holders = lock_holders(st)
            if holders and pid not in holders:
                raise refuse(f"the pid file's lock is held by pid {', '.join(map(str, sorted(holders)))}, not by it")
            why = _not_a_daemon_of_ours(pid)
            if why:
                raise refuse(why)
        except BaseException:
            if pidfd is not None:
                os.close(pidfd)
            raise
        return Daemon(pid, pidfd)
    finally:
        os.close(fd)


def _pidfd(pid: int) -> int | None:
    """A pidfd for `pid`, or None where there is none (no such process, or a system without
    pidfds: then the pid itself is signalled)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _locked(fd: int) -> bool:
    """Whether a process holds the lock of the file open at `fd`."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _not_a_daemon_of_ours(pid: int) -> str | None:
    """Why `pid` is not a lorafleet daemon of this user's, or None if it is one."""
    if pid == os.getpid():
        return "it is this very command"
    proc = Path(f"/proc/{pid}")
    if not Path("/proc/self").exists():  # no /proc here: only a process we may signal at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "no process has that pid"
        except PermissionError:
            return "it belongs to another user"
        return None
    try:
        owner = proc.stat().st_uid
        argv = (proc / "cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return "no process has that pid"
    except OSError as e:
        return f"its process cannot be inspected ({e.strerror})"
    if owner != os.geteuid():
        return f"its process belongs to another user (uid {owner})"
    if not is_daemon_command(argv):
        shown = " ".join(a.decode(errors="replace") for a in argv if a)[:120]
        return f"its process is not `lorafleet serve` (it runs {shown!r})"
    return None


def _short(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"
