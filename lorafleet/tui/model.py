"""What `lorafleet top` shows, computed from `/v1/stats` snapshots: pure functions and one
history, no Textual, so the numbers are tested apart from the screen.

Everything comes from the snapshot (`Client.stats()`, the same JSON `lorafleet status --json`
prints); rates are differences of the engine's counters between two snapshots over the
daemon's own clock (`server.uptime_s`), so a replayed stream draws the same screen.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rich.cells import cell_len

from lorafleet.format import ranks_text
from lorafleet.snapshot import EngineSnapshot, PageRun, PoolStats, Stats

HISTORY = 600  # samples kept per series: 10 minutes at one poll per second

# pool map owner classes, in the order the legend lists them
FREE, KV, CACHED, ADAPTER = "free", "kv", "cached", "adapter"


def owner_class(label: str) -> str:
    """A page owner's class: `page_map` labels are free / kv / cached or an adapter's name."""
    return label if label in (FREE, KV, CACHED) else ADAPTER


@dataclass(frozen=True)
class Cell:
    """One cell of the pool map: pages [first, first + count) and their owners by pages, the
    largest first. `label`, what the cell shows, is its largest owner other than free when it
    has one: in a large pool a cell spans many pages, and a few adapter pages among free ones
    must still show; `dense` says whether that owner holds at least half the cell."""

    first: int
    count: int
    owners: tuple[tuple[str, int], ...]

    @property
    def label(self) -> str:
        return next((label for label, _ in self.owners if label != FREE), FREE)

    @property
    def dense(self) -> bool:
        return 2 * dict(self.owners)[self.label] >= self.count


def pool_cells(page_map: list[PageRun], num_cells: int) -> list[Cell]:
    """Group the pool's pages (`pool.page_map`: runs of [label, pages] in page order) into at
    most `num_cells` cells of equal page counts (the last may hold fewer): one page per cell when
    they fit. O(runs + cells)."""
    total = sum(n for _, n in page_map)
    if total == 0 or num_cells < 1:
        return []
    per_cell = max(1, math.ceil(total / num_cells))
    cells: list[Cell] = []
    owners: dict[str, int] = {}
    first = filled = 0
    for label, n in page_map:
        while n:
            take = min(n, per_cell - filled)
            owners[label] = owners.get(label, 0) + take
            filled += take
            n -= take
            if filled == per_cell:
                cells.append(_cell(first, filled, owners))
                first, filled, owners = first + filled, 0, {}
    if filled:
        cells.append(_cell(first, filled, owners))
    return cells


def _cell(first: int, count: int, owners: dict[str, int]) -> Cell:
    return Cell(first, count, tuple(sorted(owners.items(), key=lambda kv: (-kv[1], kv[0]))))


def pool_totals(pool: PoolStats) -> dict[str, float]:
    """Share of the pool's pages per owner class (0..1)."""
    total = pool["total_pages"] or 1
    return {FREE: pool["free_pages"] / total, KV: pool["kv_pages"] / total,
            CACHED: pool["cached_pages"] / total, ADAPTER: pool["adapter_pages"] / total}


# -- the adapters table ------------------------------------------------------------------------

@dataclass(frozen=True)
class Column:
    key: str
    label: str
    numeric: bool = True
    keep: int = 0  # a narrow screen drops whole columns, the highest `keep` first, never cuts one


COLUMNS = (
    Column("name", "adapter", numeric=False, keep=0), Column("tier", "tier", numeric=False, keep=1),
    Column("rank", "rank", keep=2), Column("pages", "pages", keep=5), Column("running", "run", keep=3),
    Column("waiting", "wait", keep=4), Column("hits", "hits", keep=9), Column("misses", "miss", keep=8),
    Column("loads", "loads", keep=10), Column("load_p50", "load p50", keep=11),
    Column("load_p99", "load p99", keep=7), Column("stall_p99", "stall p99", keep=6),
)
COLUMN_KEYS = tuple(c.key for c in COLUMNS)
TIER_ORDER = {"device": 0, "host": 1, "disk": 2}


