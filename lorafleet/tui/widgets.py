"""The panels of `lorafleet top`: the pool map, the rates, the switch panel.

Each takes the latest snapshot through `show(...)` and draws itself with Rich text; none polls.
"""

from __future__ import annotations

import hashlib

from rich.text import Text
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Sparkline, Static

from lorafleet.format import human_bytes
from lorafleet.snapshot import PageRun, PoolStats, Switches
from lorafleet.tui import model
from lorafleet.tui.model import ADAPTER, CACHED, FREE, KV

CLASS_STYLE = {FREE: "grey35", KV: "dodger_blue1", CACHED: "cyan3"}
CLASS_GLYPH = {FREE: "·", KV: "█", CACHED: "▒", ADAPTER: "█"}
SPARSE_GLYPH = "▪"  # a cell whose owner holds less than half its pages (the rest mostly free)
# adapters: a colour per name, stable across runs and machines (not Python's salted hash)
ADAPTER_PALETTE = ("orange1", "green3", "magenta2", "gold1", "salmon1", "chartreuse3", "orchid1",
                   "dark_orange3", "spring_green2", "hot_pink2", "yellow3", "light_coral")


def adapter_style(name: str) -> str:
    digest = hashlib.blake2s(name.encode(), digest_size=2).digest()
    return ADAPTER_PALETTE[int.from_bytes(digest, "big") % len(ADAPTER_PALETTE)]


def owner_style(label: str) -> str:
    cls = model.owner_class(label)
    return adapter_style(label) if cls == ADAPTER else CLASS_STYLE[cls]


class PoolMap(Widget, can_focus=True):
    """Every page of the unified pool, or groups of pages when they outnumber the cells, coloured
    by owner (a cell's largest owner that is not free: `model.Cell.label`; drawn small when it
    holds under half the cell): free, KV, cached KV, or an adapter (a colour per name).
    Arrow keys move a cursor whose cell's pages and owners the last line names; the adapter
    selected in the table is drawn inverted wherever it holds pages."""

    BINDINGS = [Binding("left", "move(-1, 0)", show=False), Binding("right", "move(1, 0)", show=False),
                Binding("up", "move(0, -1)", show=False), Binding("down", "move(0, 1)", show=False)]
    DEFAULT_CSS = """
    PoolMap { height: 1fr; min-height: 3; }
    """
    cursor: reactive[int] = reactive(0)
    highlight: reactive[str | None] = reactive(None)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.page_map: list[PageRun] = []
        self.pool: PoolStats | None = None

    def show(self, pool: PoolStats) -> None:
        self.pool = pool
        self.page_map = pool["page_map"]
        self.refresh()

    def _grid(self) -> tuple[int, int]:
        """Cells per line and lines of cells: what the legend and the cursor's line leave. When the
        pages outnumber the cells, the legend says how many a cell holds (sized for the most)."""
        width = max(1, self.size.width)
        rows = self.size.height - len(self._legend(width, 1)) - 1
        if self.pool is not None and self.pool["total_pages"] > width * max(1, rows):
            rows = self.size.height - len(self._legend(width, self.pool["total_pages"])) - 1
        return width, max(1, rows)

    def _legend(self, width: int, per: int) -> list[list[tuple[str, str]]]:
        """The lines under the map: the pool's size (`per` pages a cell), then each owner class's
        share, as (text, style) items wrapped between items to `width`."""
        if self.pool is None:
            return []
        pool = self.pool
        size = [(f"{pool['total_pages']} pages", "bold"), (f"× {human_bytes(pool['page_bytes'])}", "bold"),
                (f"= {human_bytes(pool['total_pages'] * pool['page_bytes'])}", "bold")]
        if per > 1:
            size.append((f"({per} per cell)", "bold"))
        shares = model.pool_totals(pool)
        items = [(CLASS_GLYPH[cls] + f"{cls} {100 * shares[cls]:.0f}%", CLASS_STYLE.get(cls, "orange1"))
                 for cls in (FREE, KV, CACHED, ADAPTER)]
        lines = []
        for group in (size, items):
            by_text = dict(group)
            lines += [[(t, by_text[t]) for t in line] for line in model.wrap_items([t for t, _ in group], width)]
        return lines

    def cells(self) -> list[model.Cell]:
        width, rows = self._grid()
        return model.pool_cells(self.page_map, width * rows)

    def action_move(self, dx: int, dy: int) -> None:
        width, _ = self._grid()
        n = len(self.cells())
        if n:
            self.cursor = max(0, min(n - 1, self.cursor + dx + dy * width))

    def render(self) -> Text:
        if self.pool is None:
            return Text("waiting for the first snapshot…", style="dim")
        width, _ = self._grid()
        cells = self.cells()
        self.cursor = min(self.cursor, max(0, len(cells) - 1))
        out = Text(no_wrap=True, overflow="crop")
        for i, cell in enumerate(cells):
            if i and i % width == 0:
                out.append("\n")
            style = owner_style(cell.label)
            if self.highlight is not None and any(label == self.highlight for label, _ in cell.owners):
                style += " reverse"
            if i == self.cursor and self.has_focus:
                style = "bold white on red"
            out.append(CLASS_GLYPH[model.owner_class(cell.label)] if cell.dense else SPARSE_GLYPH, style=style)
        pool = self.pool
        for line in self._legend(width, cells[0].count if cells else 1):
            out.append("\n")
            for i, (text, style) in enumerate(line):
                out.append(" " if i else "")
                if style == "bold":
                    out.append(text, style=style)
                else:  # a share: its glyph in the owner's colour, the words plain
                    out.append(text[0], style=style)
                    out.append(text[1:])
        out.append("\n")
        if cells and self.has_focus:
            cell = cells[self.cursor]
            owners = ", ".join(f"{label} {n}" for label, n in cell.owners)
            last = cell.first + cell.count - 1
            out.append(f"page{'s' if cell.count > 1 else ''} {cell.first}"
                       f"{f'-{last}' if cell.count > 1 else ''}: {owners}", style="italic")
        elif self.highlight is not None:
            out.append(f"{self.highlight}: {pool['pages_by_adapter'].get(self.highlight, 0)} pages (inverted)",
                       style="italic")
        else:
            out.append("tab here, then arrows: a cell's pages and owners", style="dim italic")
        return out


