"""How the `lorafleet bench` subcommands run: the throughput suites (`throughput`: run, quick,
full, llama-cpp), the one-figure suites (`suite`: one result per shape, its table, its JSON
report), and the checks of their choices. Importing it imports neither torch nor the bench code."""

from __future__ import annotations

import json
import time
from typing import Callable

import typer

from lorafleet.cli.common import err_console, fail, styled, user_errors


def throughput(shapes: list[str], loads: list[str] | None, systems: str, counts: tuple[int, ...],
                max_baseline_requests: int | None, device: str, threads: int | None, out: str | None,
                as_json: bool) -> None:
    """run, quick and full: `loads` None is the full suite."""
    from lorafleet.bench.report import resolve_out_path
    from lorafleet.bench.systems import SYSTEM_NAMES
    from lorafleet.bench.workloads import WORKLOADS

    names = [s.strip() for s in systems.split(",") if s.strip()]
    check_shapes(shapes)
    check_choices("--workload", loads or [], WORKLOADS)
    check_choices("--systems", names or [""], SYSTEM_NAMES)
    path = resolve_out_path(out)
    common = dict(device=device, threads=threads, console=err_console, max_baseline_requests=max_baseline_requests)
    with user_errors():
        from lorafleet.bench.runner import run_bench, run_suite

        if loads is None:
            report = run_suite(shapes, path, systems=tuple(names), **common)
        elif len(loads) > 1:
            loads = list(dict.fromkeys(loads))
            report = run_suite(shapes, path, workloads=tuple(loads), systems=tuple(names), name="workloads",
                               sweeps={w: counts for w in loads}, **common)
        else:
            report = run_bench(shapes, loads[0], names, path, sweep=counts, **common)
    print_report(report, as_json)
    err_console.print(f"wrote {path}", highlight=False)
    failed = [f"{r['workload']}/{r['model']}/{r['system']}" for rep in report.get("reports", [report])
              for r in rep["results"] if r["status"] == "error"]
    if failed:
        raise fail(f"{len(failed)} run(s) failed: {', '.join(failed)} (reasons in {path})")


def print_report(report: dict, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    from rich.console import Console

    from lorafleet.bench.tables import render, suite_summary

    console = Console()
    for rep in report.get("reports", [report]):
        for table in render(rep):
            console.print(table)
        plots = {k: v for k, v in rep.get("plots", {}).items() if k != "notes"}
        for kind, path in plots.items():
            err_console.print(f"{kind} plot: {path}", highlight=False)
        for note in rep.get("plots", {}).get("notes", []):
            err_console.print(f"no plot: {note}", highlight=False)
        for warning in rep.get("warnings", []):
            err_console.print(styled("noisy:", "yellow", warning))
    if "reports" in report:
        console.print(suite_summary(report))
    err_console.print(f"took {report['duration_s']:.0f} s", highlight=False)


def suite(name: str, shapes: list[str], run_one: Callable[[str], dict], table: str, out: str | None,
           as_json: bool) -> None:
    """lora-decode, decode-bound, switch, overhead, store-load, stats-cost and gpu: one result per
    shape, `tables.<table>` of them, the JSON report. Each runs lorafleet's engine in this
    process: its OpenMP workers wait as under `lorafleet serve` (`lorafleet/openmp.py`), set
    before anything here imports torch."""
    from lorafleet import openmp

    openmp.set_defaults()
    from lorafleet.bench.report import resolve_out_path, write_json

    check_shapes(shapes)
    path, started = resolve_out_path(out), time.perf_counter()
    with user_errors():
        results = [run_one(shape) for shape in dict.fromkeys(shapes)]
    report = {"suite": name, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "duration_s": time.perf_counter() - started, "results": results}
    write_json(report, path)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        from rich.console import Console

        from lorafleet.bench import tables

        Console().print(getattr(tables, table)(results))
    err_console.print(f"wrote {path}", highlight=False)


def say(message: str) -> None:
    err_console.print(message, highlight=False)


def parse_sweep(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        counts = (-1,)
    if any(n < 1 for n in counts):
        raise typer.BadParameter(f"{text!r}: positive adapter counts, comma-separated", param_hint="--sweep")
    return counts


def check_shapes(shapes: list[str]) -> None:
    from lorafleet.bench.fixtures import SHAPES

    check_choices("--model", shapes, SHAPES)


def check_choices(option: str, given: list[str], choices) -> None:
    unknown = [g for g in given if g not in choices]
    if unknown:
        raise typer.BadParameter(f"{', '.join(repr(u) for u in unknown)} (choose from {', '.join(choices)})",
                                 param_hint=option)
