"""`lorafleet top`: the live view of a daemon (the Textual app in `lorafleet/tui/`)."""

from __future__ import annotations

from typing import Annotated

import typer

from lorafleet.cli.common import ApiKeyOption, SocketOption, UrlOption, client, user_errors


def top(
    socket: SocketOption = None,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
    interval: Annotated[float, typer.Option(
        "--interval", "-n", min=0.1, max=3600, metavar="SECONDS",
        help="Seconds between two snapshots of the daemon's stats.")] = 1.0,
) -> None:
    """A live view of the daemon: its page pool (who owns each page), its adapters (tier,
    pages, requests, hits, loads, load and stall times), the cost of adapter switches, and
    throughput and latency over the last minutes. Keys: `p` pause, `q` quit, `?` help, `/`
    filter, `s` sort, Enter an adapter's detail. Runs before a daemon does, and across its
    restarts."""
    from lorafleet.tui.app import TopApp

    with user_errors():
        c = client(socket, url, api_key)
    with c:
        TopApp(c.stats, c.where, interval).run()
