"""`run_bench`: build (or reuse) each model shape, run every system on the workload's requests,
each in a fresh process (`lorafleet.bench.worker`), and write the report."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from lorafleet.bench.fixtures import build_base, get_shape
from lorafleet.bench.report import make_report, write_json
from lorafleet.bench.systems import SYSTEMS, default_threads
from lorafleet.bench.workloads import get_workload, make_requests
from lorafleet.errors import ConfigError


def run_bench(shapes: list[str], workload: str, systems: list[str], out: Path, *, device: str = "auto",
              dtype: str = "auto", threads: int | None = None, console: Console | None = None) -> dict:
    """Run `systems` on `workload` for each model shape; write the JSON report to `out` and
    return it. A system that fails or is not installed gets an "error" or "skipped" row."""
    models = {name: get_shape(name) for name in dict.fromkeys(shapes)}
    load = get_workload(workload)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise ConfigError(f"unknown system(s) {', '.join(unknown) or '(none given)'} "
                          f"(choose from {', '.join(SYSTEMS)})")
    threads = threads or default_threads()
    console = console or Console(stderr=True)

    load_before = _load_average()
    runs = []
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress, tempfile.TemporaryDirectory() as scratch:
        task = progress.add_task("", total=len(models) * len(systems))
        for name, shape in models.items():
            progress.update(task, description=f"{name}: building or reusing the random model")
            model_dir = build_base(name)
            requests = make_requests(load, shape.vocab_size)
            for system in systems:
                progress.update(task, description=f"{name}: {system}")
                job = dict(system=system, model_dir=str(model_dir), requests=requests,
                           device=device, dtype=dtype, threads=threads)
                run = {"model": name, **_run_isolated(job, Path(scratch))}
                runs.append(run)
                progress.console.print(_summary(run))
                progress.advance(task)
        progress.update(task, description="done")

    environment = {**_environment(device, dtype, threads), "load_average_before": load_before,
                   "load_average_after": _load_average()}
    report = make_report(runs, load, models, environment)
    write_json(report, out)
    return report


def _run_isolated(job: dict, scratch: Path) -> dict:
    job_path, out_path = scratch / "job.json", scratch / "result.json"
    job_path.write_text(json.dumps(job))
    out_path.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-m", "lorafleet.bench.worker", str(job_path), str(out_path)],
                          capture_output=True, text=True)
    if proc.returncode == 0 and out_path.is_file():
        return json.loads(out_path.read_text())
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"system": job["system"], "status": "error", "num_requests": 0, "generated_tokens": 0,
            "seconds": 0.0, "reason": f"worker exited with code {proc.returncode}: {last}", "details": {}}


def _summary(run: dict) -> str:
    label = f"{run['model']} · {run['system']}"
    if run["status"] != "ok":
        return f"{label}: [yellow]{run['status']}[/] {escape(run['reason'])}"
    return (f"{label}: {run['generated_tokens']} tokens in {run['seconds']:.2f} s = "
            f"[bold]{run['generated_tokens'] / run['seconds']:.1f} tokens/s[/]")


def _load_average() -> float | None:
    """The 1-minute load average: other work on the machine skews every figure."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _environment(device: str, dtype: str, threads: int) -> dict:
    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None
    return {
        "lorafleet": version("lorafleet"), "torch": version("torch"), "transformers": version("transformers"),
        "python": platform.python_version(), "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "threads": threads, "device": device, "dtype": dtype,
        "debug_checks": os.environ.get("LORAFLEET_DEBUG_CHECKS") == "1",
    }
