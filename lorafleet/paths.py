"""Where lorafleet keeps things: the home (store, models, logs) and the daemon's socket.

- `LORAFLEET_HOME`, default `$XDG_DATA_HOME/lorafleet` (`~/.local/share/lorafleet`).
- `LORAFLEET_SOCKET`, default `$XDG_RUNTIME_DIR/lorafleet/lorafleet.sock`, or
  `$LORAFLEET_HOME/run/lorafleet.sock` where there is no runtime dir.
- `$LORAFLEET_HOME/config.toml`: `serve`'s defaults (its `[serve]` table).
- A detached daemon's log (`log_file`): `$LORAFLEET_HOME/logs/daemon.log` for the default socket,
  one file per other socket; the link `SOCKET.log` beside the socket names the file it writes.

The socket itself is 0600: whoever can connect can load adapters from any path the daemon can
read, so only its owner may. Directories the daemon creates for it are 0700; an existing one is
used as it is (its mode never changed) if it is safe: ours, or root's and sticky like /tmp, and
writable by no one else unless sticky, since whoever can write it can swap the socket. Nothing
here imports torch.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import re
import stat
from pathlib import Path

from lorafleet.errors import ConfigError

SOCKET_NAME = "lorafleet.sock"
# sun_path holds 108 bytes on Linux, 104 on macOS, with the terminating NUL
MAX_SOCKET_PATH = 103


def home() -> Path:
    env = os.environ.get("LORAFLEET_HOME")
    if env:
        return Path(env).expanduser()
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "lorafleet"


def socket_path(override: str | os.PathLike | None = None) -> Path:
    """The socket path: `override` (the CLI's --socket), else LORAFLEET_SOCKET, else the default."""
    if override:
        return Path(override).expanduser()
    env = os.environ.get("LORAFLEET_SOCKET")
    if env:
        return Path(env).expanduser()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "lorafleet" / SOCKET_NAME
    return home() / "run" / SOCKET_NAME


# what a daemon writes in its pid file once it holds the file's lock: anything else is not one
PID_FILE = re.compile(rb"[1-9][0-9]*\n")


def pidfile_path(socket: Path) -> Path:
    """The daemon's lock and pid file, beside its socket (`server.daemon.PidLock` holds it;
    `cli.ours` proves a pid is the daemon's with it)."""
    return socket.with_name(socket.name + ".pid")


def starting_daemon(socket: Path) -> int | None:
    """The pid of a lorafleet daemon that claimed `socket` and lives, or None. The daemon writes its
    pid file before it loads its model and binds the socket, and holds the file's flock for its
    whole life, so a pid there whose process holds that lock (`/proc/locks` names the holder) and
    runs `lorafleet serve`, while nothing answers on the socket, is a daemon still starting. A
    stale file (its daemon died, the pid reused by anyone, lorafleet or not) names no holder.
    Reads, never locks: a starting daemon's own check of the file must not see a reader's lock."""
    try:
        fd = os.open(pidfile_path(socket), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st, content = os.fstat(fd), os.read(fd, 32)
    except OSError:
        return None
    finally:
        os.close(fd)
    if not PID_FILE.fullmatch(content) or (pid := int(content)) <= 1:
        return None
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return pid if pid in lock_holders(st) and is_daemon_command(argv) else None


def lock_holders(st: os.stat_result) -> set[int]:
    """The pids `/proc/locks` names as holding a flock on the file of `st`: empty where it names
    none (or there is no /proc, or a file system whose inode numbers it shows otherwise)."""
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return set()
    holders = set()
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 4242 fe:00:2148334 0 EOF" (a waiter's: "1: -> FLOCK ...")
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        try:
            major, minor, ino = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(ino)) == want:
                holders.add(int(fields[4]))
        except ValueError:
            continue
    return holders


def is_daemon_command(argv: list[bytes]) -> bool:
    """Whether a command line is lorafleet's `serve`: `python -m lorafleet.cli.main serve ...` (how
    `--detach` and the service start it) or the `lorafleet serve ...` script (its interpreter first)."""
    for i, arg in enumerate(argv):
        if (arg == b"lorafleet.cli.main" and i > 0 and argv[i - 1] == b"-m") or os.path.basename(arg) == b"lorafleet":
            rest = [a for a in argv[i + 1:] if a]
            return rest[:1] == [b"serve"]
    return False


def logs_dir() -> Path:
    return home() / "logs"


def config_file() -> Path:
    """`serve`'s defaults: the `[serve]` table of this TOML file."""
    return home() / "config.toml"


def log_file(socket: Path) -> Path:
    """Where a detached daemon (or the service) on `socket` logs by default: `daemon.log` for the
    default socket, else a file of that socket's own, so that two daemons never share one. The
    name is the socket's name made safe plus a digest of its whole path: two sockets of one name
    in two folders get two files, and no character of a path reaches the file name unchecked."""
    socket = Path(os.path.abspath(socket))
    if socket == Path(os.path.abspath(socket_path())):
        return logs_dir() / "daemon.log"
    digest = hashlib.sha256(os.fsencode(str(socket))).hexdigest()[:8]
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.stem).strip(".")[:40] or "socket"
    return logs_dir() / f"daemon-{stem}-{digest}.log"


def log_link(socket: Path) -> Path:
    """The symbolic link beside `socket` that `serve --detach` points at its log file (which
    `--log-file` may have put anywhere), for `lorafleet logs` to find."""
    return socket.with_name(socket.name + ".log")


def socket_dir(path: Path) -> Path:
    """Make sure the socket's directory `path` exists and is safe. Missing levels (parents too) are
    created 0700, whatever the umask; an existing directory keeps its mode (it may be shared, as
    /tmp is) and is refused if someone else could replace the socket in it."""
    for level in [*reversed(path.parents), path]:
        try:
            level.mkdir(mode=0o700)
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError(f"cannot create {level}: {e.strerror}; choose another socket path "
                              "(--socket or LORAFLEET_SOCKET)") from None
        if stat.S_IMODE(level.stat().st_mode) != 0o700:  # the umask took bits away: ours to fix
            level.chmod(0o700)
    st = path.stat()
    sticky = bool(st.st_mode & stat.S_ISVTX)
    why = None
    if not stat.S_ISDIR(st.st_mode):
        why = "is not a directory"
    elif st.st_uid != os.geteuid() and not (st.st_uid == 0 and sticky):
        why = f"belongs to another user (uid {st.st_uid}), who could swap the socket"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky:
        why = (f"is writable by others without the sticky bit (mode {stat.S_IMODE(st.st_mode):04o}), "
               "so they could swap the socket")
    if why:
        raise ConfigError(f"socket directory {path} {why}; choose another socket path "
                          "(--socket or LORAFLEET_SOCKET)")
    return path


def check_socket_path(path: Path) -> Path:
    if len(os.fsencode(str(path))) > MAX_SOCKET_PATH:
        raise ConfigError(f"socket path {path} is {len(os.fsencode(str(path)))} bytes; Unix sockets "
                          f"allow {MAX_SOCKET_PATH}: choose a shorter one (--socket or LORAFLEET_SOCKET)")
    return path


def command_for(sock: Path, verb: str, *args: str) -> str:
    """The command line that reaches the daemon on `sock` (`lorafleet stop`, ...): with
    `--socket` unless `sock` is the default one, which the command would reach anyway."""
    target = [] if os.path.abspath(sock) == os.path.abspath(socket_path()) else ["--socket", os.path.abspath(sock)]
    return shlex.join(["lorafleet", verb, *target, *args])
