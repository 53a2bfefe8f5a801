"""Benchmark results as one JSON document (for machines; `tables.py` renders it for people).

A run's document:
  results   one row per (model, system): status, reason, num_requests, generated_tokens,
            seconds, tokens_per_s, requests_per_s, latency (p50/p99 of ttft_s, tpot_s, queue_s,
            adapter_wait_s; for lorafleet on adapters that start on disk, ttft_cold_warm),
            peak_rss_bytes, details (the system's own: pool occupancy, caps...)
  ratios    per model, each lorafleet system over each baseline that generated: tokens/s ratio,
            and the baseline's TTFT p50 over lorafleet's (> 1: lorafleet answers sooner)
  memory    per model: serving every adapter merged (base + one copy per adapter) against
            lorafleet's base + pool (as allocated, and the pages in use at peak: the ratio's)
  switch    per model, the switch regressions of lorafleet's steps (see `metrics.py`)
  sweep     (when run) tokens/s against the number of adapters
  plots     the PNG files written, or why none was
  warnings  figures not to trust as they stand: other processes busy while they were timed,
            replays that disagree, neighbouring sweep points far apart
  workload, models, options, environment, created, duration_s

Every timed figure is the median of a run's replays (`jobs.System.run`); `details.repeats`
holds each replay's, `details.other_cores` the cores other processes kept busy meanwhile,
`details.warm_up` what ran before the clock.

A suite that ran the `mix` workload adds `mix` (`mix_figures`): the two mix ratios, taken
from runs of one invocation on one machine, against its targets.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from lorafleet.bench.fixtures import Shape
from lorafleet.bench.jobs import repeat_spread
from lorafleet.bench.metrics import cold_warm_ttft, latency_summary
from lorafleet.engine.regression import switch_regressions
from lorafleet.bench.workloads import Workload

SUBJECTS = ("lorafleet", "lorafleet-daemon")
NOISY_SPREAD = 1.5     # replays of one run this far apart (fastest over slowest): the machine, not the system
CONTENDED_CORES = 0.15  # cores other processes kept busy while a figure was timed (a little more already slows tiny markedly)
SWEEP_JUMP = 2.0       # neighbouring sweep points this far apart: worth a second look
# lorafleet on mixes of 2 adapters against itself on the same requests on single adapters of the same
# bytes (`mix-single`), and against PEFT serving the mixes as merged adapters built per mix (merges timed)
MIX_TARGETS = {"mix-single": 0.8, "peft": 5.0}
MIX_BASELINES = ("peft-groups", "peft-mixed")


def default_out_path() -> Path:
    return Path("bench-results") / f"{time.strftime('%Y%m%d-%H%M%S')}.json"


def resolve_out_path(out: str | Path | None) -> Path:
    """The JSON report's path from --out: a directory (one that exists, or a path ending in /)
    gets a report named like the default's, the PNGs beside it; anything else is the file."""
    if out is None:
        return default_out_path()
    if str(out).endswith(("/", os.sep)) or Path(out).is_dir():
        return Path(out) / default_out_path().name
    return Path(out)


def make_report(runs: list[dict], workload: Workload, models: dict[str, Shape], environment: dict,
                options: dict | None = None) -> dict:
    """`runs`: a worker's result dict plus `model` (the shape's name), one per (model, system)."""
    rows = [make_row(run, workload.name) for run in runs]
    if workload.residency == "registered" and workload.pool_fraction is None:  # first use = cold
        for row, run in zip(rows, runs):
            if row["system"] in SUBJECTS and row["latency"] is not None:
                row["latency"]["ttft_cold_warm"] = cold_warm_ttft(run.get("requests", []))
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "workload": asdict(workload),
        "models": {name: asdict(shape) for name, shape in models.items()},
        "options": options or {},
        "environment": environment,
        "results": rows,
        "ratios": ratios(rows),
        "memory": memory(rows),
        "switch": [{"model": run["model"], "system": run["system"],
                    "regressions": switch_regressions(run.get("steps", []))}
                   for run in runs if run["system"] in SUBJECTS and run["status"] == "ok"],
    }


