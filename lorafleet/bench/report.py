"""Benchmark results as a JSON document and a rich table.

The document: `results`, one row per (model, system) with system, workload, model, status,
generated_tokens, seconds, tokens_per_s, requests_per_s, peak_rss_bytes and the system's own
`details`; `ratios`, lorafleet's tokens/s over each baseline's on the same model; `models`,
the shapes; `workload`; `environment` (versions, threads, device).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from rich import box
from rich.markup import escape
from rich.table import Table

from lorafleet.bench.fixtures import Shape
from lorafleet.bench.workloads import Workload

SUBJECT = "lorafleet"


def default_out_path() -> Path:
    return Path("bench-results") / f"{time.strftime('%Y%m%d-%H%M%S')}.json"


def make_report(runs: list[dict], workload: Workload, models: dict[str, Shape], environment: dict) -> dict:
    """`runs`: a worker's result dict plus `model` (the shape's name), one per (model, system)."""
    rows = [_row(run, workload.name) for run in runs]
    ratios = []
    for model in models:
        subject = _find(rows, model, SUBJECT)
        if subject is None or subject["tokens_per_s"] is None:
            continue
        for base in rows:
            if base["model"] == model and base["system"] != SUBJECT and base["tokens_per_s"]:
                ratios.append({"model": model, "workload": workload.name, "system": SUBJECT,
                               "baseline": base["system"],
                               "tokens_per_s_ratio": subject["tokens_per_s"] / base["tokens_per_s"]})
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "workload": asdict(workload),
        "models": {name: asdict(shape) for name, shape in models.items()},
        "environment": environment,
        "results": rows,
        "ratios": ratios,
    }


def _row(run: dict, workload: str) -> dict:
    ok = run["status"] == "ok" and run["seconds"] > 0
    return {
        "model": run["model"], "system": run["system"], "workload": workload, "status": run["status"],
        "reason": run.get("reason", ""), "num_requests": run.get("num_requests", 0),
        "generated_tokens": run.get("generated_tokens", 0), "seconds": run.get("seconds", 0.0),
        "tokens_per_s": run["generated_tokens"] / run["seconds"] if ok else None,
        "requests_per_s": run["num_requests"] / run["seconds"] if ok else None,
        "peak_rss_bytes": run.get("peak_rss_bytes"), "details": run.get("details", {}),
    }


def _find(rows: list[dict], model: str, system: str) -> dict | None:
    return next((r for r in rows if r["model"] == model and r["system"] == system), None)


def write_json(report: dict, out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return out


def render_table(report: dict) -> Table:
    """One row per run; a lorafleet row holds its tokens/s over each baseline's (`vs NAME`);
    runs that did not complete are explained under the table."""
    load = report["workload"]
    baselines = list(dict.fromkeys(r["baseline"] for r in report["ratios"]))
    notes = [f"{r['model']} {r['system']}: {r['status']}, {escape(r['reason'])}"
             for r in report["results"] if r["status"] != "ok"]
    if baselines:
        notes.insert(0, "vs: lorafleet tokens/s ÷ the baseline's, same model and requests")
    table = Table(title=f"workload {load['name']}: {load['num_requests']} requests", box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True, caption="\n".join(notes) or None, caption_justify="left")
    for name in ("model", "system", "tokens", "seconds", "tokens/s", "req/s", "peak RSS"):
        table.add_column(name, justify="left" if name in ("model", "system") else "right", no_wrap=True)
    for base in baselines:
        table.add_column(f"vs\n{base}", justify="right", no_wrap=True)
    ratios = {(r["model"], r["baseline"]): r["tokens_per_s_ratio"] for r in report["ratios"]}
    for row in report["results"]:
        if row["status"] != "ok":
            table.add_row(row["model"], row["system"], f"[yellow]{row['status']}[/]")
            continue
        versus = [f"{ratios[row['model'], base]:.2f}x" if (row["model"], base) in ratios
                  and row["system"] == SUBJECT else "" for base in baselines]
        table.add_row(row["model"], row["system"], str(row["generated_tokens"]), f"{row['seconds']:.2f}",
                      f"{row['tokens_per_s']:.1f}", f"{row['requests_per_s']:.2f}",
                      _mib(row["peak_rss_bytes"]), *versus)
    return table


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / (1 << 20):.0f} MiB"
