"""Where lorafleet keeps things: the home (store, models, logs) and the daemon's socket.

- `LORAFLEET_HOME`, default `$XDG_DATA_HOME/lorafleet` (`~/.local/share/lorafleet`).
- `LORAFLEET_SOCKET`, default `$XDG_RUNTIME_DIR/lorafleet/lorafleet.sock`, or
  `$LORAFLEET_HOME/run/lorafleet.sock` where there is no runtime dir.

The socket's directory is owner-only (0700) and the socket itself 0600: whoever can connect
can load adapters from any path the daemon can read, so only its owner may. Nothing here
imports torch.
"""

from __future__ import annotations

import os
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


def pidfile_path(socket: Path) -> Path:
    """The daemon's lock and pid file, beside its socket."""
    return socket.with_name(socket.name + ".pid")


def models_dir() -> Path:
    return home() / "models"


def logs_dir() -> Path:
    return home() / "logs"


def private_dir(path: Path) -> Path:
    """Create `path` (and parents) if needed and make it owner-only (0700). A directory someone
    else owns is refused: a socket there could be swapped under us."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise ConfigError(f"{path} belongs to another user (uid {st.st_uid}); choose another "
                          "socket path (--socket or LORAFLEET_SOCKET)")
    if stat.S_IMODE(st.st_mode) != 0o700:
        path.chmod(0o700)
    return path


def check_socket_path(path: Path) -> Path:
    if len(os.fsencode(str(path))) > MAX_SOCKET_PATH:
        raise ConfigError(f"socket path {path} is {len(os.fsencode(str(path)))} bytes; Unix sockets "
                          f"allow {MAX_SOCKET_PATH}: choose a shorter one (--socket or LORAFLEET_SOCKET)")
    return path
