"""`lorafleet top`: a live view of one daemon's page pool, adapters and switch cost.

The app reads snapshots from `source` (the CLI passes `Client.stats`: `/v1/stats`, the JSON
`lorafleet status --json` prints) on a thread worker, every `interval` seconds, so a slow or
vanished daemon never blocks the screen. When nothing answers before the first snapshot it
says how to start a daemon and keeps trying; when a daemon it was showing goes away it keeps
the last picture, says "reconnecting" and carries on when one answers again (a restarted
daemon starts its rates afresh: `model.History`).

Keys: `p` pause (stop polling, freeze the picture), `q` quit, `?` help, `/` filter the adapters
by name, `s`/`S` sort by the next column / reverse, Enter an adapter's detail, Tab between the
pool map and the table. `source=None` polls nothing: a test feeds snapshots through `ingest`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import cast

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.events import Resize
from textual.widgets import DataTable, Footer, Input, Static

from lorafleet.errors import DaemonUnreachableError, LorafleetError
from lorafleet.format import duration
from lorafleet.snapshot import Stats
from lorafleet.tui import model
from lorafleet.tui.screens import AdapterScreen, HelpScreen
from lorafleet.tui.widgets import PoolMap, Rates, SwitchPanel, owner_style

NOT_LORAFLEET = "what answers is not a lorafleet daemon (its /v1/stats lacks what a daemon reports)"
TIER_STYLE = {"device": "green", "host": "yellow", "disk": "grey50"}
NARROW = 100  # below this many columns the switches panel takes the table's place on `w`, not its side


class AdapterTable(DataTable):
    """The adapters table; a new width refits its columns (`model.fit_columns`)."""

    def on_resize(self, event: Resize) -> None:
        cast(TopApp, self.app).refit_table()  # the one app it lives in


class TopApp(App):
    CSS = """
    Screen { layout: vertical; }
    #status { height: 1; background: $boost; }
    #nodaemon { height: 1fr; content-align: center middle; text-align: center; display: none; }
    #body { height: 1fr; }
    #upper { height: 2fr; min-height: 9; max-height: 18; }
    #upper > * { border: round $primary-darken-2; padding: 0 1; }
    #pool-box { width: 1fr; }
    #rates-box { width: 1fr; }
    #lower { height: 3fr; }
    #table-box { width: 1fr; border: round $primary-darken-2; }
    #switches { width: 34; border: round $primary-darken-2; padding: 0 1; }
    #filter { dock: bottom; display: none; }
    DataTable { height: 1fr; }
    """
    BINDINGS = [
        Binding("q", "quit", "quit"), Binding("p", "pause", "pause"), Binding("question_mark", "help", "help"),
        Binding("slash", "filter", "filter"), Binding("s", "sort(1)", "sort"),
        Binding("S", "sort(0)", "reverse", show=False), Binding("w", "switches", "switches"),
    ]

    def __init__(self, source: Callable[[], Stats] | None, where: str, interval: float = 1.0):
        super().__init__()
        self.source, self.where, self.interval = source, where, interval
        self.history = model.History()
        self.stats: Stats | None = None
        self.rows: list[dict] = []
        self.paused = False
        self.error: str | None = None        # the last poll's failure, while it lasts
        self.unreachable = True              # ... nothing answered (else: the daemon refused)
        self.sort_key, self.sort_reverse = "running", True
        self.filter_text = ""
        self._wake = threading.Event()       # cuts the poller's sleep short (resume)
        self.columns: list[str] = []         # the table's columns now: those that fit whole
        self.show_switches = False           # narrow screens: the switches panel instead of the table

    # -- layout ------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Static(id="status")
        yield Static(id="nodaemon")
        with Vertical(id="body"):
            with Horizontal(id="upper"):
                with Vertical(id="pool-box"):
                    yield PoolMap(id="pool")
                with Vertical(id="rates-box"):
                    yield Rates(id="rates")
            with Horizontal(id="lower"):
                with Vertical(id="table-box"):
                    yield AdapterTable(id="adapters", cursor_type="row", zebra_stripes=True)
                    yield Input(placeholder="filter adapters by name", id="filter")
                yield SwitchPanel(id="switches")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#pool-box").border_title = "pool"
        self.query_one("#rates-box").border_title = "throughput · latency p50/p99"
        self.query_one("#table-box").border_title = "adapters"
        self.query_one("#switches").border_title = "switches"
        self.query_one("#adapters", DataTable).focus()
        self._draw_status()
        if self.source is not None:
            self.poll()

    # -- polling -----------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="poll")
    def poll(self) -> None:
        """Fetch a snapshot every `interval` seconds on this thread; hand each (or the error) to
        the UI thread. Paused: no fetch."""
        from textual.worker import get_current_worker

        worker = get_current_worker()
        assert self.source is not None  # polled only with one (`on_mount`)
        while not worker.is_cancelled:
            if not self.paused:
                try:
                    stats, error, unreachable = self.source(), None, False
                except LorafleetError as e:
                    stats, error, unreachable = None, str(e), isinstance(e, DaemonUnreachableError)
                if worker.is_cancelled:
                    return
                self.call_from_thread(self.ingest, stats, error, unreachable)
            # sleep `interval` in short waits: a cancelled worker (the app quitting) ends
            # within 0.1 s, and a resume (`_wake`) polls at once
            until = time.monotonic() + self.interval
            while not worker.is_cancelled and (left := until - time.monotonic()) > 0:
                if self._wake.wait(min(left, 0.1)):
                    break
            self._wake.clear()

    def ingest(self, stats: Stats | None, error: str | None = None, unreachable: bool = True) -> None:
        """A snapshot arrives, or the error in its place (`unreachable`: nothing answered, rather
        than a daemon that refused, say a wrong API key): redraw what it changes. The widgets live
        from mount to close, so one missing means the app is closing while a fetch was under way:
        that snapshot is dropped."""
        try:
            self._ingest(stats, error, unreachable)
        except NoMatches:
            pass

    def _ingest(self, stats: Stats | None, error: str | None, unreachable: bool) -> None:
        if stats is not None:
            try:
                model.check_snapshot(stats)
            except (KeyError, TypeError, ValueError, AttributeError, IndexError):  # something else answered
                stats, error, unreachable = None, NOT_LORAFLEET, True
        self.error, self.unreachable = error, unreachable
        if stats is not None:
            self.stats = stats
            self.history.add(stats)
            self._draw(stats)
        self._draw_status()

    # -- drawing -----------------------------------------------------------------------
    def _draw_status(self) -> None:
        nodaemon, body = self.query_one("#nodaemon", Static), self.query_one("#body")
        never = self.stats is None
        nodaemon.display = never and self.error is not None
        body.display = not nodaemon.display
        if nodaemon.display and not self.unreachable:
            nodaemon.update(Text.assemble(
                ("The daemon refused to show its stats.\n\n", "bold"), f"{self.error}\n\n",
                (f"Trying again every {self.interval:g}s; q quits.", "dim")))
        elif nodaemon.display:
            nodaemon.update(Text.assemble(
                ("No lorafleet daemon answers.\n\n", "bold"), f"{self.error}\n\n",
                "`lorafleet serve` serves the demo fleet, `lorafleet serve MODEL` a model of yours;\n"
                "add --detach to keep it running in the background.\n\n",
                (f"Trying again every {self.interval:g}s; q quits.", "dim")))
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(" lorafleet top ", style="bold reverse")
        if self.stats is not None:
            srv = self.stats["server"]
            line.append(f" {srv['model']} · pid {srv['pid']} · up {duration(srv['uptime_s'])} · ")
        else:
            line.append(f" {self.where} · ")
        if self.paused:
            line.append("PAUSED (p resumes)", style="bold yellow")
        elif self.error is not None and not self.unreachable:
            line.append(f"refused: {self.error}", style="bold red")
        elif self.error is not None and not never:
            line.append(f"reconnecting to {self.where}…", style="bold red")
        elif self.stats is not None:
            state = "draining" if self.stats["server"]["draining"] else "live"
            line.append(f"{state}, every {self.interval:g}s", style="green")
        elif self.error is not None:
            line.append("waiting for a daemon", style="bold yellow")
        else:
            line.append("connecting…", style="dim")
        self.query_one("#status", Static).update(line)

    def _draw(self, stats: Stats) -> None:
        eng = stats["engine"]
        self.query_one(PoolMap).show(eng["pool"])
        self.query_one(Rates).show(self.history)
        self.query_one(SwitchPanel).show(eng["switches"])
        self.rows = model.adapter_rows(eng)
        self._draw_table(stats)
        if isinstance(self.screen, AdapterScreen):
            self.screen.show(self._row(self.screen.adapter))

    def _sort_label(self) -> str:
        label = next(c.label for c in model.COLUMNS if c.key == self.sort_key)
        return f"{label} {'↓' if self.sort_reverse else '↑'}"

    def _row(self, name: str) -> dict | None:
        return next((r for r in self.rows if r["name"] == name), None)

    def _draw_table(self, stats: Stats) -> None:
        """The rows, in the columns that fit whole (the rest: Enter, the adapter's detail)."""
        table = self.query_one("#adapters", DataTable)
        selected = self.selected_adapter()
        rows = model.sort_rows(model.filter_rows(self.rows, self.filter_text), self.sort_key, self.sort_reverse)
        texts = [model.cell_texts(r) for r in rows]
        width = table.size.width - table.styles.scrollbar_size_vertical  # the scrollbar's, whether shown or not
        columns = model.fit_columns(texts, width, table.cell_padding) if width > 0 else model.COLUMNS
        table.clear(columns=[c.key for c in columns] != self.columns)
        if [c.key for c in columns] != self.columns:
            for col in columns:
                table.add_column(col.label, key=col.key)
            self.columns = [c.key for c in columns]
        for r, t in zip(rows, texts):
            style = {"name": owner_style(r["name"]), "tier": TIER_STYLE[r["tier"]]}
            table.add_row(*(Text(t[k], style=style[k]) if k in style else t[k] for k in self.columns), key=r["name"])
        if selected is not None and selected in table.rows:
            table.move_cursor(row=table.get_row_index(selected), animate=False)
        self.query_one(PoolMap).highlight = self.selected_adapter()
        hidden = len(model.COLUMNS) - len(self.columns)
        mixes, alora = model.mix_summary(stats["engine"]), model.alora_summary(stats["engine"])
        box = self.query_one("#table-box")
        # in the order shown; what does not fit the border goes, least wanted first (aLoRA, mixes, count)
        parts = [(3, f"{len(self.rows)} known"), (1, f"sorted by {self._sort_label()}"), (4, mixes), (5, alora),
                 (0, f"filter '{self.filter_text}'" if self.filter_text else ""),
                 (2, f"{hidden} more: Enter" if hidden else "")]
        parts = [p for p in parts if p[1]]
        room = (box.size.width or 10**6) - 6  # before the first layout: all of it
        while len(parts) > 1 and len(" · ".join(t for _, t in parts)) > room:
            parts.remove(max(parts))
        box.border_subtitle = " · ".join(t for _, t in parts)

    def refit_table(self) -> None:
        if self.stats is not None:
            self._draw_table(self.stats)

    def on_resize(self, event: Resize) -> None:
        self._place_switches(event.size.width)

    def _place_switches(self, width: int) -> None:
        """Beside the table on a wide screen; on a narrow one, in the table's place while `w` says."""
        narrow = width < NARROW
        self.query_one("#switches").display = not narrow or self.show_switches
        self.query_one("#table-box").display = not narrow or not self.show_switches

    def selected_adapter(self) -> str | None:
        table = self.query_one("#adapters", DataTable)
        if not table.row_count:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    # -- actions -----------------------------------------------------------------------
    def action_pause(self) -> None:
        self.paused = not self.paused
        if not self.paused:
            self._wake.set()  # poll now, not at the end of the sleep
        self._draw_status()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_switches(self) -> None:
        self.show_switches = not self.show_switches
        self._place_switches(self.size.width)

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        box.focus()

    def action_sort(self, advance: int) -> None:
        if advance:
            keys = model.COLUMN_KEYS
            self.sort_key = keys[(keys.index(self.sort_key) + 1) % len(keys)]
            self.sort_reverse = next(c.numeric for c in model.COLUMNS if c.key == self.sort_key)
        else:
            self.sort_reverse = not self.sort_reverse
        self._redraw_table()

    def _redraw_table(self) -> None:
        if self.stats is not None:
            self._draw(self.stats)

    # -- events ------------------------------------------------------------------------
    @on(DataTable.HeaderSelected)
    def sort_by_header(self, event: DataTable.HeaderSelected) -> None:
        key = event.column_key.value
        assert key is not None  # every column is added with its key
        if key == self.sort_key:
            self.sort_reverse = not self.sort_reverse
        else:
            self.sort_key = key
            self.sort_reverse = next(c.numeric for c in model.COLUMNS if c.key == key)
        self._redraw_table()

    @on(DataTable.RowHighlighted)
    def highlight_pages(self, event: DataTable.RowHighlighted) -> None:
        self.query_one(PoolMap).highlight = event.row_key.value if event.row_key is not None else None

    @on(DataTable.RowSelected)
    def open_detail(self, event: DataTable.RowSelected) -> None:
        name = event.row_key.value
        assert name is not None  # every row is added with its adapter's name
        self.push_screen(AdapterScreen(name, self._row(name)))

    @on(Input.Changed, "#filter")
    def filter_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value
        self._redraw_table()

    @on(Input.Submitted, "#filter")
    def filter_done(self, event: Input.Submitted) -> None:
        self._close_filter()

    def on_key(self, event) -> None:
        # Esc drops the filter, typed or kept (as less and htop do); Enter keeps it, named in the
        # table's subtitle, with the box out of the way
        box = self.query_one("#filter", Input)
        if event.key == "escape" and len(self.screen_stack) == 1 and (box.has_focus or self.filter_text):
            event.stop()
            box.value = ""  # its Input.Changed clears the filter and redraws (`filter_changed`)
            self._close_filter()

    def _close_filter(self) -> None:
        self.query_one("#filter", Input).display = False
        self.query_one("#adapters", DataTable).focus()
