"""What `lorafleet top` computes from snapshots, apart from the screen: the pool map's cells,
the table's rows, and the rate history across a daemon's restart."""

from __future__ import annotations

import copy
import random

import pytest

from lorafleet.tui import model

pytestmark = pytest.mark.unit


def expand(page_map):
    return [label for label, n in page_map for _ in range(n)]


@pytest.mark.parametrize("num_cells", [1, 3, 7, 40, 1000])
def test_cells_cover_every_page_once_and_count_their_owners(num_cells):
    rng = random.Random(num_cells)
    page_map, last = [], None
    for _ in range(60):
        label = rng.choice(["free", "kv", "cached", "sql", "chat"])
        if label != last:
            page_map.append([label, rng.randint(1, 9)])
            last = label
    pages = expand(page_map)
    cells = model.pool_cells(page_map, num_cells)
    assert len(cells) <= num_cells and sum(c.count for c in cells) == len(pages)
    per = cells[0].count
    assert per == max(1, -(-len(pages) // num_cells)) and all(c.count == per for c in cells[:-1])
    for c in cells:
        owned = pages[c.first:c.first + c.count]
        assert dict(c.owners) == {label: owned.count(label) for label in set(owned)}


def test_a_cell_shows_its_largest_owner_that_is_not_free():
    [cell] = model.pool_cells([["free", 90], ["sql", 6], ["kv", 4]], 1)
    assert cell.label == "sql" and not cell.dense  # 6 adapter pages among 90 free still show
    [cell] = model.pool_cells([["free", 10]], 1)
    assert cell.label == "free" and cell.dense
    [cell] = model.pool_cells([["kv", 3], ["free", 2]], 1)
    assert cell.label == "kv" and cell.dense


def test_rows_sort_with_unmeasured_last_and_filter_by_name(stream):
    rows = model.adapter_rows(stream[-1]["engine"])
    assert {r["name"] for r in rows} == set(stream[-1]["engine"]["adapter_details"]) | set(
        stream[-1]["engine"]["untouched_adapters"])
    for reverse in (False, True):
        by = model.sort_rows(rows, "load_p99", reverse)
        measured = [r["load_p99"] for r in by if r["load_p99"] is not None]
        assert measured == sorted(measured, reverse=reverse)
        assert all(r["load_p99"] is None for r in by[len(measured):])
    tiers = [r["tier"] for r in model.sort_rows(rows, "tier", False)]
    assert tiers == sorted(tiers, key=model.TIER_ORDER.__getitem__)
    assert sorted(r["name"] for r in model.filter_rows(rows, "R16")) == ["law-r16", "sql-r16"]
    assert model.filter_rows(rows, "  ") == rows


def test_rates_are_counter_differences_over_the_daemons_clock_and_restart_afresh(stream):
    h = model.History()
    a, b = stream[5], stream[6]
    h.add(a)
    assert not h.series["tokens_per_s"]  # one snapshot: no rate yet
    h.add(b)
    dt = b["server"]["uptime_s"] - a["server"]["uptime_s"]
    want = (b["engine"]["num_generated_tokens"] - a["engine"]["num_generated_tokens"]) / dt
    assert h.latest("tokens_per_s") == pytest.approx(want)
    assert h.latest("queue") == b["engine"]["num_waiting"]
    restarted = copy.deepcopy(stream[1])
    restarted["server"]["pid"] = 999
    h.add(restarted)  # counters went back: no negative rate across daemons
    assert len(h.series["tokens_per_s"]) == 1 and len(h.series["queue"]) == 3
    h.add(restarted)  # the same snapshot again: the clock did not move
    assert len(h.series["tokens_per_s"]) == 1


def test_the_rate_labels_average_the_last_ten_seconds_so_a_quiet_second_does_not_read_as_zero(stream):
    h = model.History()
    assert h.recent_rate("tokens_per_s") is None
    base = copy.deepcopy(stream[-1])
    for t, tokens in enumerate([0, 100, 100, 100, 250, 250] + [250] * 10):
        s = copy.deepcopy(base)
        s["server"]["uptime_s"] = float(t + 1)
        s["engine"]["num_generated_tokens"] = tokens
        h.add(s)
        if t == 5:  # a busy burst, then a quiet second: the last second's rate is 0
            assert h.latest("tokens_per_s") == 0.0
            assert h.recent_rate("tokens_per_s") == pytest.approx(250 / 5)
    assert h.recent_rate("tokens_per_s") == 0.0  # ten quiet seconds later, the window holds none
    restarted = copy.deepcopy(base)
    restarted["server"]["pid"] = 999
    h.add(restarted)  # another daemon: its counters start the window afresh
    assert h.recent_rate("tokens_per_s") is None


def test_mixes_are_summed_up_once_a_request_named_one(stream):
    eng = copy.deepcopy(stream[-1]["engine"])
    assert model.mix_summary(eng) == ""
    eng["mixes"] = {"requests": 4, "adapters": 10, "by_size": {"2": 2, "3": 2}, "running": 1, "waiting": 2}
    assert model.mix_summary(eng) == "mixes: 1 running, 2 waiting, 4 so far (2.5 adapters each)"


def test_alora_requests_are_summed_up_once_one_finished(stream):
    eng = copy.deepcopy(stream[-1]["engine"])
    assert model.alora_summary(eng) == ""
    eng["alora"] = {"requests": 8, "reused_tokens": 16000}
    assert model.alora_summary(eng) == "aLoRA: 8 so far, 16000 prompt tokens reused"
