"""One system's run in a process of its own: `python -m lorafleet.bench.worker JOB.json OUT.json`.

A fresh process per (model, system) keeps the runs from sharing memory, caches or threads, and
makes the peak RSS it reports that system's alone. The job file holds a `jobs.Job`; the
result file gets `Result`'s fields plus `peak_rss_bytes`. The same command runs under
`python -m cProfile` for profiling.
"""

from __future__ import annotations

import resource
import sys
import traceback
from dataclasses import asdict
from pathlib import Path


def peak_rss_bytes() -> int:
    """This process's peak resident memory. On Linux, VmHWM: `getrusage`'s ru_maxrss carries
    the parent's peak over fork and exec, so it would charge the runner's memory to the worker."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB elsewhere


def run_job(job) -> dict:
    """Run a `jobs.Job`; any exception becomes this system's "error" result."""
    from lorafleet.bench.jobs import Result
    from lorafleet.bench.systems import get_system

    system = get_system(job.system)(device=job.device, dtype=job.dtype, threads=job.threads)
    try:
        result = system.run(job)
    except Exception as e:  # reported as this system's result; the other runs go on
        traceback.print_exc()
        result = Result(system.name, status="error", reason=f"{type(e).__name__}: {e}")
    return {**asdict(result), "peak_rss_bytes": peak_rss_bytes() if system.isolated else None}


def main(argv: list[str]) -> int:
    import json

    from lorafleet.bench.jobs import Job

    job_path, out_path = argv
    result = run_job(Job.from_json(Path(job_path).read_text()))
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