def adapter_rows(engine: EngineSnapshot) -> list[dict]:
    """One row per adapter the daemon knows: the table's columns as raw values (None: not
    measured yet; `rank` its largest), plus `ranks_text` (one rank or a range, as `adapters ls`
    shows it) and the adapter's record as `info` (None for an untouched adapter: registered on
    disk, never asked for, known by name only)."""
    running, waiting = engine["lora"]["running"], engine["lora"]["waiting"]
    rows: list[dict[str, Any]] = [
        {"name": name, "tier": "disk", "rank": None, "ranks_text": "-", "pages": 0, "running": 0, "waiting": 0,
         "hits": 0, "misses": 0, "loads": 0, "load_p50": None, "load_p99": None, "stall_p99": None,
         "info": None} for name in engine["untouched_adapters"]]
    for name, info in engine["adapter_details"].items():
        rows.append({
            "name": name, "tier": info["tier"], "rank": max(info["ranks"].values(), default=None),
            "ranks_text": ranks_text(info),
            "pages": info["pages"], "running": running.get(name, 0), "waiting": waiting.get(name, 0),
            "hits": info["hits"], "misses": info["misses"], "loads": info["loads"],
            "load_p50": info["load_s"]["p50"], "load_p99": info["load_s"]["p99"],
            "stall_p99": info["stall_s"]["p99"], "info": info,
        })
    return rows


def cell_texts(row: dict) -> dict[str, str]:
    """A row's cells as the table prints them, by column key."""
    return {"name": row["name"], "tier": row["tier"], "rank": row["ranks_text"], "pages": str(row["pages"]),
            "running": str(row["running"]), "waiting": str(row["waiting"]), "hits": str(row["hits"]),
            "misses": str(row["misses"]), "loads": str(row["loads"]), "load_p50": ms(row["load_p50"]),
            "load_p99": ms(row["load_p99"]), "stall_p99": ms(row["stall_p99"])}


def fit_columns(texts: list[dict[str, str]], width: int, padding: int = 1) -> list[Column]:
    """The columns that fit `width` cells whole (each as wide as its label or its widest cell, plus
    `padding` on both sides), kept in `keep` order, in the table's order; the adapter's name
    always. What does not fit is in the adapter's detail (Enter)."""
    def need(c: Column) -> int:
        return max([cell_len(c.label)] + [cell_len(t[c.key]) for t in texts]) + 2 * padding

    kept: set[str]
    kept, used = set(), 0
    for c in sorted(COLUMNS, key=lambda c: c.keep):
        if kept and used + need(c) > width:
            break
        kept.add(c.key)
        used += need(c)
    return [c for c in COLUMNS if c.key in kept]


def wrap_items(items: list[str], width: int) -> list[list[str]]:
    """`items` grouped into lines of at most `width` cells, space-separated, breaking only between
    items (an item wider than the line gets a line of its own): a legend never loses a number."""
    lines: list[list[str]] = []
    used = 0
    for item in items:
        if lines and used + 1 + cell_len(item) <= width:
            lines[-1].append(item)
            used += 1 + cell_len(item)
        else:
            lines.append([item])
            used = cell_len(item)
    return lines


def sort_rows(rows: list[dict], key: str, reverse: bool) -> list[dict]:
    """Rows by `key` (unmeasured values last either way), ties by name."""
    if key == "name":
        return sorted(rows, key=lambda r: r["name"], reverse=reverse)
    by_name = sorted(rows, key=lambda r: r["name"])

    def value(r):
        v = r[key]
        return TIER_ORDER.get(v, 3) if key == "tier" else v

    measured = [r for r in by_name if r[key] is not None]
    return sorted(measured, key=value, reverse=reverse) + [r for r in by_name if r[key] is None]


def mix_summary(engine: EngineSnapshot) -> str:
    """The mixes (requests on several adapters) in a few words: running and waiting now, and
    the requests so far with their mean size; "" before the first. Their adapters' rows count
    them too (a mix runs on each of them)."""
    m = engine["mixes"]
    if not m["requests"]:
        return ""
    return (f"mixes: {m['running']} running, {m['waiting']} waiting, {m['requests']} so far "
            f"({m['adapters'] / m['requests']:.1f} adapters each)")


