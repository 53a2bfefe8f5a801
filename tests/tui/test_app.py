"""Pilot tests on the real `lorafleet top` app: keys, sorting, filtering, the detail view, the
pool map's cursor, pause, and a daemon that goes away and comes back."""

from __future__ import annotations

import copy

import pytest
from textual.widgets import DataTable, Input

from lorafleet.tui import model
from lorafleet.tui.app import AdapterScreen, HelpScreen, TopApp
from lorafleet.tui.widgets import PoolMap
from tests.tui.conftest import Source, text_of, until

SIZE = (80, 24)
pytestmark = pytest.mark.anyio


def known(engine: dict) -> dict[str, dict]:
    """Every adapter the snapshot names, as the table's columns read it: the detailed ones, and
    the untouched ones (disk, nothing measured)."""
    untouched = {"tier": "disk", "pages": 0, "hits": 0, "loads": 0, "load_s": {"p50": None}}
    return {**engine["adapter_details"], **{n: untouched for n in engine["untouched_adapters"]}}


def names(app) -> list[str]:
    table = app.query_one("#adapters", DataTable)
    return [str(table.get_row_at(i)[0]) for i in range(table.row_count)]


async def feed(app, pilot, snapshots) -> None:
    for s in snapshots:
        app.ingest(s)
    await pilot.pause()


async def test_quit_help_and_the_status_line(stream):
    app = TopApp(None, "/tmp/test.sock")
    async with app.run_test(size=SIZE) as pilot:
        await feed(app, pilot, stream)
        status = text_of(app.query_one("#status"))
        assert "tiny" in status and "pid 4242" in status and "live" in status
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        assert "pause" in text_of(app.screen.query_one("Static"))
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("q")
        await until(pilot, lambda: not app.is_running, what="quit")


async def test_sorting_by_key_by_reverse_and_by_header(stream):
    details = known(stream[-1]["engine"])
    assert stream[-1]["engine"]["untouched_adapters"], "the stream should hold untouched adapters"
    app = TopApp(None, "/tmp/test.sock")
    async with app.run_test(size=SIZE) as pilot:
        await feed(app, pilot, stream)
        # the default: adapters with running requests first (none now), then by name
        assert names(app) == sorted(details)
        # `s` walks the columns: to `pages` (descending for numbers), then `S` reverses it
        while app.sort_key != "pages":
            await pilot.press("s")
        by_pages = sorted(sorted(details), key=lambda n: -details[n]["pages"])
        assert names(app) == by_pages
        assert details[by_pages[0]]["pages"] > details[by_pages[-1]]["pages"], "the stream must vary"
        await pilot.press("S")
        assert names(app) == sorted(sorted(details), key=lambda n: details[n]["pages"])
        # a click on a header sorts by it; a second click reverses
        table = app.query_one("#adapters", DataTable)
        table.post_message(DataTable.HeaderSelected(table, table.columns["hits"].key, 6, table.columns["hits"].label))
        await pilot.pause()
        by_hits = sorted(sorted(details), key=lambda n: -details[n]["hits"])
        assert app.sort_key == "hits" and names(app) == by_hits
        table.post_message(DataTable.HeaderSelected(table, table.columns["hits"].key, 6, table.columns["hits"].label))
        await pilot.pause()
        assert names(app) == sorted(sorted(details), key=lambda n: details[n]["hits"])
        assert "hits ↑" in str(app.query_one("#table-box").border_subtitle)


async def test_tiers_and_measured_columns_match_the_snapshot(stream):
    details = known(stream[-1]["engine"])
    app = TopApp(None, "/tmp/test.sock")
    async with app.run_test(size=(160, 40)) as pilot:  # wide enough for every column
        await feed(app, pilot, stream)
        table = app.query_one("#adapters", DataTable)
        assert table.row_count == len(details) and app.columns == list(model.COLUMN_KEYS)
        for i in range(table.row_count):
            cells = dict(zip(app.columns, (str(c) for c in table.get_row_at(i))))
            info = details[cells["name"]]
            assert cells["tier"] == info["tier"]
            assert cells["pages"] == str(info["pages"])
            assert cells["loads"] == str(info["loads"])
            assert cells["load_p50"] == model.ms(info["load_s"]["p50"])
        tiers = {info["tier"] for info in details.values()}
        assert len(tiers) >= 2, "the recorded stream should hold adapters on more than one tier"


