"""`lorafleet adapters ls|show|load|unload`: the daemon's adapters."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lorafleet.cli.common import JsonOption, SocketOption, client, err_console, print_json, user_errors

app = typer.Typer(help="List, inspect, load and unload the daemon's LoRA adapters.", no_args_is_help=True)

NameArg = Annotated[str, typer.Argument(help="The adapter's name (what requests put in `model`).", show_default=False)]


def _ranks(info: dict) -> str:
    ranks = sorted(set((info.get("ranks") or {}).values()))
    if not ranks:
        return "-"
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _state(info: dict) -> str:
    return str(info.get("tier") or info.get("state") or ("device" if info.get("pages") else "-"))


@app.command("ls")
def ls(socket: SocketOption = None, as_json: JsonOption = False) -> None:
    """List the adapters the daemon knows, with rank, pages and users."""
    with user_errors(), client(socket) as c:
        models = c.models()
    adapters = [m["lorafleet"] for m in models if m.get("parent")]
    if as_json:
        return print_json(adapters)
    if not adapters:
        err_console.print("no adapters loaded; load one with `lorafleet adapters load NAME PATH`", highlight=False)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for col in ("NAME", "RANK", "MODULES", "STATE", "PAGES", "USERS", "PATH"):
        table.add_column(col, justify="right" if col in ("RANK", "PAGES", "USERS") else "left")
    for a in adapters:
        users = a.get("users", a.get("refcount", 0))
        table.add_row(a["name"], _ranks(a), ",".join(m.replace("_proj", "") for m in a.get("modules", [])),
                      _state(a), str(a.get("pages", "-")), str(users), str(a.get("path", "")))
    Console().print(table)


@app.command("show")
def show(name: NameArg, socket: SocketOption = None, as_json: JsonOption = False) -> None:
    """Show one adapter: its path, digest, ranks per module, pages and users."""
    with user_errors(), client(socket) as c:
        card = c.model(name)
    info = card.get("lorafleet", card)
    if as_json:
        return print_json(info)
    from rich.console import Console
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for key, value in info.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
        elif isinstance(value, list):
            value = ", ".join(map(str, value)) or "-"
        grid.add_row(key, str(value))
    Console().print(grid)


@app.command("load")
def load(
    name: NameArg,
    path: Annotated[Path, typer.Argument(help="A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors).",
                                         show_default=False)],
    lazy: Annotated[bool, typer.Option("--lazy", help="Only register it; its weights load when a request first needs them.")] = False,
    socket: SocketOption = None,
    as_json: JsonOption = False,
) -> None:
    """Load a PEFT adapter into the daemon under NAME (validated against the base first)."""
    with user_errors(), client(socket) as c:
        answer = c.load_adapter(name, path, lazy=lazy)
    if as_json:
        return print_json(answer["adapter"])
    info = answer["adapter"]
    err_console.print(f"{'registered' if lazy else 'loaded'} {name} (rank {_ranks(info)}, "
                      f"{info.get('pages', 0)} pages) from {info.get('path', path)}", highlight=False)


@app.command("unload")
def unload(name: NameArg, socket: SocketOption = None) -> None:
    """Unload an adapter and free its pages (refused while requests use it)."""
    with user_errors(), client(socket) as c:
        c.unload_adapter(name)
    err_console.print(f"unloaded {name}", highlight=False)
