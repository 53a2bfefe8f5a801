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
ALL_SYSTEMS = "lorafleet,transformers,peft-groups,peft-mixed,merged"
QUICK_SWEEP = "1,4"


def bench(
    model: Annotated[list[str] | None, typer.Option(
        "--model", "-m", metavar="SHAPE",
        help="Model shape: micro, tiny, smol (SmolLM2-135M's shapes) or 1b (for GPUs). "
             "Repeat for several. Default: tiny (micro and tiny with --quick).")] = None,
    workload: Annotated[list[str] | None, typer.Option(
        "--workload", "-w",
        help="Workload: uniform-8, uniform-1000, uniform-1000-tiered, zipf-1000, mixed-lengths, "
             "cold-start, base-only or quick. Repeat for several, run in turn, with lorafleet's "
             "tokens/s compared across uniform-1000 and uniform-8, uniform-1000-tiered and "
             "uniform-1000. Default: base-only (quick with --quick).")] = None,
    systems: Annotated[str, typer.Option(
        "--systems", help="Comma-separated systems to run: lorafleet, transformers (base model only), "
                          "lorafleet-daemon (the same through `lorafleet serve` over its socket), "
                          "peft-groups (set_adapter per adapter group), peft-mixed (adapter_names "
                          "batches), merged (memory accounting only).")] = ALL_SYSTEMS,
    quick: Annotated[bool, typer.Option(
        "--quick", help="A smoke run: the quick workload on the micro and tiny shapes, every "
                        "system, and a sweep over 1 and 4 adapters.")] = False,
    sweep: Annotated[str | None, typer.Option(
        "--sweep", metavar="N,N,...",
        help="Also run lorafleet on the workload's requests over each number of adapters and "
             "plot throughput against it (e.g. 1,8,64,256). Default: none (1,4 with --quick).")] = None,
    max_baseline_requests: Annotated[int | None, typer.Option(
        "--max-baseline-requests", min=1, metavar="N",
        help="Baselines serve only the first N requests (PEFT over hundreds of adapters would take "
             "hours); the report says so. Default: all (64 with --suite full).")] = None,
    out: Annotated[str | None, typer.Option(  # str: a Path would drop the trailing / that says "a directory"
        "--out", "-o", metavar="PATH",
        help="Where to write the JSON report, the PNG plots next to it: a file, or a directory "
             "(existing, or ending in /) to get TIMESTAMP.json. Default: ./bench-results/TIMESTAMP.json")] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print the JSON report on stdout instead of the tables.")] = False,
    device: Annotated[str, typer.Option(
        "--device", help="auto, cpu or cuda[:N]; every system runs there.")] = "auto",
    threads: Annotated[int | None, typer.Option(
        "--threads", min=1, help="torch threads for every system. Default: all cores.")] = None,
    suite: Annotated[str, typer.Option(
        "--suite", help="throughput (one workload, every system), full (every workload, every "
                        "system, the adapter sweep 1,8,64,256,1000; states its duration) or lora-decode "
                        "(the cost of a decode step over 1 and over BATCH distinct adapters, ranks "
                        "8-64 on all 7 projections, against PEFT's mixed-adapter batch) or switch "
                        "(per-token latency of a fixed decode batch against adapters landing in the "
                        "step, loaded in the background for waiting requests).")] = "throughput",
    batch: Annotated[int, typer.Option(
        "--batch", min=1, help="lora-decode: requests (and distinct adapters) per decode step.")] = 32,
    peft: Annotated[bool, typer.Option(
        "--peft/--no-peft", help="lora-decode: also run PEFT's mixed-adapter batch.")] = True,
) -> None:
    """Measure lorafleet and baselines side by side on the same requests.

    Models and adapters are random (seeded) and built once into the cache,
    $LORAFLEET_HOME/bench (default ~/.cache/lorafleet/bench). Every system runs in a process
    of its own; outputs are greedy and forced to their requested length; arrivals are replayed
    in real time. Reports: tokens/s, requests/s, TTFT/TPOT p50/p99, exposed adapter-load time,
    peak RSS, pool occupancy, ratios, the switch regression (table, slope, PNG) and the adapter
    sweep (PNG).
    """
    from lorafleet.bench.fixtures import SHAPES
    from lorafleet.bench.report import resolve_out_path
    from lorafleet.bench.systems import SYSTEM_NAMES
    from lorafleet.bench.workloads import WORKLOADS

    out = resolve_out_path(out)
    if suite == "switch":
        return _switch(model or (["micro"] if quick else ["smol"]), quick, out, as_json)
    if suite == "lora-decode":
        return _lora_decode(model or (["micro"] if quick else ["tiny"]), batch, peft and not quick,
                            quick, out, as_json, threads)
    if suite not in ("throughput", "full"):
        raise typer.BadParameter(f"{suite!r} (choose from throughput, full, lora-decode, switch)", param_hint="--suite")
    if quick and workload not in (None, ["quick"]):
        raise typer.BadParameter("--quick runs the quick workload; drop --quick or --workload",
                                 param_hint="--workload")
    if suite == "full" and (workload or quick):
        raise typer.BadParameter("--suite full runs every workload", param_hint="--workload/--quick")
    shapes = model or (QUICK_MODELS if quick else DEFAULT_MODELS)
    loads = list(dict.fromkeys(workload or ["quick" if quick else "base-only"]))
    names = [s.strip() for s in systems.split(",") if s.strip()]
    _check_choices("--model", shapes, SHAPES)
    _check_choices("--workload", loads, WORKLOADS)
    _check_choices("--systems", names or [""], SYSTEM_NAMES)
    counts = _parse_sweep(sweep if sweep is not None else (QUICK_SWEEP if quick else ""))

    common = dict(device=device, threads=threads, console=err_console)
    with user_errors():
        from lorafleet.bench.runner import SUITE_MAX_BASELINE_REQUESTS, run_bench, run_suite

        if suite == "full":
            report = run_suite(shapes, out, max_baseline_requests=max_baseline_requests or SUITE_MAX_BASELINE_REQUESTS,
                               **common)
        elif len(loads) > 1:
            report = run_suite(shapes, out, workloads=tuple(loads), systems=tuple(names), name="workloads",
                               sweeps={w: counts for w in loads}, max_baseline_requests=max_baseline_requests,
                               **common)
        else:
            report = run_bench(shapes, loads[0], names, out, max_baseline_requests=max_baseline_requests,
                               sweep=counts, **common)
    _print(report, as_json)
    err_console.print(f"wrote {out}", highlight=False)
    failed = [f"{r['workload']}/{r['model']}/{r['system']}" for rep in report.get("reports", [report])
              for r in rep["results"] if r["status"] == "error"]
    if failed:
        raise fail(f"{len(failed)} run(s) failed: {', '.join(failed)} (reasons in {out})")


