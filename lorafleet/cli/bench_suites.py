"""How the `lorafleet bench` subcommands run: the throughput suites (`throughput`: run, quick,
full; llama-cpp and mix run theirs through the same runner), the one-figure suites (`suite`: one
result per shape, its table, its JSON report), and the checks of their choices and of the
modules they need (`require`, before anything runs). Importing it imports neither torch nor the
bench code."""

from __future__ import annotations

import importlib.util
import json
import time
from typing import Any, Callable

import typer

from lorafleet.cli.common import err_console, fail, styled, user_errors

# pyproject's `bench` extra: every module below; from a clone, the editable form
BENCH_EXTRA = "pip install 'lorafleet[bench]' (from a clone: pip install -e '.[bench]')"
# the modules a system needs beyond lorafleet's own (llama.cpp's: its converters', beside the build)
SYSTEM_MODULES = {"transformers": ("transformers",), "peft-groups": ("transformers", "peft"),
                  "peft-mixed": ("transformers", "peft"), "llama.cpp": ("gguf", "sentencepiece")}


def throughput(shapes: list[str], loads: list[str] | None, systems: str, counts: tuple[int, ...],
                max_baseline_requests: int | None, device: str, threads: int | None, out: str | None,
                as_json: bool, quantize: str | None = None) -> None:
    """run, quick and full: `loads` None is the full suite; `quantize` the base's scheme."""
    from lorafleet.bench.report import resolve_out_path
    from lorafleet.bench.systems import SYSTEM_NAMES
    from lorafleet.bench.workloads import WORKLOADS

    names = [s.strip() for s in systems.split(",") if s.strip()]
    check_shapes(shapes)
    check_choices("--workload", loads or [], WORKLOADS)
    check_choices("--systems", names or [""], SYSTEM_NAMES)
    check_quantize(quantize, shapes, cpu=device == "cpu")
    require(shapes, names, plots=True)
    if "llama.cpp" in names:
        llama_server()
    path = resolve_out_path(out)
    common: dict[str, Any]
    common = dict(device=device, threads=threads, console=err_console, max_baseline_requests=max_baseline_requests,
                  quantize=quantize)
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
    from lorafleet.bench import tables

    console = tables.console()
    for rep in report.get("reports", [report]):
        for table in tables.render(rep):
            console.print(table)
        plots = {k: v for k, v in rep.get("plots", {}).items() if k != "notes"}
        for kind, path in plots.items():
            err_console.print(f"{kind} plot: {path}", highlight=False)
        for note in rep.get("plots", {}).get("notes", []):
            err_console.print(f"no plot: {note}", highlight=False)
        for warning in rep.get("warnings", []):
            err_console.print(styled("noisy:", "yellow", warning))
    if "reports" in report:
        console.print(tables.suite_summary(report))
    for table in tables.mix_tables(report.get("mix", [])):
        console.print(table)
    err_console.print(f"took {report['duration_s']:.0f} s", highlight=False)


def tables_out(report: dict, path, as_json: bool, tables) -> None:
    """A suite's end: the report as JSON, or `tables()` with the noise warnings and the time;
    where it was written; a failure naming the runs that failed."""
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        from lorafleet.bench.tables import console

        for table in tables():
            console().print(table)
        for warning in (w for rep in report["reports"] for w in rep["warnings"]):
            err_console.print(styled("noisy:", "yellow", warning))
        err_console.print(f"took {report['duration_s']:.0f} s", highlight=False)
    err_console.print(f"wrote {path}", highlight=False)
    failed = [f"{rep['workload']['name']}/{r['model']}/{r['system']}" for rep in report["reports"]
              for r in rep["results"] if r["status"] == "error"]
    if failed:
        raise fail(f"{len(failed)} run(s) failed: {', '.join(failed)} (reasons in {path})")


def suite(name: str, shapes: list[str], run_one: Callable[[str], dict], table: str, out: str | None,
          as_json: bool, needs: dict[str, str] | None = None, on_device: bool = False) -> None:
    """lora-decode, decode-bound, switch, overhead, store-load, stats-cost and gpu: one result per
    shape, `suite_tables.<table>` of them, the JSON report. Each runs lorafleet's engine in this
    process: its OpenMP workers wait as under `lorafleet serve` (`lorafleet/openmp.py`), set
    before anything here imports torch. `needs`, `on_device`: what `require` checks first,
    beside building the shapes' models."""
    check_shapes(shapes)
    require(shapes, on_device=on_device, needs=needs)
    from lorafleet import openmp

    openmp.set_defaults()
    from lorafleet.bench.report import resolve_out_path, write_json

    path, started = resolve_out_path(out), time.perf_counter()
    with user_errors():
        results = [run_one(shape) for shape in dict.fromkeys(shapes)]
    report = {"suite": name, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "duration_s": time.perf_counter() - started, "results": results}
    write_json(report, path)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        from lorafleet.bench import suite_tables, tables

        tables.console().print(getattr(suite_tables, table)(results))
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


