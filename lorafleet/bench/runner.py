"""`run_bench`: build (or reuse) each model shape and the workload's adapters, run every system
on the workload's requests, each in a fresh process (`lorafleet.bench.worker`), optionally sweep
the number of adapters, then write the JSON report and the plots. `run_suite`: several workloads
(by default every standard one) in turn, one combined report, its duration stated (with `mix` and
`mix-single` among them, the mix figures: `report.mix_figures`)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from lorafleet import openmp
from lorafleet.bench import plots
from lorafleet.bench.adapters import warm_up_adapter, workload_adapters
from lorafleet.bench.fixtures import ON_DEVICE_ONLY, build_base, check_cpu_fit, get_shape
from lorafleet.bench.jobs import MAX_REPEATS, MAX_TIMED_S, MIN_REPEATS, MIN_TIMED_S, Job
from lorafleet.bench.machine import default_threads, load_average
from lorafleet.engine.regression import switch_regressions
from lorafleet.bench.report import CONTENDED_CORES, make_report, mix_figures, noise_warnings, write_json
from lorafleet.bench.systems import SYSTEM_NAMES, get_system
from lorafleet.bench.workloads import Workload, get_workload, make_requests
from lorafleet.errors import ConfigError

SUITE_WORKLOADS = ("uniform-8", "uniform-1000", "uniform-1000-tiered", "zipf-1000", "mixed-lengths", "cold-start",
                   "base-only")
SUITE_SWEEP = ("uniform-1000", (1, 8, 64, 256, 1000))  # adapters, on that workload's requests
# lorafleet against itself on another workload: (workload, versus), the scaling figures
SUITE_ACROSS = (("uniform-1000", "uniform-8"), ("uniform-1000-tiered", "uniform-1000"), ("mix", "mix-single"),
                ("dora-mixed", "dora-plain"), ("saved-head-mixed", "dora-plain"))
SUITE_MAX_BASELINE_REQUESTS = 64       # PEFT over hundreds of adapters would take hours
SWEEP_SYSTEMS = ("lorafleet",)


def run_bench(shapes: list[str], workload: str | Workload, systems: list[str], out: Path, *,
              device: str = "auto", dtype: str = "auto", threads: int | None = None,
              max_baseline_requests: int | None = None, sweep: tuple[int, ...] = (),
              quantize: str | None = None, lora_dtype: str = "auto", quantized_prefill: str = "float32",
              console: Console | None = None) -> dict:
    """Run `systems` on `workload` for each model shape (and lorafleet on the workload over each
    number of adapters in `sweep`); write the JSON report to `out`, the plots next to it, and
    return the report. A system that fails or is not installed gets an "error" or "skipped" row.
    `quantize` (int8 | int4): the base served quantized (`jobs.Job.quantize`); or a GGUF file type
    (`llamacpp_convert.FILE_TYPES`: the daemon and llama-server given the same file); on the CPU, a
    shape that fits only quantized (`fixtures.CPU_SCHEMES`) is refused otherwise, before anything runs.
    `lora_dtype`, `quantized_prefill`: lorafleet's `--lora-dtype` and `--quantized-prefill` (`jobs.Job`)."""
    from lorafleet.bench.llamacpp_convert import FILE_TYPES

    started = time.perf_counter()
    models = {name: get_shape(name) for name in dict.fromkeys(shapes)}
    if quantize not in (None, "int8", "int4", *FILE_TYPES):
        raise ConfigError(f"quantize must be int8, int4 or a GGUF file type ({', '.join(FILE_TYPES)}), "
                          f"got {quantize!r}")
    if _on_cpu(device):
        for name in models:
            check_cpu_fit(name, quantize if quantize in (None, "int8", "int4") else "int4")
    load = workload if isinstance(workload, Workload) else get_workload(workload)
    unknown = [s for s in systems if s not in SYSTEM_NAMES]
    if unknown or not systems:
        raise ConfigError(f"unknown system(s) {', '.join(unknown) or '(none given)'} "
                          f"(choose from {', '.join(SYSTEM_NAMES)})")
    common: dict[str, Any]
    common = dict(device=device, dtype=dtype, threads=threads or default_threads(),
                  max_requests=max_baseline_requests or None, quantize=quantize, lora_dtype=lora_dtype,
                  quantized_prefill=quantized_prefill)
    console = console or Console(stderr=True)

    load_before = load_average()
    runs, points = [], []
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress, tempfile.TemporaryDirectory() as scratch:
        task = progress.add_task("", total=len(models) * (len(systems) + len(sweep) * len(SWEEP_SYSTEMS)))
        for name, shape in models.items():
            progress.update(task, description=f"{name}: building or reusing the model and adapters")
            model_dir = build_base(name, on_device=name in ON_DEVICE_ONLY)
            for system in systems:
                progress.update(task, description=f"{load.name} · {name} · {system}")
                run = _run(system, model_dir, load, shape.vocab_size, common, Path(scratch))
                runs.append({"model": name, **run})
                progress.console.print(_summary(name, run))
                progress.advance(task)
            for n in sweep:
                for system in SWEEP_SYSTEMS:
                    progress.update(task, description=f"{name}: {system} over {n} adapters")
                    run = _run(system, model_dir, load.with_adapters(n), shape.vocab_size, common, Path(scratch))
                    points.append(_sweep_point(name, n, run))
                    progress.console.print(_summary(f"{name} @{n} adapters", run))
                    progress.advance(task)
        progress.update(task, description="done")

    environment = {**_environment(device, dtype, common["threads"]), "load_average_before": load_before,
                   "load_average_after": load_average()}
    options = {"systems": systems, "max_baseline_requests": common["max_requests"], "quantize": quantize,
               "lora_dtype": lora_dtype, "quantized_prefill": quantized_prefill,
               "batch_size": 16,
               "sweep": list(sweep), "sweep_systems": list(SWEEP_SYSTEMS) if sweep else [],
               "warm_up": "every system: untimed small requests on the same model before the clock "
                          "(lorafleet: CPU kernels and one adapter loaded too); see each run's details.warm_up",
               "repeats": f"at least {MIN_REPEATS} replays and {MIN_TIMED_S:g} s of timed serving, at most "
                          f"{MAX_REPEATS} or {MAX_TIMED_S:g} s (adapters on disk: one replay); the median is reported"}
    report = make_report(runs, load, models, environment, options)
    if sweep:
        report["sweep"] = points
    report["warnings"] = noise_warnings(report)
    report["plots"] = _plots(runs, points, load.name, Path(out))
    report["duration_s"] = time.perf_counter() - started
    write_json(report, out)
    return report


