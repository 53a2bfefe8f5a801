"""`lorafleet bench stats-cost` (issue 16): the cost of one `/v1/stats` poll to the engine, on
the micro model with a handful of adapters and a short step log."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from lorafleet.bench.stats_cost import poll, run_stats_cost
from lorafleet.cli.main import app

runner = CliRunner()
SMALL = dict(num_adapters=6, batch=4, requests=8, max_tokens=8, mix=3, min_steps=40, polls=5, threads=1)


@pytest.fixture(scope="module")
def report(micro_dir):
    t0 = time.monotonic()
    # a 5 ms interval: the on runs poll several times even on a fast machine
    result = run_stats_cost("micro", rounds=2, interval_s=0.005, pool_bytes=32 << 20, root=micro_dir.parent, **SMALL)
    assert time.monotonic() - t0 < 60
    return result


def test_the_report_times_polls_of_a_live_engine_and_states_the_cost_fraction(report):
    assert report["benchmark"] == "stats-cost" and report["shape"] == "micro"
    engine = report["engine"]
    assert engine["registered"] == 6 and engine["steps_in_log"] >= 40
    assert engine["tiers"]["device"] >= 1 and engine["loads_in_window"] >= 1  # adapters loaded while it ran
    assert engine["page_map_runs"] >= 2
    p = report["poll"]
    assert p["calls"] == 5 and 0 < p["min_s"] <= p["median_s"] <= p["p99_s"]
    assert 0 < p["snapshot_median_s"] and p["json_bytes"] > 0
    assert "adapter_details" in p["json_bytes_by_key"] and max(p["json_bytes_by_key"].values()) < p["json_bytes"]
    assert report["interval_s"] == 0.005
    assert report["cost_fraction"] == pytest.approx(p["mean_s"] / report["interval_s"])
    assert report["target"] == 0.01 and report["target_met"] is None  # judged at one poll a second only
    assert report["profile"] and {"function", "ms_per_poll", "calls_per_poll", "share"} <= set(report["profile"][0])
    assert any("stats" in row["function"] for row in report["profile"])


def test_the_ab_runs_interleave_the_same_workload_with_and_without_polls(report):
    ab = report["ab"]
    assert ab["order"] == ["off", "on", "off", "on"]
    wanted = report["requests"] * report["max_tokens"]
    assert all(r["generated_tokens"] == wanted and r["tokens_per_s"] > 0 for r in ab["runs"])
    assert ab["tokens_per_s_off"] > 0 and ab["tokens_per_s_on"] > 0
    assert ab["ratio"] == pytest.approx(ab["tokens_per_s_on"] / ab["tokens_per_s_off"])
    runs = ab["runs"]
    assert ab["pair_ratios"] == pytest.approx([runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"],
                                               runs[3]["tokens_per_s"] / runs[2]["tokens_per_s"]])
    assert all(r["polls"] == 0 for r in ab["runs"] if not r["polling"])
    assert all(0 < r["steps_s"] <= r["seconds"] and r["steps"] > 0 for r in runs) and ab["steps_s_ratio"] > 0
    assert ab["polls"] == sum(r["polls"] for r in ab["runs"]) >= 1
    assert 0 < ab["poll_share_of_on_runs"] < 1


def test_a_poll_is_the_snapshot_and_its_json():
    from lorafleet.server.metrics import stats_body

    class Engine:  # what engine_snapshot reads
        max_num_seqs = 4

        def lora_capacity(self):  # no adapter sized yet
            return {"max_adapters": 4, "median_pages": None, "sized_adapters": 0, "basis": "max_num_seqs"}

        def stats(self):
            return {"pool": {"page_map": [["free", 8]]}, "adapters": {"registered": 1}}

        def lora_queues(self):
            return {"running": {}, "waiting": {}}
    seconds, snapshot_s, size = poll(Engine())
    assert 0 < snapshot_s <= seconds and size == len(stats_body("bench", {}, {
        "pool": {"page_map": [["free", 8]]}, "adapters": {"registered": 1}, "lora": {"running": {}, "waiting": {}},
        "num_adapters": 1, "max_num_seqs": 4, "lora_capacity": {"max_adapters": 4, "median_pages": None,
                                                                   "sized_adapters": 0, "basis": "max_num_seqs"}}))


@pytest.mark.heavy  # a whole benchmark run
def test_the_subcommand_writes_the_json_report_and_prints_the_table(micro_dir, tmp_path, monkeypatch):
    (tmp_path / "home" / "bench").mkdir(parents=True)
    (tmp_path / "home" / "bench" / micro_dir.name).symlink_to(micro_dir)  # the session's micro model, no rebuild
    monkeypatch.setenv("LORAFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LORAFLEET_DEBUG_CHECKS", "0")  # each step would check the default pool's 131,072 pages
    out = tmp_path / "stats.json"
    result = runner.invoke(app, ["bench", "stats-cost", "--model", "micro", "--adapters", "4", "--batch", "4",
                                 "--steps", "30", "--polls", "3", "--rounds", "1", "--threads", "1", "--out", str(out)],
                           env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["suite"] == "stats-cost" and report["duration_s"] > 0
    [row] = report["results"]
    assert row["num_adapters"] == 4 and row["poll"]["calls"] == 3 and row["interval_s"] == 1.0
    assert row["cost_fraction"] == row["poll"]["mean_s"] and isinstance(row["target_met"], bool)
    assert row["ab"]["order"] == ["off", "on"] and row["ab"]["tokens_per_s_on"] > 0
    assert "stats-cost" in result.stdout and "cost at one poll" in result.stdout
    assert f"wrote {out}" in result.stderr.replace("\n", "")


@pytest.mark.parametrize("args", [["--adapters", "0"], ["--polls", "0"], ["--model", "huge"]])
def test_bad_options_are_usage_errors(args):
    assert runner.invoke(app, ["bench", "stats-cost", *args]).exit_code == 2


def test_bench_lists_the_subcommand():
    result = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "stats-cost" in result.stdout