QUANTIZE_SCHEMES = ("int8", "int4")


def check_quantize(quantize: str | None, shapes: list[str], cpu: bool, files: bool = False) -> None:
    """--quantize is a scheme lorafleet serves (`files`: or a GGUF file type llama-quantize writes,
    `bench llama-cpp`'s); on the CPU (`cpu`: the run's device is known to be it), each shape fits in
    that precision (`fixtures.check_cpu_fit`: 8b only in int4)."""
    from lorafleet.bench.fixtures import check_cpu_fit
    from lorafleet.bench.llamacpp_convert import FILE_TYPES
    from lorafleet.errors import ConfigError

    if quantize is not None:
        check_choices("--quantize", [quantize], (*QUANTIZE_SCHEMES, *(FILE_TYPES if files else ())))
    if quantize in FILE_TYPES:
        quantize = "int4" if quantize.startswith(("Q2", "Q3", "Q4")) else "int8"  # about its bytes
    if cpu:
        for shape in dict.fromkeys(shapes):
            try:
                check_cpu_fit(shape, quantize)
            except ConfigError as e:
                raise typer.BadParameter(str(e), param_hint="--model") from None


# `bench llama-cpp`'s options for lorafleet's side alone
LORA_DTYPE = typer.Option("--lora-dtype", metavar="auto|bfloat16|float16",
                          help="lorafleet's adapters in its pool, as `serve --lora-dtype` (llama-server reads the "
                               "GGUF adapters' own type).")
QUANTIZED_PREFILL = typer.Option("--quantized-prefill", metavar="float32|bfloat16",
                                 help="lorafleet's prefill matmuls on the quantized base, as `serve "
                                      "--quantized-prefill`.")


def check_precision(lora_dtype: str, quantized_prefill: str) -> None:
    check_choices("--lora-dtype", [lora_dtype], ("auto", "bfloat16", "float16"))
    check_choices("--quantized-prefill", [quantized_prefill], ("float32", "bfloat16"))


def check_choices(option: str, given: list[str], choices) -> None:
    unknown = [g for g in given if g not in choices]
    if unknown:
        raise typer.BadParameter(f"{', '.join(repr(u) for u in unknown)} (choose from {', '.join(choices)})",
                                 param_hint=option)


def require(shapes: list[str], systems: list[str] | tuple[str, ...] = (), plots: bool = False,
            on_device: bool = False, needs: dict[str, str] | None = None) -> None:
    """Fail in one line, before anything runs, naming each module the run needs that is not
    installed and the command that installs them all: transformers to build a shape's random
    model not built yet, each system's (`SYSTEM_MODULES`), matplotlib for the plots, and `needs`
    (module -> what for). A subcommand that went on would end in a traceback minutes later."""
    from lorafleet.bench.fixtures import ON_DEVICE_ONLY, cache_key, cache_root

    wanted: dict[str, dict[str, list[str]]] = {}  # module -> what for -> names

    def want(module: str, what: str, name: str) -> None:
        wanted.setdefault(module, {}).setdefault(what, []).append(name)
    for shape in dict.fromkeys(shapes):
        made = on_device or shape in ON_DEVICE_ONLY  # as the bench builds it
        if not (cache_root() / cache_key(shape, 0, made) / "config.json").is_file():  # build_base's test
            want("transformers", "model", shape)
    for system in systems:
        for module in SYSTEM_MODULES.get(system, ()):
            want(module, "system", system)
    if plots:
        want("matplotlib", "the plots", "")
    for module, why in (needs or {}).items():
        want(module, why, "")

    def reasons(whats: dict[str, list[str]]) -> str:
        return "; ".join(f"to build the {_and(names)} model{'s' * (len(names) > 1)}" if what == "model" else
                         f"for the {_and(names)} system{'s' * (len(names) > 1)}" if what == "system" else
                         f"for {what}" for what, names in whats.items())
    missing = [f"{m} ({reasons(whats)})" for m, whats in wanted.items() if not _installed(m)]
    if missing:
        raise fail(f"not installed: {', '.join(missing)}. Install the bench's dependencies: {BENCH_EXTRA}",
                   code="missing_dependency")


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _installed(module: str) -> bool:
    """Whether `module` can be imported, found without importing it (transformers takes seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # imported already, without a spec
        return True
    except ImportError:  # a parent package that fails
        return False


def llama_server(quantize: str | None = None) -> None:
    """llama.cpp's server (and for int4 its quantize tool, which writes Q4_0), built before the
    runs when it is not (minutes, with its progress; the workers' output is captured); one line
    naming what is missing when it cannot be built."""
    from lorafleet.bench.llamacpp_build import LlamaCppUnavailable, quantize_binary, server_binary

    try:
        server_binary(say)
        if quantize is not None and quantize != "int8":  # Q4_0, and every llama-quantize type
            quantize_binary(say)
    except LlamaCppUnavailable as e:
        raise fail(f"llama.cpp cannot run: {e}") from None
