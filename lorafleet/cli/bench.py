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
    suite: Annotated[str, typer.Option(
        "--suite", help="throughput (the workloads above) or lora-decode (the cost of a decode "
                        "step over 1 and over BATCH distinct adapters, ranks 8-64 on all 7 "
                        "projections, against PEFT's mixed-adapter batch).")] = "throughput",
    batch: Annotated[int, typer.Option(
        "--batch", min=1, help="lora-decode: requests (and distinct adapters) per decode step.")] = 32,
    peft: Annotated[bool, typer.Option(
        "--peft/--no-peft", help="lora-decode: also run PEFT's mixed-adapter batch.")] = True,
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

    if suite == "lora-decode":
        return _lora_decode(model or (["micro"] if quick else ["tiny"]), batch, peft and not quick,
                            quick, out, as_json, threads)
    if suite != "throughput":
        raise typer.BadParameter(f"{suite!r} (choose from throughput, lora-decode)", param_hint="--suite")
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


def _lora_decode(shapes: list[str], batch: int, peft: bool, quick: bool, out: Path | None,
                 as_json: bool, threads: int | None) -> None:
    import torch

    from lorafleet.bench.lora_decode import run_lora_decode
    from lorafleet.bench.report import default_out_path

    if threads:
        torch.set_num_threads(threads)
    out = out or default_out_path()
    with user_errors():
        results = [run_lora_decode(shape, batch=batch, steps=4 if quick else 16, rounds=1 if quick else 3,
                                   peft=peft, progress=lambda m: err_console.print(m, highlight=False))
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