async def test_filter_narrows_the_table_and_keeps_the_keys_out_of_the_app(stream):
    app = TopApp(None, "/tmp/test.sock")
    async with app.run_test(size=SIZE) as pilot:
        await feed(app, pilot, stream)
        await pilot.press("slash")
        box = app.query_one("#filter", Input)
        assert box.has_focus
        await pilot.press("r", "1", "6")
        assert names(app) == ["law-r16", "sql-r16"]
        await pilot.press("q", "p")  # typed into the box: neither quits nor pauses
        assert app.is_running and not app.paused and names(app) == []
        await pilot.press("backspace", "backspace", "enter")
        assert app.query_one("#adapters", DataTable).has_focus and not box.display
        assert names(app) == ["law-r16", "sql-r16"]  # the filter stays after the box closes
        assert "filter 'r16'" in str(app.query_one("#table-box").border_subtitle)
        # later snapshots keep it
        app.ingest(stream[-1])
        await pilot.pause()
        assert names(app) == ["law-r16", "sql-r16"]
        await pilot.press("escape")  # Esc on the table drops a kept filter
        assert len(names(app)) == len(known(stream[-1]["engine"])) and not box.display
        assert "filter" not in str(app.query_one("#table-box").border_subtitle)
        await pilot.press("slash", "l", "a", "w", "escape")  # and, in the box, what was typed
        assert len(names(app)) == len(known(stream[-1]["engine"]))
        assert not box.display and box.value == "" and app.query_one("#adapters", DataTable).has_focus


async def test_the_tables_subtitle_fits_its_border_dropping_the_least_wanted_parts_first(stream):
    last = copy.deepcopy(stream[-1])
    last["engine"]["mixes"] = {"requests": 1200, "adapters": 3600, "by_size": {}, "running": 12, "waiting": 30}
    for size in [(200, 40), SIZE]:
        app = TopApp(None, "/tmp/test.sock")
        async with app.run_test(size=size) as pilot:
            await feed(app, pilot, stream[:-1] + [last])
            await pilot.press("slash", *"r1", "enter")
            app.ingest(last)
            await pilot.pause()
            box = app.query_one("#table-box")
            subtitle = str(box.border_subtitle)
            assert len(subtitle) <= box.size.width - 6
            assert "filter 'r1'" in subtitle and "sorted by" in subtitle  # what the table shows stays named
            hidden = len(model.COLUMNS) - len(app.columns)
            assert ("mixes: 12 running" in subtitle) == (size[0] == 200)  # the mixes' summary goes first
            assert (f"{hidden} more: Enter" in subtitle) == bool(hidden)


async def test_enter_opens_the_detail_of_the_highlighted_adapter(stream):
    last = stream[-1]["engine"]["adapter_details"]
    app = TopApp(None, "/tmp/test.sock")
    async with app.run_test(size=SIZE) as pilot:
        await feed(app, pilot, stream)
        await pilot.press("down", "down")
        name = names(app)[2]
        assert app.selected_adapter() == name
        await pilot.press("enter")
        assert isinstance(app.screen, AdapterScreen)
        detail = text_of(app.screen.query_one("#detail"))
        assert name in detail and last[name]["tier"] in detail
        if last[name]["digest"]:
            assert last[name]["digest"] in detail
        assert str(last[name]["path"]) in detail
        # it follows new snapshots while open: the adapter gone from the daemon says so
        gone = copy.deepcopy(stream[-1])
        del gone["engine"]["adapter_details"][name]
        app.ingest(gone)
        await pilot.pause()
        assert "no longer known" in text_of(app.screen.query_one("#detail"))
        await pilot.press("escape")
        assert not isinstance(app.screen, AdapterScreen)
        # an untouched adapter has nothing but its name to show
        spare = stream[-1]["engine"]["untouched_adapters"][0]
        while app.selected_adapter() != spare:
            await pilot.press("down")
        await pilot.press("enter")
        assert "never asked for" in text_of(app.screen.query_one("#detail"))


async def test_the_pool_map_names_the_owners_under_its_cursor(stream):
    pool = stream[-1]["engine"]["pool"]
    app = TopApp(None, "/tmp/test.sock")
    async with app.run_test(size=SIZE) as pilot:
        await feed(app, pilot, stream)
        pm = app.query_one(PoolMap)
        cells = pm.cells()
        assert sum(c.count for c in cells) == pool["total_pages"]
        totals = text_of(pm)
        assert f"{pool['total_pages']} pages" in totals
        assert f"free {100 * pool['free_pages'] / pool['total_pages']:.0f}%" in totals
        await pilot.press("tab")
        assert pm.has_focus
        for i in range(len(cells)):  # every cell, left to right: the line names its owner
            cell = cells[i]
            label = cell.owners[0][0]
            assert f"{label} {cell.owners[0][1]}" in text_of(pm).splitlines()[-1], (i, cell)
            await pilot.press("right")
        # selecting an adapter in the table marks its pages (drawn inverted)
        await pilot.press("tab")
        holder = next(n for n, pages in pool["pages_by_adapter"].items() if pages)
        while app.selected_adapter() != holder:
            await pilot.press("down")
        assert pm.highlight == holder