def run_suite(shapes: list[str], out: Path, *, workloads: tuple[str | Workload, ...] = SUITE_WORKLOADS,
              systems: tuple[str, ...] = SYSTEM_NAMES, sweeps: dict[str, tuple[int, ...]] | None = None,
              name: str = "full", console: Console | None = None,
              only: dict[str, tuple[str, ...]] | None = None, **kwargs) -> dict:
    """Several workloads in turn (by default the full suite: every workload, every system, the
    adapter sweep); each workload's report next to `out` (`STEM-WORKLOAD.json`), all of them in
    `out`, with lorafleet's tokens/s across the workload pairs of `SUITE_ACROSS` that ran.
    `only`: workload -> the systems it runs, where not all of `systems`."""
    started, out = time.perf_counter(), Path(out)
    console = console or Console(stderr=True)
    sweeps = dict([SUITE_SWEEP]) if sweeps is None else sweeps
    reports = []
    for i, load in enumerate(workloads):
        label = load if isinstance(load, str) else load.name
        console.rule(f"workload {label} ({i + 1}/{len(workloads)})")
        path = out.with_name(f"{out.stem}-{label}.json")
        reports.append(run_bench(shapes, load, list((only or {}).get(label, systems)), path,
                                 sweep=sweeps.get(label, ()), console=console, **kwargs))
    suite = {"suite": name, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             "duration_s": time.perf_counter() - started, "reports": reports, "across": _across(reports)}
    mix = mix_figures(reports)
    if mix:
        suite["mix"] = mix
    write_json(suite, out)
    return suite


def _across(reports: list[dict]) -> list[dict]:
    tps = {(r["workload"]["name"], row["model"]): row["tokens_per_s"]
           for r in reports for row in r["results"] if row["system"] == "lorafleet" and row["tokens_per_s"]}
    return [{"workload": w, "versus": v, "model": m, "tokens_per_s_ratio": tps[w, m] / tps[v, m]}
            for w, v in SUITE_ACROSS for (name, m) in tps if name == w and (v, m) in tps]


