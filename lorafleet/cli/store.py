"""`lorafleet pull`, `lorafleet models ls|rm`, `lorafleet store check|gc`, and the store half of
`lorafleet adapters ls|show|rm`: the local store (lorafleet/store/), with or without a daemon."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lorafleet.cli.common import (ApiKeyOption, JsonOption, SocketOption, UrlOption, client, err_console, out_console,
                                  print_json, styled, user_errors)
from lorafleet.errors import DaemonUnreachableError, StoreError
from lorafleet.format import ranks_text
from lorafleet.store.store import Store

models_app = typer.Typer(help="List and remove the base models in the store.", no_args_is_help=True)
store_app = typer.Typer(help="Check the store's consistency and free unreferenced files.", no_args_is_help=True)


def daemon_models(socket, url: str | None = None, api_key: str | None = None) -> list[dict] | None:
    """What a running daemon serves (/v1/models), or None when no daemon answers."""
    try:
        with client(socket, url, api_key) as c:
            return c.models()
    except DaemonUnreachableError:
        return None


def daemon_base(socket, url: str | None = None, api_key: str | None = None) -> dict | None:
    """The base a running daemon serves, its /v1/models entry (with its folder, `root`), or None
    when no daemon answers."""
    base = next((m for m in daemon_models(socket, url, api_key) or () if not m.get("parent")), None)
    return base if base and base.get("root") else None


def served_base(socket, url: str | None = None, api_key: str | None = None) -> Path | None:
    """The folder of the base a running daemon serves, resolved (None: no daemon)."""
    base = daemon_base(socket, url, api_key)
    return Path(base["root"]).resolve() if base else None


def _served(socket) -> tuple[str, Path] | None:
    """The name and folder of the base the daemon on `socket` serves (None: no daemon answers)."""
    base = daemon_base(socket)
    return (base["id"], Path(base["root"])) if base else None


def size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def pull(
    source: Annotated[str, typer.Argument(help="A Hugging Face repo id (org/name), a local folder, or a GGUF file "
                                                 "(a base: Q8_0, Q4_0 or float; stored converted, byte for byte).",
                                  show_default=False)],
    name: Annotated[str | None, typer.Option("--name", help="The name to store it under (default: the "
                                             "folder's or repo's last component).")] = None,
    base: Annotated[bool, typer.Option("--base", help="SOURCE is a base model, not an adapter.")] = False,
    quantize: Annotated[str | None, typer.Option(
        "--quantize", metavar="int8|int4", help="With --base: store the base quantized (weight-only: int8 a scale per "
                                                "output channel, int4 groups of 32), once; serve then reads it as is.")] = None,
    revision: Annotated[str | None, typer.Option("--revision", help="A Hub branch, tag or commit (default: main).")] = None,
    for_model: Annotated[str | None, typer.Option("--for", metavar="MODEL", help="The stored base to validate "
                                                  "the adapter against (default: the one its base_model_name_or_path "
                                                  "names, else the only one).")] = None,
    strict_base: Annotated[bool, typer.Option("--strict-base", help="Refuse an adapter whose "
                                              "base_model_name_or_path names another base (default: a warning).")] = False,
    socket: Annotated[Path | None, typer.Option(
        "--socket", metavar="PATH", help="The daemon whose base an adapter is validated against when the store "
                                         "does not decide (default: LORAFLEET_SOCKET, else the default socket).")] = None,
    as_json: JsonOption = False,
) -> None:
    """Fetch a base or an adapter into the store, validated once.

    Adapters are checked against a base (--for's, the stored one the adapter names, the one the
    running daemon serves, or the store's only one) exactly as a load would check them; only
    safetensors and JSON files are fetched and stored, never pickles; installs are atomic and
    content-addressed. Hub downloads honour HF_TOKEN and resume."""
    from lorafleet.store.pull import pull as do_pull

    def warn(message: str) -> None:
        err_console.print(styled("warning:", "yellow", message))
    with user_errors():
        manifest = do_pull(source, name=name, base=base, quantize=quantize, revision=revision, for_model=for_model,
                           strict_base=strict_base, progress=not as_json, warn=warn,
                           served=None if base or for_model else _served(socket))
    if as_json:
        return print_json(manifest)
    what = (f"base ({manifest['quantization']})" if manifest.get("quantization") else "base") \
        if base or "ollama_adapters" in manifest or manifest.get("source", "").startswith("ollama:") else f"adapter (ranks {ranks_text(manifest)}, validated against {manifest['base']['name']})"
    err_console.print(f"pulled {manifest['name']}: {what}, {size(manifest['size'])}, from {manifest['source']}",
                      highlight=False)
    for a in manifest.get("ollama_adapters", []):  # an Ollama model's adapters, pulled with its base
        err_console.print(f"pulled {a['name']}: adapter (ranks {ranks_text(a)}, validated against "
                          f"{a['base']['name']}), {size(a['size'])}", highlight=False)


def _table(columns, rows) -> None:
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*map(str, row))
    out_console().print(table)


@models_app.command("ls")
def models_ls(socket: SocketOption = None, url: UrlOption = None, api_key: ApiKeyOption = None,
              as_json: JsonOption = False) -> None:
    """List the stored bases (and mark the one a running daemon serves)."""
    store = Store()
    with user_errors():
        stored = store.list("models")
        base = daemon_base(socket, url, api_key)  # a wrong key or URL: one line, no traceback
    served = Path(base["root"]).resolve() if base else None
    for m in stored:
        m["in_store"] = True
        m["served"] = served is not None and served == store.folder(m).resolve()
    if served is not None and not any(m["served"] for m in stored):
        # served from a folder or the bundled demo: listed too, so `ls` says what runs
        assert base is not None  # served is its root
        stored.append({"name": base["id"], "source": str(served), "in_store": False, "served": True})
    if as_json:
        return print_json(stored)
    if not stored:
        err_console.print("no base models in the store; pull one with `lorafleet pull SOURCE --base`", highlight=False)
        return
    _table(("NAME", "ARCHITECTURE", "LAYERS", "WEIGHTS", "SIZE", "SOURCE", "SERVED"),
           [(m["name"], m.get("architecture", "-"), m.get("layers", "-"), m.get("quantization", "full"),
             size(m["size"]) if "size" in m else "-", m["source"],
             ("yes" if m["in_store"] else "yes (not in the store)") if m["served"] else "") for m in stored])


@models_app.command("rm")
def models_rm(name: Annotated[str, typer.Argument(help="The stored base's name.", show_default=False)],
              socket: SocketOption = None, url: UrlOption = None, api_key: ApiKeyOption = None) -> None:
    """Remove a base from the store (refused while a daemon serves it, or while stored adapters
    were validated against it: remove them first). Its files go at once (gc)."""
    store = Store()
    with user_errors():
        m = store.get("models", name)
        if served_base(socket, url, api_key) == store.folder(m).resolve():
            raise StoreError(f"the running daemon serves {name!r}; stop it first (lorafleet stop)")
        users = [a["name"] for a in store.list("adapters") if a["base"]["name"] == name]
        if users:
            raise StoreError(f"stored adapters were validated against {name!r}: {', '.join(users)}; "
                             "remove them first (lorafleet adapters rm NAME)")
        with store.lock():
            store.remove("models", name)
            store.gc()
    err_console.print(f"removed {name}", highlight=False)


def adapters_in_store() -> dict[str, dict]:
    return {m["name"]: m for m in Store().list("adapters")}


def adapter_rm(name: str, socket, url: str | None = None, api_key: str | None = None, force: bool = False) -> None:
    """`lorafleet adapters rm`: refused while the running daemon has the adapter registered,
    unless `force`, which unloads it there first (refused in turn while requests use it)."""
    store = Store()
    with user_errors():
        store.get("adapters", name)
        served = daemon_models(socket, url, api_key) or []
        if any(x.get("id") == name and x.get("parent") for x in served):
            if not force:
                raise StoreError(f"the running daemon has {name!r} registered; unload it first "
                                 f"(lorafleet adapters unload {name}), or remove it with --force, which does")
            with client(socket, url, api_key) as c:
                c.unload_adapter(name)
            err_console.print(f"unloaded {name} from the running daemon", highlight=False)
        with store.lock():
            store.remove("adapters", name)
            store.gc()
    err_console.print(f"removed {name}", highlight=False)


@store_app.command("check")
def check(deep: Annotated[bool, typer.Option("--deep", help="Also hash every file against its sha256.")] = False,
          as_json: JsonOption = False) -> None:
    """Verify every manifest against its files; exit 1 when anything is wrong."""
    with user_errors():
        problems = Store().check(deep=deep)
    if as_json:
        print_json({"problems": problems})
    else:
        for p in problems:
            err_console.print(p, highlight=False)
        if not problems:
            err_console.print("the store is consistent", highlight=False)
    if problems:
        raise typer.Exit(1)


@store_app.command("gc")
def gc(as_json: JsonOption = False) -> None:
    """Remove what no manifest names: files left by interrupted pulls, removed items' files."""
    store = Store()
    with user_errors(), store.lock():
        removed = store.gc()
    if as_json:
        return print_json(removed)
    err_console.print(f"removed {removed['blobs']} files ({size(removed['bytes'])}) and "
                      f"{removed['snapshots']} snapshots", highlight=False)