def make_row(run: dict, workload: str) -> dict:
    ok = run["status"] == "ok" and run["seconds"] > 0
    return {
        "model": run["model"], "system": run["system"], "workload": workload, "status": run["status"],
        "reason": run.get("reason", ""), "num_requests": run.get("num_requests", 0),
        "generated_tokens": run.get("generated_tokens", 0), "seconds": run.get("seconds", 0.0),
        "tokens_per_s": run["generated_tokens"] / run["seconds"] if ok else None,
        "requests_per_s": run["num_requests"] / run["seconds"] if ok else None,
        "latency": latency_summary(run.get("requests", [])) if ok else None,
        "peak_rss_bytes": run.get("peak_rss_bytes"), "details": run.get("details", {}),
    }


def ratios(rows: list[dict]) -> list[dict]:
    out = []
    for subject in rows:
        if subject["system"] not in SUBJECTS or not subject["tokens_per_s"]:
            continue
        for base in rows:
            if base["model"] != subject["model"] or base["system"] in SUBJECTS or not base["tokens_per_s"]:
                continue
            ttft = (base["latency"]["ttft_s"]["p50"], subject["latency"]["ttft_s"]["p50"])
            tail = (base["latency"]["ttft_s"]["p99"], subject["latency"]["ttft_s"]["p99"])
            out.append({"model": subject["model"], "workload": subject["workload"], "system": subject["system"],
                        "baseline": base["system"],
                        "tokens_per_s_ratio": subject["tokens_per_s"] / base["tokens_per_s"],
                        "ttft_p50_speedup": ttft[0] / ttft[1] if None not in ttft and ttft[1] > 0 else None,
                        "ttft_p99_speedup": tail[0] / tail[1] if None not in tail and tail[1] > 0 else None,
                        "baseline_requests": base["num_requests"], "requests": subject["num_requests"]})
    return out


def memory(rows: list[dict]) -> list[dict]:
    out = []
    for merged in rows:
        if merged["system"] != "merged" or merged["status"] != "ok":
            continue
        lf = next((r for r in rows if r["model"] == merged["model"] and r["system"] == "lorafleet"
                   and r["status"] == "ok"), None)
        if lf is None:
            continue
        d, pool = merged["details"], lf["details"].get("pool", {})
        lorafleet_bytes = d["base_bytes"] + lf["details"]["pool_bytes"]  # the pool as allocated
        page = pool.get("page_bytes", 0)
        out.append({"model": merged["model"], "num_adapters": d["num_adapters"], "base_bytes": d["base_bytes"],
                    "merged_bytes": d["memory_bytes"], "lorafleet_bytes": lorafleet_bytes,
                    "lorafleet_peak_used_bytes": d["base_bytes"] + pool.get("peak_used_pages", 0) * page,
                    "lorafleet_peak_adapter_bytes": pool.get("peak_adapter_pages", 0) * page,
                    # what lorafleet needed, not what the bench allocated (the CPU pool has a floor)
                    "merged_over_lorafleet": d["memory_bytes"] / (d["base_bytes"] + pool.get("peak_used_pages", 0) * page)})
    return out


