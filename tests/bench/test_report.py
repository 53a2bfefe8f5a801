"""The report: ratios between systems, memory against merged copies, cold against warm TTFT,
and warnings when the figures are noise."""

from __future__ import annotations

import dataclasses

import pytest

from lorafleet.bench.fixtures import SHAPES
from lorafleet.bench.report import make_report, noise_warnings
from lorafleet.bench.tables import render
from lorafleet.bench.workloads import WORKLOADS

pytestmark = pytest.mark.unit


def run(system, seconds, requests, **details):
    return {"model": "micro", "system": system, "status": "ok", "num_requests": len(requests),
            "generated_tokens": 10 * len(requests), "seconds": seconds, "reason": "", "peak_rss_bytes": 1 << 20,
            "details": details, "requests": requests, "steps": []}


def requests(ttfts):
    return [{"arrival_s": i * 0.1, "adapter": f"a{i % 2}", "ttft_s": t, "tpot_s": 0.01, "queue_s": None,
             "adapter_wait_s": 0.0} for i, t in enumerate(ttfts)]


def report_for(load):
    runs = [run("lorafleet", 1.0, requests([0.4, 0.4, 0.1, 0.1]), pool_bytes=100,
                pool={"peak_used_pages": 2, "page_bytes": 10, "peak_adapter_pages": 1, "total_pages": 10,
                      "peak_occupancy": 0.2}),
            run("peft-mixed", 4.0, requests([0.8] * 4)),
            {**run("merged", 0.0, []), "details": {"base_bytes": 1000, "num_adapters": 2, "memory_bytes": 3000}},
            {**run("peft-groups", 0.0, []), "status": "skipped", "reason": "peft is not installed"}]
    return make_report(runs, load, {"micro": SHAPES["micro"]}, {"threads": 2, "cpu_count": 2})


def test_lorafleet_is_divided_by_each_baseline_that_generated():
    [ratio] = report_for(WORKLOADS["quick"])["ratios"]
    assert ratio["baseline"] == "peft-mixed"
    assert ratio["tokens_per_s_ratio"] == 4.0
    assert ratio["ttft_p50_speedup"] == 0.8 / 0.1  # nearest-rank p50 of 0.1, 0.1, 0.4, 0.4


def test_merged_memory_is_compared_with_what_lorafleet_used():
    [memory] = report_for(WORKLOADS["quick"])["memory"]
    assert memory["lorafleet_bytes"] == 1000 + 100
    assert memory["lorafleet_peak_used_bytes"] == 1000 + 20
    assert memory["merged_over_lorafleet"] == 3000 / 1020


def test_cold_and_warm_ttft_are_split_only_when_adapters_start_on_disk_and_fit():
    assert "ttft_cold_warm" not in report_for(WORKLOADS["quick"])["results"][0]["latency"]
    cold = report_for(WORKLOADS["cold-start"])["results"][0]["latency"]["ttft_cold_warm"]
    assert cold["cold_over_warm_p50"] == 4.0
    tiered = report_for(WORKLOADS["uniform-1000-tiered"])["results"][0]["latency"]
    assert "ttft_cold_warm" not in tiered  # evictions make "first use" the wrong test for cold


def test_every_table_renders(capsys):
    from rich.console import Console

    report = report_for(dataclasses.replace(WORKLOADS["cold-start"]))
    console = Console(width=160, record=True)
    for table in render(report):
        console.print(table)
    text = console.export_text()
    for heading in ("workload cold-start", "against each baseline", "latency", "cold start", "memory"):
        assert heading in text
    assert "skipped" in text and "peft is not installed" in text


def test_contended_and_disagreeing_replays_and_sweep_jumps_are_flagged_not_trusted():
    report = report_for(WORKLOADS["quick"])
    assert noise_warnings(report) == []
    report["results"][0]["details"].update(other_cores=0.3, repeats=[
        {"seconds": 1.0, "tokens_per_s": t, "other_cores": c} for t, c in ((102.0, 0.9), (1676.0, 0.0), (1500.0, 0.1))])
    report["sweep"] = [{"model": "micro", "system": "lorafleet", "num_adapters": n,
                        "tokens_per_s": t, "other_cores": 0.0,
                        "repeats": [{"seconds": 1.0, "tokens_per_s": t, "other_cores": 0.0}] * 3}
                       for n, t in ((1, 102.0), (4, 1676.0), (8, 1600.0))]
    lorafleet, jump, threads = noise_warnings(report)  # steady sweep points with nothing else running: no line
    assert lorafleet == ("micro lorafleet: other processes kept 0.3 of 2 cores busy while it was timed (up to 0.9 "
                         "in one replay); "
                         "its 3 replays ranged 102-1676 tokens/s (16.4x); the median is reported")
    assert jump.startswith("micro lorafleet: 1 -> 4 adapters moved tokens/s 16.4x (102 -> 1676)")
    assert threads.startswith("with 2 torch threads on 2 cores")
