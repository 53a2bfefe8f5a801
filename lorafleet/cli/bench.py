"""`lorafleet bench`: run the benchmark workloads on random models of named shapes and report
throughput against baselines. The bench code (and with it torch) is imported only when the
command runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from lorafleet.cli.common import err_console, fail, user_errors

QUICK_MODELS = ["micro", "tiny"]
DEFAULT_MODELS = ["tiny"]
DEFAULT_SYSTEMS = "lorafleet,transformers"


def bench(
    model: Annotated[list[str] | None, typer.Option(
        "--model", "-m", metavar="SHAPE",
        help="Model shape: micro, tiny, smol (SmolLM2-135M's shapes) or 1b (for GPUs). "
             "Repeat for several. Default: tiny (micro and tiny with --quick).")] = None,
    workload: Annotated[str | None, typer.Option(
        "--workload", "-w", help="Workload: base-only or quick. Default: base-only (quick with --quick).")] = None,
    systems: Annotated[str, typer.Option(
        "--systems", help="Comma-separated systems to run: lorafleet, transformers.")] = DEFAULT_SYSTEMS,
    quick: Annotated[bool, typer.Option(
        "--quick", help="A smoke run: the quick workload on the micro and tiny shapes.")] = False,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", metavar="PATH",
        help="Where to write the JSON report. Default: ./bench-results/TIMESTAMP.json")] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print the JSON report on stdout instead of the table.")] = False,
    device: Annotated[str, typer.Option(
        "--device", help="auto, cpu or cuda[:N]; both systems run there.")] = "auto",
    threads: Annotated[int | None, typer.Option(
        "--threads", min=1, help="torch threads for every system. Default: all cores.")] = None,
) -> None:
    """Measure generation throughput of lorafleet and baselines on the same requests.

    Models are random (seeded) and built once with transformers into the cache,
    $LORAFLEET_HOME/bench (default ~/.cache/lorafleet/bench). Every system runs in a process
    of its own; outputs are greedy and forced to their requested length.
    """
    from lorafleet.bench.fixtures import SHAPES
    from lorafleet.bench.report import default_out_path, render_table
    from lorafleet.bench.runner import run_bench
    from lorafleet.bench.systems import SYSTEMS
    from lorafleet.bench.workloads import WORKLOADS

    if quick and workload not in (None, "quick"):
        raise typer.BadParameter("--quick runs the quick workload; drop --quick or --workload",
                                 param_hint="--workload")
    shapes = model or (QUICK_MODELS if quick else DEFAULT_MODELS)
    workload = workload or ("quick" if quick else "base-only")
    names = [s.strip() for s in systems.split(",") if s.strip()]
    _check_choices("--model", shapes, SHAPES)
    _check_choices("--workload", [workload], WORKLOADS)
    _check_choices("--systems", names or [""], SYSTEMS)

    out = out or default_out_path()
    with user_errors():
        report = run_bench(shapes, workload, names, out, device=device, threads=threads,
                           console=err_console)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        from rich.console import Console

        Console().print(render_table(report))
    err_console.print(f"wrote {out}", highlight=False)
    failed = [f"{r['model']}/{r['system']}" for r in report["results"] if r["status"] == "error"]
    if failed:
        raise fail(f"{len(failed)} run(s) failed: {', '.join(failed)} (reasons in {out})")


def _check_choices(option: str, given: list[str], choices) -> None:
    unknown = [g for g in given if g not in choices]
    if unknown:
        raise typer.BadParameter(f"{', '.join(repr(u) for u in unknown)} (choose from {', '.join(choices)})",
                                 param_hint=option)
