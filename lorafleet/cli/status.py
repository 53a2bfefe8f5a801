"""`lorafleet status` and `lorafleet stop`: the daemon's life, seen from outside."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from lorafleet.cli.common import (ApiKeyOption, JsonOption, SocketOption, UrlOption, client, err_console, fail,
                                  out_console, print_json, user_errors)
from lorafleet.format import duration, human_bytes
from lorafleet.snapshot import Stats


def status(socket: SocketOption = None, url: UrlOption = None, api_key: ApiKeyOption = None,
           as_json: JsonOption = False,
           socket_path: Annotated[bool, typer.Option(
               "--socket-path", help="Print the socket's path (as --socket, LORAFLEET_SOCKET or the default resolve "
                                     "it) and exit, whether or not a daemon runs: for scripts and curl.")] = False,
           ) -> None:
    """Show whether the daemon runs, what it serves, its queues and its page pool."""
    if socket_path:
        from lorafleet import paths

        with user_errors():
            return print(paths.socket_path(socket))
    with user_errors(), client(socket, url, api_key) as c:
        stats = c.stats()
        where = c.where
    if as_json:
        return print_json(stats)
    try:
        grid = _grid(stats)
    except (KeyError, TypeError, ValueError, AttributeError):  # stats of something else than lorafleet
        raise fail(f"what answers at {where} is not a lorafleet daemon (its /v1/stats lacks what a daemon "
                   "reports)", 3) from None
    out_console().print(grid)


def _grid(stats: Stats):
    from rich.table import Table

    srv, eng = stats["server"], stats["engine"]
    pool = eng["pool"]
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    state = "draining" if srv["draining"] else "running"
    grid.add_row("daemon", f"{state} (pid {srv['pid']}), up {duration(srv['uptime_s'])}, lorafleet {stats['version']}")
    grid.add_row("socket", srv["socket"] + (f"  (and TCP {srv['tcp']})" if srv.get("tcp") else ""))
    model = f"{srv['model']}  ({srv['model_path']})"
    if srv.get("sampling_defaults"):
        model += "  defaults: " + ", ".join(f"{k}={v:g}" for k, v in srv["sampling_defaults"].items())
    grid.add_row("model", model)
    weights = f"{eng['quantization']} weights, {eng['dtype']} compute" if eng.get("quantization") else eng.get("dtype", "?")
    grid.add_row("device", f"{eng['device']}, {weights} ({human_bytes(eng.get('weight_bytes', 0))}), "
                           f"context {eng['max_model_len']} tokens")
    grid.add_row("requests", f"{eng['num_running']} running, {eng['num_waiting']} waiting, "
                             f"{srv['pending']} admitted of {srv['max_pending']}, {srv['num_rejected']} refused")
    prefix = eng["prefix_cache"]
    held = pool.get("adapter_dtype", eng["dtype"])  # `--lora-dtype`: said where it is not the model's
    grid.add_row("pool", f"{pool['total_pages']} pages x {human_bytes(pool['page_bytes'])}: {pool['kv_pages']} KV, "
                         f"{pool['cached_pages']} cached, {pool['adapter_pages']} adapter pages"
                         f"{f' ({held})' if held != eng['dtype'] else ''}, {pool['free_pages']} free "
                         f"(KV usage {100 * eng['kv_cache_usage']:.0f}%)")
    grid.add_row("prefix cache", (f"{100 * prefix['hit_rate']:.0f}% of {prefix['query_tokens']} prompt tokens found"
                                  if prefix["enabled"] else "off"))
    grid.add_row("adapters", f"{eng['num_adapters']} known; "
                             f"{eng.get('num_requests_finished', 0)} requests served")
    return grid


def stop(
    socket: SocketOption = None,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=0, help="Seconds to wait for the daemon to drain and exit.")] = 60.0,
    url: Annotated[str | None, typer.Option(  # no LORAFLEET_URL: set for the other verbs, it must not stop this one
        "--url", metavar="URL", help="Refused: stop signals the daemon's process, so only by its socket.")] = None,
) -> None:
    """Stop the daemon: in-flight requests finish first (SIGTERM), then it exits. Socket only:
    it signals the daemon's pid, so the daemon must run on this machine (--url is refused, saying
    so). Only a process proven to be the socket's daemon is signalled (`cli/ours.py`)."""
    from lorafleet.cli.ours import proven_daemon
    from lorafleet.errors import DaemonStartingError

    if url:
        raise typer.BadParameter("stop signals the daemon's process, so it stops a daemon of this machine, by its "
                                 "socket (--socket); on the daemon's machine run `lorafleet stop` (or `lorafleet "
                                 "service uninstall` for the service)", param_hint="--url")

    with user_errors(), client(socket) as c:
        try:
            reported, starting = c.stats()["server"].get("pid"), False
        except DaemonStartingError:  # it has no socket yet: its pid file names it
            reported, starting = None, True
        with proven_daemon(c.socket, answered=not starting, reported=reported) as daemon:
            pid = daemon.pid
            if not daemon.terminate():
                err_console.print(f"the lorafleet daemon (pid {pid}) had exited already", highlight=False)
                return
            # gone once its socket is removed (the daemon's last step) or the process has ended
            deadline = time.monotonic() + timeout
            while not daemon.exited(wait=0.1) and (starting or c.socket.exists()):
                if time.monotonic() > deadline:
                    raise fail(f"the daemon (pid {pid}) is still draining after {timeout:g}s; "
                               f"`kill -INT {pid}` stops it without waiting")
    err_console.print(f"stopped the lorafleet daemon (pid {pid})", highlight=False)