def _on_cpu(device: str) -> bool:
    from lorafleet.model.loader import resolve_device

    return resolve_device(device).type == "cpu"


def _run(system: str, model_dir: Path, load: Workload, vocab_size: int, common: dict, scratch: Path) -> dict:
    adapters = workload_adapters(model_dir, load)
    job = Job(system, str(model_dir), make_requests(load, vocab_size), {n: str(p) for n, p in adapters},
              load.residency, load.pool_fraction, load.kv_fraction, warm_up_adapter=str(warm_up_adapter(model_dir)),
              concurrency=load.concurrency, **common)
    if not get_system(system).isolated:
        from lorafleet.bench.worker import run_job

        return run_job(job)
    return _run_isolated(job, scratch)


def _run_isolated(job: Job, scratch: Path) -> dict:
    job_path, out_path = scratch / "job.json", scratch / "result.json"
    job_path.write_text(job.to_json())
    out_path.unlink(missing_ok=True)
    env = dict(os.environ)
    if get_system(job.system).subject:  # lorafleet's runs wait as `lorafleet serve` does
        openmp.set_defaults(env)
    proc = subprocess.run([sys.executable, "-m", "lorafleet.bench.worker", str(job_path), str(out_path)],
                          capture_output=True, text=True, env=env)
    if proc.returncode == 0 and out_path.is_file():
        return json.loads(out_path.read_text())
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"system": job.system, "status": "error", "num_requests": 0, "generated_tokens": 0,
            "seconds": 0.0, "reason": f"worker exited with code {proc.returncode}: {last}", "details": {}}


def _sweep_point(model: str, n: int, run: dict) -> dict:
    ok, details = run["status"] == "ok" and run["seconds"] > 0, run.get("details", {})
    return {"model": model, "system": run["system"], "num_adapters": n, "status": run["status"],
            "reason": run.get("reason", ""), "tokens_per_s": run["generated_tokens"] / run["seconds"] if ok else None,
            "repeats": details.get("repeats", []), "other_cores": details.get("other_cores"),
            "peak_rss_bytes": run.get("peak_rss_bytes")}


def _plots(runs: list[dict], points: list[dict], workload: str, out: Path) -> dict:
    """Write the PNGs next to the JSON report; say where, or why not."""
    made, notes = {}, []
    switch = [{"model": r["model"], "steps": r["steps"], "regressions": switch_regressions(r["steps"])}
              for r in runs if r["status"] == "ok" and r.get("steps")]
    wanted = [("switch", lambda path: plots.plot_switch(switch, f"adapter switches, workload {workload}", path))]
    if points:
        wanted.append(("sweep", lambda path: plots.plot_sweep(points, f"throughput against adapters ({workload})", path)))
    for kind, draw in wanted:
        try:
            made[kind] = str(draw(out.with_name(f"{out.stem}-{kind}.png")))
        except plots.PlotUnavailable as e:
            notes.append(f"{kind}: {e}")
    return {**made, "notes": notes}


def _summary(label: str, run: dict) -> Text:
    """One line a run, styled as rich Text (not markup: consoles may print markup literally)."""
    label = f"{label} · {run['system']}"
    if run["status"] != "ok":
        return Text.assemble(f"{label}: ", (run["status"], "yellow"), f" {run['reason']}")
    if not run["seconds"]:
        return Text(f"{label}: {run.get('reason') or 'ok'}")
    tps, other = [r["tokens_per_s"] for r in run["details"].get("repeats", [])], run["details"].get("other_cores")
    replays = f" (median of {len(tps)} replays: {min(tps):.1f}-{max(tps):.1f})" if len(tps) > 1 else ""
    busy = (f" other processes busy on {other:.1f} cores", "yellow") if other is not None and other >= CONTENDED_CORES \
        else ""
    return Text.assemble(f"{label}: {run['generated_tokens']} tokens in {run['seconds']:.2f} s = ",
                         (f"{run['generated_tokens'] / run['seconds']:.1f} tokens/s", "bold"), replays, busy)


def _environment(device: str, dtype: str, threads: int) -> dict:
    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None
    return {
        "lorafleet": version("lorafleet"), "torch": version("torch"), "transformers": version("transformers"),
        "peft": version("peft"), "python": platform.python_version(), "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "threads": threads, "device": device, "dtype": dtype,
        "debug_checks": os.environ.get("LORAFLEET_DEBUG_CHECKS") == "1",
    }