def alora_summary(engine: EngineSnapshot) -> str:
    """aLoRA requests so far and the prompt tokens the prefix cache served them; "" before the first."""
    a = engine["alora"]
    return f"aLoRA: {a['requests']} so far, {a['reused_tokens']} prompt tokens reused" if a["requests"] else ""


def filter_rows(rows: list[dict], text: str) -> list[dict]:
    """Rows whose name contains `text` (case-insensitive); all of them for no text."""
    text = text.strip().lower()
    return [r for r in rows if text in r["name"].lower()] if text else rows


def ms(seconds: float | None) -> str:
    """Seconds as milliseconds for a narrow column ('-': not measured)."""
    if seconds is None:
        return "-"
    v = seconds * 1e3
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


# -- the time series ---------------------------------------------------------------------------

RATE_WINDOW_S = 10.0  # the rate labels' window: long enough that bursty steps do not read as 0
SERIES = ("tokens_per_s", "requests_per_s", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "queue")


@dataclass
class History:
    """Series over the recent snapshots. Rates need two snapshots of the same daemon: a new pid
    or a clock that went back (a restarted daemon) starts the rates afresh; the other series
    go on."""

    maxlen: int = HISTORY
    series: dict[str, deque] = field(default_factory=dict)
    last: Stats | None = None
    # (uptime, generated tokens, finished requests) of this daemon's recent snapshots: the labels'
    # rates, over RATE_WINDOW_S rather than the last second (bursty steps make that one 0 often)
    counters: deque = field(default_factory=lambda: deque(maxlen=HISTORY))

    def __post_init__(self):
        self.series = {k: deque(maxlen=self.maxlen) for k in SERIES}

    def add(self, stats: Stats) -> None:
        srv, eng = stats["server"], stats["engine"]
        prev = self.last
        self.last = stats
        same = (prev is not None and prev["server"]["pid"] == srv["pid"]
                and srv["uptime_s"] > prev["server"]["uptime_s"])
        if not same:
            self.counters.clear()
        self.counters.append((srv["uptime_s"], eng["num_generated_tokens"], eng["num_requests_finished"]))
        if same and prev is not None:
            dt = srv["uptime_s"] - prev["server"]["uptime_s"]
            pe = prev["engine"]
            self.series["tokens_per_s"].append(
                (eng["num_generated_tokens"] - pe["num_generated_tokens"]) / dt)
            self.series["requests_per_s"].append(
                (eng["num_requests_finished"] - pe["num_requests_finished"]) / dt)
        for key, window in (("ttft", eng["ttft_s"]), ("tpot", eng["tpot_s"])):
            for q, v in (("p50", window["p50"]), ("p99", window["p99"])):
                self.series[f"{key}_{q}"].append(v * 1e3 if v is not None else 0.0)
        self.series["queue"].append(float(eng["num_waiting"]))

    def latest(self, key: str) -> float | None:
        s = self.series[key]
        return s[-1] if s else None

    def recent_rate(self, key: str, window_s: float = RATE_WINDOW_S) -> float | None:
        """`tokens_per_s` or `requests_per_s` over the last `window_s` seconds of this daemon's
        snapshots (fewer where it has not run that long); None before two snapshots."""
        if len(self.counters) < 2:
            return None
        now = self.counters[-1]
        then = next((c for c in self.counters if c[0] >= now[0] - window_s), self.counters[0])
        if then is now:
            then = self.counters[-2]
        i = 1 if key == "tokens_per_s" else 2
        return (now[i] - then[i]) / (now[0] - then[0])


def check_snapshot(stats: Stats) -> None:
    """Raise (KeyError, TypeError, ValueError...) unless `stats` has every part the screen reads:
    an answer that is not a lorafleet daemon's /v1/stats, taken apart before anything is drawn."""
    History().add(stats)
    eng = stats["engine"]
    adapter_rows(eng)
    mix_summary(eng), alora_summary(eng)
    list(eng["pool"]["page_map"])
    switches = eng["switches"]
    switches["loaded_per_step"], switches["regression"], switches["window_steps"]