async def test_pause_stops_polling_and_resume_polls_at_once(stream):
    source = Source(stream)
    app = TopApp(source, "/tmp/test.sock", interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: source.calls >= 3, what="polling")
        await pilot.press("p")
        assert "PAUSED" in text_of(app.query_one("#status"))
        await pilot.pause(0.2)  # one poll may have been in flight when p was pressed
        frozen = source.calls
        await pilot.pause(0.5)
        assert source.calls == frozen, "polled while paused"
        app.interval = 60.0  # resuming must not wait out the sleep
        await pilot.press("p")
        await until(pilot, lambda: source.calls > frozen, timeout=5, what="a poll on resume")
        assert "live" in text_of(app.query_one("#status"))


async def test_no_daemon_then_a_daemon_that_goes_away_and_restarts(stream):
    restarted = copy.deepcopy(stream[3])
    restarted["server"]["pid"] = 5151
    restarted["server"]["uptime_s"] = 0.5
    # nothing at first; then the daemon; then it goes away; then a new one answers
    source = Source([None, None, stream[0], stream[1], stream[2], None, None, None, restarted, restarted])
    app = TopApp(source, "/tmp/test.sock", interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.query_one("#nodaemon").display, what="the no-daemon screen")
        nodaemon = text_of(app.query_one("#nodaemon"))
        assert "lorafleet serve" in nodaemon and "/tmp/test.sock" in nodaemon
        assert not app.query_one("#body").display
        await until(pilot, lambda: app.stats is not None and app.query_one("#body").display, what="first data")
        await until(pilot, lambda: "reconnecting" in text_of(app.query_one("#status")), what="reconnecting")
        assert app.query_one("#body").display, "the last picture stays while reconnecting"
        assert "pid 4242" in text_of(app.query_one("#status"))
        await until(pilot, lambda: "pid 5151" in text_of(app.query_one("#status")), what="recovery")
        assert "live" in text_of(app.query_one("#status"))
        # the restarted daemon's counters start afresh: no rate from a difference across daemons
        rates = list(app.history.series["tokens_per_s"])
        assert all(r >= 0 for r in rates)
        assert len(rates) == 2, rates  # stream[0]->[1], [1]->[2]; none across the restart or repeat
        await pilot.press("q")


def visible(app, widget) -> bool:
    region = app.query_one(widget).region
    return region.width > 0 and region.height > 0


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_usable_at_small_and_large_terminals(stream, size):
    """Every panel on the screen whole; the table's columns each wide enough for its every cell
    and together within the table (a narrow screen drops whole columns, the least wanted first,
    and says how many); the pool's legend within the pool's box with all four shares; below 100
    columns `w` swaps the switches panel and the table."""
    app = TopApp(None, "/tmp/test.sock")
    async with app.run_test(size=size) as pilot:
        await feed(app, pilot, stream)
        panels = ["#pool-box", "#rates-box", "#table-box"] + (["#switches"] if size[0] >= 100 else [])
        for widget in panels:
            region = app.query_one(widget).region
            assert region.width >= 20 and region.height >= 5, (widget, region)
            assert region.right <= size[0] and region.bottom <= size[1], (widget, region)
        table = app.query_one("#adapters", DataTable)
        assert table.row_count == len(known(stream[-1]["engine"]))
        widths = [c.get_render_width(table) for c in table.columns.values()]
        assert sum(widths) <= table.size.width
        for i in range(table.row_count):
            for text, width in zip(table.get_row_at(i), widths):
                assert len(str(text)) + 2 * table.cell_padding <= width, (str(text), width)
        assert app.columns[:4] == ["name", "tier", "rank", "pages"] or len(app.columns) < 4
        hidden = len(model.COLUMNS) - len(app.columns)
        assert (f"{hidden} more: Enter" in str(app.query_one("#table-box").border_subtitle)) == bool(hidden)
        pool = app.query_one(PoolMap)
        legend = text_of(pool).splitlines()
        assert all(len(line) <= pool.size.width for line in legend)
        assert all(any(f"{cls} " in line and "%" in line for line in legend) for cls in ("free", "kv", "cached", "adapter"))
        if size[0] < 100:
            assert not visible(app, "#switches")
            await pilot.press("w")
            assert visible(app, "#switches") and not visible(app, "#table-box")
            await pilot.press("w")
            assert visible(app, "#table-box") and not visible(app, "#switches")


async def test_a_snapshot_arriving_while_the_app_closes_is_dropped():
    """The poll's fetch can outlive the app's widgets (a wrong key's refusal, seen over TCP): its
    answer then draws nothing and raises nothing."""
    app = TopApp(None, None, interval=0.2)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
    app.ingest(None, "401: wrong key", False)  # raised NoMatches from the poll's thread before