class Rates(Vertical):
    """Throughput and latency over the recent snapshots: a line per series, its latest value
    and a sparkline."""

    DEFAULT_CSS = """
    Rates { height: 1fr; }
    Rates Horizontal { height: 1; }
    Rates .label { width: 21; }
    Rates Sparkline { width: 1fr; }
    """
    LINES = (("tokens_per_s", "tok/s"), ("requests_per_s", "req/s"), ("ttft_p99", "TTFT"),
             ("tpot_p99", "TPOT"), ("queue", "queue"))

    def compose(self):
        for key, _ in self.LINES:
            with Horizontal():
                yield Static(classes="label", id=f"label-{key}")
                yield Sparkline([], id=f"spark-{key}")

    def show(self, history: model.History) -> None:
        s = history.series
        for key, name in self.LINES:
            data = list(s[key])
            if key == "ttft_p99":
                text = f"{name} {_num(history.latest('ttft_p50'))}/{_num(history.latest('ttft_p99'))} ms"
            elif key == "tpot_p99":
                text = f"{name} {_num(history.latest('tpot_p50'))}/{_num(history.latest('tpot_p99'))} ms"
            elif key in ("tokens_per_s", "requests_per_s"):
                text = f"{name} {_num(history.recent_rate(key))} ({model.RATE_WINDOW_S:g}s)"
            else:
                text = f"{name} {_num(history.latest(key))}"
            self.query_one(f"#label-{key}", Static).update(text)
            self.query_one(f"#spark-{key}", Sparkline).data = data


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}" if abs(v) < 1000 else f"{v:.0f}"


class SwitchPanel(Static):
    """Switches per step (adapters loaded for it) over the engine's recent steps, and per-token
    latency against them with the fitted slope: the switch regression, live (`switches` in
    /v1/stats, `engine/regression.py`)."""

    def show(self, switches: Switches) -> None:
        out = Text(no_wrap=True, overflow="crop")
        n = switches["window_steps"]
        out.append(f"loads per step (last {n})\n", style="bold")
        hist = switches["loaded_per_step"]
        top = max((c for _, c in hist), default=0)
        bar_width = max(4, self.size.width - 14)
        for k, count in hist[:6]:
            bar = "█" * max(1, round(bar_width * count / top)) if count else ""
            out.append(f"{k:>2} ", style="bold")
            out.append(bar, style="orange1")
            out.append(f" {count}\n")
        if len(hist) > 6:
            out.append(f"   … up to {hist[-1][0]}\n", style="dim")
        reg = switches["regression"]
        out.append("per-token ms by loads, p50\n", style="bold")
        if reg is None:
            out.append("no steps yet\n", style="dim")
        else:
            for row in reg["table"][:5]:
                out.append(f"{row['adapters_loaded']:>2}  {row['per_token_ms_p50']:.3f} ms ({row['steps']} st)\n")
            slope, ci, fraction = reg["slope_s"], reg["slope_ci_s"], reg["slope_fraction"]
            if slope is not None and ci is not None and fraction is not None:  # fitted together
                lo, hi = ci
                out.append(f"slope {slope * 1e3:+.4f} ms/token ({lo * 1e3:+.4f} to {hi * 1e3:+.4f})\n", style="bold")
                out.append(f"per adapter: {100 * fraction:+.1f}% of a token",
                           style="bold red" if fraction > 0.02 else "bold green")
            else:
                out.append(reg.get("note", "no slope yet"), style="dim")
        self.update(out)

