"""Snapshot tests: the screens `lorafleet top` draws from the recorded stats stream
(`record_stream.py`), compared with the SVGs under `__snapshots__/` (pytest-textual-snapshot).
After a deliberate change of the screen: `pytest tests/tui/test_snapshots.py --snapshot-update`,
then look at the new SVGs before committing them. The snapshots are drawn by the Textual the
test extra pins."""

from __future__ import annotations

import pytest

from lorafleet.tui.app import TopApp


@pytest.fixture
def replay(stream):
    """An app fed the whole stream before the screenshot (no polling: nothing races it)."""
    def make(*keys_after):
        app = TopApp(None, "/run/user/1000/lorafleet/lorafleet.sock")

        async def run_before(pilot):
            for s in stream:
                app.ingest(s)
            await pilot.pause()
            if keys_after:
                await pilot.press(*keys_after)
                await pilot.pause()
        return app, run_before
    return make


def test_the_main_screen_at_80x24(snap_compare, replay):
    app, run_before = replay()
    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_the_main_screen_at_120x40(snap_compare, replay):
    app, run_before = replay()
    assert snap_compare(app, terminal_size=(120, 40), run_before=run_before)


def test_sorted_by_misses_and_filtered(snap_compare, replay):
    app, run_before = replay("s", "s", "s", "slash", "r", "enter")
    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_an_adapters_detail(snap_compare, replay):
    app, run_before = replay("down", "enter")
    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_the_pool_map_cursor(snap_compare, replay):
    app, run_before = replay("tab", "right", "right", "right")
    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_no_daemon(snap_compare):
    app = TopApp(None, "/run/user/1000/lorafleet/lorafleet.sock")

    async def run_before(pilot):
        app.ingest(None, "no lorafleet daemon is running on /run/user/1000/lorafleet/lorafleet.sock; "
                         "start one with `lorafleet serve`")
        await pilot.pause()
    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)
