"""`lorafleet ps`: what the daemon holds where, as `ollama ps` shows it: the base model, then one
row per adapter on the device tier (pool pages) or the host tier, or with requests running or
waiting (one that waits for its load may still be on disk). Read from `/v1/stats`: its
`adapter_details` (every adapter not on disk, or ever asked for) and `lora` (requests per adapter)."""

from __future__ import annotations

from typing import TypeVar

from lorafleet.cli.common import (ApiKeyOption, JsonOption, SocketOption, UrlOption, client, err_console, fail,
                                  out_console, print_json, user_errors)
from lorafleet.format import duration, human_bytes, ranks_text
from lorafleet.snapshot import Stats

TIERS = ("device", "host", "disk")  # the rows' order: what serves now first
T = TypeVar("T")


def ps(socket: SocketOption = None, url: UrlOption = None, api_key: ApiKeyOption = None,
       as_json: JsonOption = False) -> None:
    """Show what is loaded where: the base model, then each adapter in the pool (device) or the
    host cache, or in use, with its rank, pages, requests and when it was last used."""
    with user_errors(), client(socket, url, api_key) as c:
        stats = c.stats()
        where = c.where
    try:
        view = snapshot(stats)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # stats of something else than lorafleet
        why = f"no {e.args[0]!r} in it" if isinstance(e, KeyError) else str(e)
        raise fail(f"what answers at {where} is not a lorafleet daemon (its /v1/stats lacks what a daemon "
                   f"reports: {why[:120]})", 3) from None
    if as_json:
        return print_json(view)
    _print(view)


def snapshot(stats: Stats) -> dict:
    """{"model": the base and the pool, "adapters": rows (device, host, then disk; by name),
    "other_adapters": how many more the daemon knows, idle on disk}. Every value is checked to be
    of the kind a daemon reports (ValueError, TypeError or KeyError otherwise), so that what is
    printed or summed later cannot fail on a foreign answer of another shape."""
    srv, eng = _object(stats["server"]), _object(stats["engine"])
    pool, lora = _object(eng["pool"]), _object(eng.get("lora") or {})
    running, waiting = _counts(lora.get("running") or {}), _counts(lora.get("waiting") or {})
    page_bytes = _count(pool["page_bytes"])
    rows = []
    for name, a in _object(eng["adapter_details"]).items():
        a = _object(a)
        run, wait, tier = running.get(name, 0), waiting.get(name, 0), _text(a["tier"])
        if tier not in ("device", "host") and not (run or wait):
            continue
        ranks, pages = _counts(a["ranks"]), _count(a["pages"])
        idle_s, error = a.get("idle_s"), a.get("error")
        if idle_s is not None and (isinstance(idle_s, bool) or not isinstance(idle_s, (int, float))
                                   or not idle_s >= 0):
            raise ValueError(f"idle_s {repr(idle_s)[:60]}")
        rows.append({"name": name, "tier": tier, "rank": max(ranks.values(), default=None),
                     "ranks": ranks, "pages": pages, "bytes": pages * page_bytes,
                     "running": run, "waiting": wait, "in_use": bool(_count(a["users"]) or run),
                     "idle_s": idle_s, "error": None if error is None else _text(error)})
    rows.sort(key=lambda r: (TIERS.index(r["tier"]) if r["tier"] in TIERS else len(TIERS), r["name"]))
    model = {"name": _text(srv["model"]), "path": _text(srv["model_path"]), "device": _text(eng["device"]),
             "pid": _count(srv["pid"]),
             "pool": {k: _count(pool[k]) for k in ("total_pages", "page_bytes", "kv_pages", "cached_pages",
                                                   "adapter_pages", "free_pages")}}
    return {"model": model, "adapters": rows, "other_adapters": _count(eng["num_adapters"]) - len(rows)}


def _object(value: T) -> T:
    """`value`, checked to be an object: its declared shape (`lorafleet.snapshot`) is what a
    daemon sends, not what anything answering sends."""
    if not isinstance(value, dict):
        raise TypeError(f"{type(value).__name__} where an object belongs")
    return value


def _count(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise ValueError(f"{repr(value)[:60]} where a count belongs")
    return value


def _counts(value) -> dict[str, int]:
    return {name: _count(n) for name, n in _object(value).items()}


def _text(value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{type(value).__name__} where a string belongs")
    return value


def last_used(row: dict) -> str:
    if row["in_use"]:
        return "now"
    if row["idle_s"] is None:  # no request yet (a load is no use), or a daemon that does not report it
        return "-"
    return "<1s ago" if row["idle_s"] < 1 else f"{duration(row['idle_s'])} ago"


def _print(view: dict) -> None:
    from rich.table import Table

    m, pool = view["model"], view["model"]["pool"]
    console = out_console()
    console.print(f"base {m['name']} ({m['path']}) on {m['device']}, pid {m['pid']}; pool {pool['total_pages']} "
                  f"pages x {human_bytes(pool['page_bytes'])}: {pool['adapter_pages']} adapter pages, {pool['kv_pages']} "
                  f"KV, {pool['cached_pages']} cached, {pool['free_pages']} free", soft_wrap=True)
    if not view["adapters"]:
        err_console.print(f"no adapter in the pool, the host cache or in use ({view['other_adapters']} registered, "
                          "on disk)", highlight=False)
        return
    table = Table(box=None, header_style="bold")
    for col in ("NAME", "TIER", "RANK", "PAGES", "SIZE", "RUNNING", "WAITING", "LAST USED"):
        table.add_column(col, justify="right" if col in ("RANK", "PAGES", "SIZE", "RUNNING", "WAITING") else "left")
    for r in view["adapters"]:
        table.add_row(r["name"], r["tier"] + (" (error)" if r["error"] else ""), ranks_text(r),
                      str(r["pages"]) if r["tier"] == "device" else "-",
                      human_bytes(r["bytes"]) if r["tier"] == "device" else "-",
                      str(r["running"]), str(r["waiting"]), last_used(r))
    console.print(table)
    if view["other_adapters"] > 0:
        err_console.print(f"{view['other_adapters']} more adapters registered, on disk (`lorafleet adapters ls`)",
                          highlight=False)
