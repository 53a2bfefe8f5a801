"""The registry of systems under test: what `--systems` names. Each system serves the same
requests greedily, every output forced to its full length, replaying the workload's arrival
times in real time (the order it follows, warm-up and repeats included: `jobs.System.run`).

Every system runs on the same device, dtype and number of torch threads, in a process of its
own (`worker.py`), except accounting-only ones (`merged`), which run in the runner. The system
modules import only `jobs.py`, `workloads.py` and their helpers (`http_replay.py`, `fixtures.py`,
`adapters.py`); this module imports them.
"""

from __future__ import annotations

from pathlib import Path

from lorafleet.bench.daemon_system import LorafleetDaemon
from lorafleet.bench.jobs import Job, Result, System, weight_bytes
from lorafleet.bench.llamacpp import LlamaCpp
from lorafleet.bench.lorafleet_system import LorafleetInProcess, LorafleetLRU, LorafleetNoPrefixCache
from lorafleet.bench.static_batch import PeftGroups, PeftMixed, TransformersGenerate


class MergedAccounting(System):
    """Memory only: serving every adapter as a merged model takes one full copy of the base
    per adapter (per mix, for requests that mix adapters), next to the base itself. No
    generation, no process of its own."""

    name = "merged"
    isolated = False

    def run(self, job: Job) -> Result:
        if job.quantize:  # the files' bytes are the full-precision base's
            return Result(self.name, status="skipped",
                          reason=f"serves full-precision bases only, not one quantized in {job.quantize}")
        base = weight_bytes(Path(job.model_dir))
        used = sorted({r.label for r in job.requests if r.label is not None})
        return Result(self.name, reason="memory accounting only",
                      details={"base_bytes": base, "num_adapters": len(used),
                               "memory_bytes": base * (1 + len(used))})


SYSTEMS: dict[str, type[System]] = {cls.name: cls for cls in (
    LorafleetInProcess, LorafleetNoPrefixCache, LorafleetLRU, LorafleetDaemon, TransformersGenerate, PeftGroups,
    PeftMixed, MergedAccounting, LlamaCpp)}
SYSTEM_NAMES = tuple(SYSTEMS)


def get_system(name: str) -> type[System]:
    return SYSTEMS[name]
