"""The screens `lorafleet top` opens over its main one: the help, and one adapter's record."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from lorafleet.tui import model
from lorafleet.tui.widgets import owner_style

HELP = """\
[b]lorafleet top[/b]: pool, adapters and switch cost, from /v1/stats

[b]p[/b]        pause / resume (no polling while paused)
[b]q[/b]        quit
[b]?[/b]        this help
[b]/[/b]        filter the adapters by name (Enter keeps it, Esc drops it)
[b]s[/b] [b]S[/b]      sort by the next column / reverse the order
         (or click a column's header)
[b]Enter[/b]    the highlighted adapter's detail, every column (Esc closes)
[b]Tab[/b]      between the adapters table and the pool map
[b]w[/b]        the switches panel in the table's place (narrow screens)
[b]arrows[/b]   move in the table, or over the pool map's cells

Pool map: · free, [dodger_blue1]█[/] KV, [cyan3]▒[/] cached KV, a colour per
adapter; the highlighted adapter's pages are inverted.
Rates: per second of the daemon's clock.
Switches: adapters loaded per step, and per-token latency
against them with the slope fitted within step shape
(the engine's last 1,000 steps).

Esc closes this help."""


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,question_mark,q", "app.pop_screen", "close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 66; height: auto; max-height: 90%;
                                  border: round $accent; background: $surface; padding: 0 1; }
    """

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(HELP)


class AdapterScreen(ModalScreen):
    """One adapter's record: what the table shows and the rest of it (digest, path, per-module
    ranks, evictions, totals), refreshed with each snapshot while open."""

    BINDINGS = [Binding("escape,enter", "app.pop_screen", "close")]
    DEFAULT_CSS = """
    AdapterScreen { align: center middle; }
    AdapterScreen > VerticalScroll { width: 90%; max-width: 96; height: auto; max-height: 90%;
                                     border: round $accent; background: $surface; padding: 0 1; }
    """

    def __init__(self, name: str, row: dict | None):
        super().__init__()
        self.adapter, self.row = name, row

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(id="detail")

    def on_mount(self) -> None:
        self.show(self.row)

    def show(self, row: dict | None) -> None:
        self.row = row
        out = Text()
        out.append(f"{self.adapter}\n", style=f"bold {owner_style(self.adapter)}")
        if row is None:
            out.append("no longer known to the daemon (unloaded or replaced)\n", style="italic")
        elif row["info"] is None:
            out.append("registered on disk and never asked for: its files are read on its first request\n"
                       "(`lorafleet adapters show NAME` prints where they are)\n", style="italic")
        else:
            info = row["info"]
            fields = [
                ("tier", row["tier"]), ("pinned", "yes" if info["pinned"] else "no"),
                ("ranks", ", ".join(f"{m} {r}" for m, r in sorted(info["ranks"].items())) or "-"),
                ("parameters", f"{info['params']:,}"), ("pages", str(info["pages"])),
                ("requests", f"{row['running']} running, {row['waiting']} waiting, {info['users']} holding it"),
                ("hits / misses", f"{info['hits']} / {info['misses']}"),
                ("loads", f"{info['loads']} from disk, {info['device_loads']} onto the device, "
                          f"{info['evictions']} evictions"),
                ("load time", f"p50 {model.ms(row['load_p50'])} ms, p99 {model.ms(row['load_p99'])} ms, "
                              f"{info['load_time_s']:.3f} s in all"),
                ("exposed stall", f"p50 {model.ms(info['stall_s']['p50'])} ms, p99 {model.ms(row['stall_p99'])} ms"),
                ("digest", info["digest"] or "(not read yet)"), ("path", info["path"]),
            ]
            if info["error"]:
                fields.append(("last error", info["error"]))
            for k, v in fields:
                out.append(f"{k:>14}  ", style="bold")
                out.append(f"{v}\n")
        out.append("Esc closes", style="dim")
        self.query_one("#detail", Static).update(out)
