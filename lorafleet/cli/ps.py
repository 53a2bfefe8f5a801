"""`lorafleet ps`: what the daemon holds where, as `ollama ps` shows it: the base model, then one
row per adapter on the device tier (pool pages) or the host tier, or with requests running or
waiting (one that waits for its load may still be on disk). Read from `/v1/stats`: its
`adapter_details` (every adapter not on disk, or ever asked for) and `lora` (requests per adapter)."""

from __future__ import annotations

from lorafleet.cli.common import (ApiKeyOption, JsonOption, SocketOption, UrlOption, client, duration, err_console,
                                  fail, human_bytes, out_console, print_json, ranks_text, user_errors)

TIERS = ("device", "host", "disk")  # the rows' order: what serves now first


def ps(socket: SocketOption = None, url: UrlOption = None, api_key: ApiKeyOption = None,
       as_json: JsonOption = False) -> None:
    """Show what is loaded where: the base model, then each adapter in the pool (device) or the
    host cache, or in use, with its rank, pages, requests and when it was last used."""
    with user_errors(), client(socket, url, api_key) as c:
        stats = c.stats()
        where = c.where
    try:
        view = snapshot(stats)
    except (KeyError, TypeError, ValueError, AttributeError):  # stats of something else than lorafleet
        raise fail(f"what answers at {where} is not a lorafleet daemon (its /v1/stats lacks what a daemon "
                   "reports)", 3) from None
    if as_json:
        return print_json(view)
    _print(view)


def snapshot(stats: dict) -> dict:
    """{"model": the base and the pool, "adapters": rows (device, host, then disk; by name),
    "other_adapters": how many more the daemon knows, idle on disk}."""
    srv, eng = stats["server"], stats["engine"]
    pool, lora = eng["pool"], eng.get("lora") or {}
    running, waiting = lora.get("running") or {}, lora.get("waiting") or {}
    rows = []
    for name, a in eng["adapter_details"].items():
        run, wait = running.get(name, 0), waiting.get(name, 0)
        if a["tier"] not in ("device", "host") and not (run or wait):
            continue
        rows.append({"name": name, "tier": a["tier"], "rank": max(a["ranks"].values(), default=None),
                     "ranks": a["ranks"], "pages": a["pages"], "bytes": a["pages"] * pool["page_bytes"],
                     "running": run, "waiting": wait, "in_use": bool(a["users"] or run),
                     "idle_s": a.get("idle_s"), "error": a.get("error")})
    rows.sort(key=lambda r: (TIERS.index(r["tier"]) if r["tier"] in TIERS else len(TIERS), r["name"]))
    model = {"name": srv["model"], "path": srv["model_path"], "device": eng["device"], "pid": srv["pid"],
             "pool": {k: pool[k] for k in ("total_pages", "page_bytes", "kv_pages", "cached_pages",
                                           "adapter_pages", "free_pages")}}
    return {"model": model, "adapters": rows, "other_adapters": eng["num_adapters"] - len(rows)}


def last_used(row: dict) -> str:
    if row["in_use"]:
        return "now"
    if row["idle_s"] is None:  # never ran, or a daemon that does not report it
        return "-"
    return "<1s ago" if row["idle_s"] < 1 else f"{duration(row['idle_s'])} ago"


def _print(view: dict) -> None:
    from rich.table import Table

    m, pool = view["model"], view["model"]["pool"]
    console = out_console()
    console.print(f"base {m['name']} ({m['path']}) on {m['device']}, pid {m['pid']}; pool {pool['total_pages']} "
                  f"pages x {human_bytes(pool['page_bytes'])}: {pool['adapter_pages']} adapters, {pool['kv_pages']} "
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
