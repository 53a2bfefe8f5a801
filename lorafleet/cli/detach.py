"""`serve --detach`: the daemon started in a session of its own, logging to a file, and the
terminal told what it does until it answers (`serve.py` decides what to run)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from lorafleet import paths
from lorafleet.cli.common import err_console, fail
from lorafleet.errors import DaemonUnreachableError, LorafleetError


# not forwarded to the detached daemon: it runs in the foreground and logs to stdout (the parent
# points that at the log file); the key travels in the environment, where `ps` does not show it
_NOT_FORWARDED = {"detach", "log_file", "api_key"}


def rebuild_argv(command, params: dict, **overrides) -> list[str]:
    """`serve` argv that parses back to `params` (with `overrides`), built from the command's own
    parameter list so that a new option reaches the detached daemon without an edit here."""
    options, arguments = [], []
    for param in command.params:
        if param.name in _NOT_FORWARDED:
            continue
        value = overrides.get(param.name, params.get(param.name))
        values = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
        if param.param_type_name == "argument":
            arguments += [str(v) for v in values]
        elif param.is_flag:  # on: its name; off: its --no- name, or nothing (then off is its default)
            options += [name for name in (param.opts if value else param.secondary_opts)[:1]]
        else:
            name = max(param.opts, key=len)
            for v in values:  # `--name=value`, one token: a value that starts with '-' stays a value
                options += [f"{name}={v}"] if name.startswith("--") else [name, str(v)]
    return ["serve", *options, *(["--", *arguments] if arguments else [])]


def started_message(pid: int, sock: Path, log_file: Path) -> str:
    return (f"lorafleet daemon started (pid {pid}) on {sock}; logs in {log_file} (`{paths.command_for(sock, 'logs', '-f')}`); "
            f"stop it with `{paths.command_for(sock, 'stop')}`")


def _link_log(sock: Path, log_file: Path) -> None:
    """Point the link beside the socket at the daemon's log (`paths.log_link`), replacing an old
    link of ours; anything else there is left alone (then `logs` falls back to the default)."""
    link = paths.log_link(sock)
    try:
        if link.is_symlink() and link.lstat().st_uid == os.geteuid():
            link.unlink()
        link.symlink_to(log_file.absolute())
    except OSError:  # a file of that name, or a folder we may not write: `logs` then needs --log-file
        pass


def _echo_new_lines(log_file: Path, seen: int) -> int:
    """The log's whole lines past byte `seen`, printed indented; returns the new position."""
    try:
        with open(log_file, "rb") as f:
            f.seek(seen)
            data = f.read(1 << 16)
    except OSError:
        return seen
    end = data.rfind(b"\n") + 1
    for line in data[:end].decode(errors="replace").splitlines():
        err_console.print("  " + line, highlight=False, soft_wrap=True)
    return seen + end


def start_detached(argv: list[str], sock: Path, log_file: Path | None, api_key: str | None,
            wait_s: float = 600.0) -> None:
    """Start `lorafleet <argv>` in a new session, logging to a file; return once it answers."""
    from lorafleet.client import Client

    with Client(sock) as c:
        try:
            pid = c.stats()["server"]["pid"]
            raise fail(f"a lorafleet daemon (pid {pid}) already serves {sock}")
        except DaemonUnreachableError:
            pass
    log_file = log_file or paths.log_file(sock)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "COLUMNS": os.environ.get("COLUMNS", "120")}
    if api_key:
        env["LORAFLEET_API_KEY"] = api_key
    with open(log_file, "ab") as log:
        child = subprocess.Popen([sys.executable, "-P", "-m", "lorafleet.cli.main", *argv], stdin=subprocess.DEVNULL,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    deadline = time.monotonic() + wait_s
    err_console.print(f"starting the lorafleet daemon (pid {child.pid}); what it does meanwhile:", highlight=False)
    seen = log_file.stat().st_size if log_file.is_file() else 0
    with Client(sock) as c:
        while time.monotonic() < deadline:
            seen = _echo_new_lines(log_file, seen)  # a first start builds the kernels for a minute: say so
            if child.poll() is not None:
                tail = log_file.read_text(errors="replace").splitlines()[-5:]
                raise fail(f"the daemon exited with status {child.returncode}; last lines of {log_file}:\n"
                           + "\n".join(tail))
            try:
                c.health()
                break
            except LorafleetError:
                time.sleep(0.05)  # a health check over the socket is cheap; a started daemon waits for the next
        else:
            raise fail(f"the daemon (pid {child.pid}) did not answer within {wait_s:.0f}s; see {log_file}")
    _link_log(sock, log_file)
    err_console.print(started_message(child.pid, sock, log_file), highlight=False, soft_wrap=True)