def mix_figures(reports: list[dict]) -> list[dict]:
    """Per model and lorafleet system (`system`) that ran the `mix` workload: its tokens/s on it,
    over its own on `mix-single` (`over_single`: the price of mixing, the LoRA bytes per step
    being the same) and over each PEFT system's on the same mixes (`baselines`: merged adapters
    built per mix, their merges timed), each against `MIX_TARGETS`; `notes`: the runs among them
    that did not complete. None where a figure is missing."""
    rows = {(rep["workload"]["name"], r["model"], r["system"]): r for rep in reports for r in rep["results"]}
    out = []
    for model, subject in dict.fromkeys((m, s) for (w, m, s) in rows if w == "mix" and s in SUBJECTS):
        ours, single = rows[("mix", model, subject)], rows.get(("mix-single", model, subject))
        tps, single_tps = ours["tokens_per_s"], (single or {}).get("tokens_per_s")
        over = tps / single_tps if tps and single_tps else None
        notes = [f"{w} {subject}: {r['status']}, {r['reason']}" for w, r in
                 (("mix", ours), ("mix-single", single)) if r is not None and r["status"] != "ok"]
        baselines = []
        for system in MIX_BASELINES:
            row = rows.get(("mix", model, system))
            if row is None:
                continue
            if row["status"] != "ok":
                notes.append(f"mix {system}: {row['status']}, {row['reason']}")
            theirs, d = row["tokens_per_s"], row["details"]
            ratio = tps / theirs if tps and theirs else None
            baselines.append({"system": system, "tokens_per_s": theirs, "merges": d.get("merges"),
                              "merge_s": d.get("merge_s"), "capped": d.get("capped"),
                              "ttft_p99_s": _ttft_p99(row), "ratio": ratio, "target": MIX_TARGETS["peft"],
                              "met": ratio >= MIX_TARGETS["peft"] if ratio else None})
        out.append({"model": model, "system": subject, "tokens_per_s": tps, "single_tokens_per_s": single_tps,
                    "ttft_p99_s": _ttft_p99(ours), "single_ttft_p99_s": _ttft_p99(single),
                    "over_single": over, "over_single_target": MIX_TARGETS["mix-single"],
                    "over_single_met": over >= MIX_TARGETS["mix-single"] if over else None,
                    "baselines": baselines, "notes": notes})
    return out


def _ttft_p99(row: dict | None) -> float | None:
    return row["latency"]["ttft_s"]["p99"] if row and row["latency"] else None


def noise_warnings(report: dict) -> list[str]:
    """What makes this report's figures untrustworthy as they stand: other processes busy while
    a figure was timed (`machine.py`), replays of one run that disagree, and neighbouring sweep
    points far apart (the machine, not the adapters, can move them that much)."""
    env, out, contended = report["environment"], [], False
    cores, threads = env.get("cpu_count"), env.get("threads")
    runs = [(f"{r['model']} {r['system']}", r["details"]) for r in report["results"] if r["status"] == "ok"]
    runs += [(f"{p['model']} {p['system']} @{p['num_adapters']} adapters", p) for p in report.get("sweep", [])]
    for label, details in runs:
        repeats, parts, mean = details.get("repeats", []), [], details.get("other_cores")
        peak = max([r["other_cores"] for r in repeats if r.get("other_cores") is not None] or [mean or 0])
        if max(mean or 0, peak) >= CONTENDED_CORES:
            contended = True
            parts.append(f"other processes kept {mean or 0:.1f} of {cores} cores busy while it was timed "
                         f"(up to {peak:.1f} in one replay)")
        spread = repeat_spread(details)
        if spread and spread >= NOISY_SPREAD:
            tps = [r["tokens_per_s"] for r in repeats]
            parts.append(f"its {len(tps)} replays ranged {min(tps):.0f}-{max(tps):.0f} tokens/s ({spread:.1f}x); "
                         "the median is reported")
        if parts:
            out.append(f"{label}: {'; '.join(parts)}")
    for a, b in zip(report.get("sweep", []), report.get("sweep", [])[1:]):
        if (a["model"], a["system"]) == (b["model"], b["system"]) and a["tokens_per_s"] and b["tokens_per_s"]:
            jump = max(a["tokens_per_s"], b["tokens_per_s"]) / min(a["tokens_per_s"], b["tokens_per_s"])
            if jump >= SWEEP_JUMP:
                out.append(f"{a['model']} {a['system']}: {a['num_adapters']} -> {b['num_adapters']} adapters moved "
                           f"tokens/s {jump:.1f}x ({a['tokens_per_s']:.0f} -> {b['tokens_per_s']:.0f}); read the "
                           "lines above before reading it as the adapters' cost")
    if contended and threads and threads > 1:
        out.append(f"with {threads} torch threads on {cores} cores, a thread the OS deschedules stalls every parallel "
                   "op: --threads 1, or an idle machine, steadies the figures")
    return out


def write_json(report: dict, out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return out