def _print(report: dict, as_json: bool) -> None:
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
    if "reports" in report:
        console.print(suite_summary(report))
    err_console.print(f"took {report['duration_s']:.0f} s", highlight=False)


def _parse_sweep(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        counts = (-1,)
    if any(n < 1 for n in counts):
        raise typer.BadParameter(f"{text!r}: positive adapter counts, comma-separated", param_hint="--sweep")
    return counts


def _check_choices(option: str, given: list[str], choices) -> None:
    unknown = [g for g in given if g not in choices]
    if unknown:
        raise typer.BadParameter(f"{', '.join(repr(u) for u in unknown)} (choose from {', '.join(choices)})",
                                 param_hint=option)


def _lora_decode(shapes: list[str], batch: int, peft: bool, quick: bool, out: Path,
                 as_json: bool, threads: int | None) -> None:
    from lorafleet.bench.lora_decode import run_lora_decode

    with user_errors():
        results = [run_lora_decode(shape, batch=batch, steps=4 if quick else 16, rounds=1 if quick else 3,
                                   peft=peft, threads=threads,
                                   progress=lambda m: err_console.print(m, highlight=False))
                   for shape in shapes]
    report = {"suite": "lora-decode", "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="lora-decode: one decode step, fp32")
        for col in ("shape", "batch", "step none ms", "step 1 adapter ms", "step distinct ms",
                    "1 adapter / none", "LoRA op ms", "weights read ms", "efficiency", "vs PEFT mixed"):
            table.add_column(col, justify="right")
        for r in results:
            ms = r["decode_step_ms"]
            vs_peft = r.get("lorafleet_vs_peft_mixed")
            table.add_row(r["shape"], str(r["batch"]), f"{ms['none']:.1f}", f"{ms['one']:.1f}",
                          f"{ms['distinct']:.1f}", f"{r['one_vs_none_throughput']:.2f}x",
                          f"{r['lora_op_ms']:.1f}", f"{r['adapter_read_ms']:.1f}",
                          f"{r['lora_efficiency']:.2f}x", f"{vs_peft:.2f}x" if vs_peft else "-")
        Console().print(table)
    err_console.print(f"wrote {out}", highlight=False)


def _switch(shapes: list[str], quick: bool, out: Path, as_json: bool) -> None:
    """The isolated switch-cost regression (bench/switch_cost.py)."""
    from lorafleet.bench.switch_cost import run_switch_cost

    with user_errors():
        results = [run_switch_cost(shape, batch=8 if quick else 32, cold=16 if quick else 96,
                                   steps=8 if quick else 48) for shape in shapes]
    report = {"suite": "switch", "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    for r in results:
        slope = r["slope_fraction"]
        err_console.print(f"{r['shape']}: {r['decode_steps']} decode steps of {r['batch']} rows, "
                          f"{r['adapters_landed']} adapters landed; slope "
                          + (f"{r['slope_ms_per_switch']:.3f} ms/token per switch = {100 * slope:.2f}% "
                             f"of {r['mean_per_token_ms']:.3f} ms" if slope is not None else r.get("note", "-")),
                          highlight=False)
    err_console.print(f"wrote {out}", highlight=False)
