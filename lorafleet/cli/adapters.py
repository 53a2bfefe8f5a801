"""`lorafleet adapters ls|show|load|unload|rm`: the daemon's adapters and the store's."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lorafleet.cli import store as store_cli
from lorafleet.errors import AdapterNotFoundError, DaemonUnreachableError, LorafleetError
from lorafleet.cli.common import (ApiKeyOption, JsonOption, SocketOption, UrlOption, client, err_console, out_console,
                                  print_json, user_errors)
from lorafleet.format import human_bytes, ranks_text

app = typer.Typer(help="List, inspect, load, unload and remove LoRA adapters (the daemon's and the store's).",
                  no_args_is_help=True)

NameArg = Annotated[str, typer.Argument(help="The adapter's name (what requests put in `model`).", show_default=False)]


def _state(info: dict) -> str:
    return str(info.get("tier") or info.get("state") or ("device" if info.get("pages") else "-"))


@app.command("ls")
def ls(socket: SocketOption = None, url: UrlOption = None, api_key: ApiKeyOption = None,
       as_json: JsonOption = False) -> None:
    """List the adapters in the store and those a running daemon holds, side by side (rank,
    state, pages, users); without a daemon, the store's alone."""
    with user_errors():
        stored = store_cli.adapters_in_store()
        served = store_cli.daemon_models(socket, url, api_key)  # a wrong key or URL: one line, no traceback
    held = {m["id"]: m["lorafleet"] for m in served or () if m.get("parent")}
    rows = [{**held.get(n, {}), "name": n, "loaded": n in held, "in_store": n in stored, "store": stored.get(n)}
            for n in sorted(set(stored) | set(held))]
    if as_json:
        return print_json(rows)
    if served is None:
        err_console.print("no lorafleet daemon running: the store's adapters only", highlight=False)
    if not rows:
        err_console.print("no adapters: pull one (`lorafleet pull SOURCE`) or load one into the daemon "
                          "(`lorafleet adapters load NAME PATH`)", highlight=False)
        return
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for col in ("NAME", "RANK", "MODULES", "STORE", "STATE", "PAGES", "USERS", "PATH"):
        table.add_column(col, justify="right" if col in ("RANK", "PAGES", "USERS") else "left")
    for a in rows:
        info = a if a["loaded"] else (a["store"] or {})
        table.add_row(a["name"], ranks_text(info), ",".join(m.replace("_proj", "") for m in info.get("modules", [])),
                      "yes" if a["in_store"] else "", _state(a) if a["loaded"] else "-",
                      str(a.get("pages", "-")), str(a.get("users", "-")), str(a.get("path", a["store"] and a["store"]["source"])))
    out_console().print(table)


def _daemon_card(socket, name: str, url: str | None = None, api_key: str | None = None) -> dict | None:
    """The daemon's record of `name`, or None when no daemon runs or it does not hold it."""
    try:
        with client(socket, url, api_key) as c:
            card = c.model(name)
    except DaemonUnreachableError:
        return None
    except LorafleetError as e:
        if e.http_status == 404:
            return None
        raise
    return card.get("lorafleet", card)


@app.command("show")
def show(name: NameArg, socket: SocketOption = None, url: UrlOption = None, api_key: ApiKeyOption = None,
         as_json: JsonOption = False) -> None:
    """Show one adapter: what the running daemon holds (path, digest, ranks per module, pages,
    users) and its store record (digest, base, source, size), either alone when the other lacks it."""
    with user_errors():
        stored = store_cli.adapters_in_store().get(name)
        info = _daemon_card(socket, name, url, api_key)
        if info is None and stored is None:
            raise AdapterNotFoundError(f"adapter {name!r} is neither in the store nor held by a running daemon")
    info = {**info, "store": stored} if info is not None else {**(stored or {}), "loaded": False}  # one is: refused above
    if as_json:
        return print_json(info)
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for key, value in show_rows(info):
        grid.add_row(key, value)
    out_console().print(grid)


def show_rows(info: dict, indent: str = "") -> list[tuple[str, str]]:
    """`adapters show`'s lines: each field as people read it (`human`); the store record, a
    dict, as its own lines under "store", indented."""
    rows = []
    for key, value in info.items():
        if key == "store" and isinstance(value, dict):
            rows.append((indent + key, ""))
            rows += show_rows(value, indent + "  ")
        else:
            rows.append((indent + key, human(key, value)))
    return rows


def human(key: str, value) -> str:
    """A field's value for people: '-' for none, yes/no, sizes in KiB/MiB, times in ms or s,
    lists joined, dicts as `k=v` (a store record's files as their count)."""
    if value is None or value == "" or value == [] or value == {}:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)) and (key == "size" or key.endswith("_bytes")):
        return human_bytes(value)
    if isinstance(value, (int, float)) and key.endswith("_s"):
        return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return ", ".join(human("", v) for v in value)
    if isinstance(value, dict):
        if key == "files":
            return f"{len(value)} file{'s' if len(value) != 1 else ''}"
        if key == "base" and "name" in value:
            return str(value["name"])
        return ", ".join(f"{k}={human(k, v)}" for k, v in value.items())
    return str(value)


@app.command("load")
def load(
    name: NameArg,
    path: Annotated[Path, typer.Argument(help="A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors).",
                                         show_default=False)],
    lazy: Annotated[bool, typer.Option("--lazy", help="Only register it; its weights load when a request first needs them.")] = False,
    socket: SocketOption = None,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
    as_json: JsonOption = False,
) -> None:
    """Load a PEFT adapter into the daemon under NAME (validated against the base first)."""
    with user_errors(), client(socket, url, api_key) as c:
        answer = c.load_adapter(name, path, lazy=lazy)
    if as_json:
        return print_json(answer["adapter"])
    info = answer["adapter"]
    err_console.print(f"{'registered' if lazy else 'loaded'} {name} (rank {ranks_text(info)}, "
                      f"{info.get('pages', 0)} pages) from {info.get('path', path)}", highlight=False)


@app.command("unload")
def unload(name: NameArg, socket: SocketOption = None, url: UrlOption = None,
           api_key: ApiKeyOption = None) -> None:
    """Unload an adapter and free its pages (refused while requests use it)."""
    with user_errors(), client(socket, url, api_key) as c:
        c.unload_adapter(name)
    err_console.print(f"unloaded {name}", highlight=False)


@app.command("rm")
def rm(name: NameArg, socket: SocketOption = None, url: UrlOption = None, api_key: ApiKeyOption = None,
       force: Annotated[bool, typer.Option("--force", "-f", help="Unload it from the running daemon first "
                                           "(refused while requests use it).")] = False) -> None:
    """Remove an adapter from the store (refused while the running daemon has it registered:
    unload it first, or pass --force). Its files go at once."""
    store_cli.adapter_rm(name, socket, url, api_key, force)
