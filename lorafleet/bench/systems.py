"""Systems under test. Each is a small class with one method, `run(job) -> Result`, that serves
the same requests greedily, every output forced to its full length, replaying the workload's
arrival times in real time, and times only the serving: model and (unless the workload says
they start on disk) adapter loading, and one tiny warm-up generation, happen before the clock.

Every system runs on the same device, dtype and number of torch threads, in a process of its
own (`worker.py`), except accounting-only ones (`merged`), which run in the runner.

The registry (`SYSTEM_NAMES`, `_registry()`) is what `--systems` names; `lorafleet-daemon`
(daemon_system.py) serves the same requests through `lorafleet serve` over its Unix socket.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lorafleet.bench.workloads import BenchRequest


@dataclass
class Job:
    """What a worker runs: one system on one model and one workload's requests.
    `adapters`: name -> PEFT folder, every adapter the requests may name. `max_requests`: a
    baseline serves only the first N requests (None: all); lorafleet always serves all."""

    system: str
    model_dir: str
    requests: list[BenchRequest]
    adapters: dict[str, str] = field(default_factory=dict)
    residency: str = "loaded"
    pool_fraction: float | None = None
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    max_requests: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Job:
        data = json.loads(text)
        data["requests"] = [BenchRequest(**r) for r in data["requests"]]
        return cls(**data)


@dataclass
class Result:
    """One system's run of one workload. `generated_tokens` counts only tokens a request asked
    for; `status` is "ok", "skipped" (not installed, or not applicable) or "error".

    `requests`: per served request, `arrival_s`, `ttft_s` and `tpot_s` (measured by the bench
    from token timestamps, from the request's scheduled arrival), `queue_s` and `adapter_wait_s`
    (the exposed adapter-load time; None where the system cannot tell). `steps`: per engine
    step, `time_s`, `num_seqs`, `num_tokens`, `distinct_adapters`, `adapters_loaded`, pool pages.
    """

    system: str
    status: str = "ok"
    num_requests: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    reason: str = ""
    details: dict = field(default_factory=dict)
    requests: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class System:
    name = "system"
    subject = False      # a lorafleet system: its figures are divided by the baselines'
    isolated = True      # runs in a worker process of its own
    baseline = True      # serves at most `job.max_requests` requests

    def __init__(self, device: str = "auto", dtype: str = "auto", threads: int | None = None):
        self.device_name = device
        self.dtype_name = dtype
        self.threads = threads or default_threads()

    def _setup(self):
        """Set the thread count; return (torch.device, torch.dtype)."""
        import torch

        torch.set_num_threads(self.threads)
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                              if self.device_name == "auto" else self.device_name)
        if self.dtype_name == "auto":  # fp32 on CPUs (their bf16 matmuls are slow), bf16 on GPUs
            dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        else:
            dtype = getattr(torch, self.dtype_name)
        return device, dtype

    def served(self, job: Job) -> list[BenchRequest]:
        if self.baseline and job.max_requests:
            return job.requests[:job.max_requests]
        return job.requests

    def run(self, job: Job) -> Result:
        raise NotImplementedError


class MergedAccounting(System):
    """Memory only: serving every adapter as a merged model takes one full copy of the base
    per adapter, next to the base itself. No generation, no process of its own."""

    name = "merged"
    isolated = False

    def run(self, job: Job) -> Result:
        base = weight_bytes(Path(job.model_dir))
        used = sorted({r.adapter for r in job.requests if r.adapter is not None})
        return Result(self.name, reason="memory accounting only",
                      details={"base_bytes": base, "num_adapters": len(used),
                               "memory_bytes": base * (1 + len(used))})


def weight_bytes(model_dir: Path) -> int:
    """Bytes of a model folder's safetensors files (its weights, headers aside)."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def adapter_bytes(adapters: dict[str, str]) -> int:
    return sum(weight_bytes(Path(p)) for p in adapters.values())


def workload_pool_bytes(model_dir: Path, requests: list[BenchRequest], itemsize: int,
                        adapters: int = 0, num_adapters: int = 0, floor: bool = True,
                        block_size: int = 16) -> int:
    """Bytes of KV pages for every request at its full length at once, plus room for
    `num_adapters` adapters of `adapters` bytes in all (a page each for rounding); at least
    64 MiB when `floor`."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    page_bytes = cfg["num_hidden_layers"] * 2 * block_size * kv_heads * head_dim * itemsize
    pages = sum(math.ceil((len(r.prompt) + r.max_tokens) / block_size) for r in requests) + 8
    if adapters:
        pages += math.ceil(adapters / page_bytes) + num_adapters
    return max(pages * page_bytes, 64 << 20 if floor else 0)


def sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _registry() -> dict[str, type[System]]:
    from lorafleet.bench.daemon_system import LorafleetDaemon
    from lorafleet.bench.lorafleet_system import LorafleetInProcess
    from lorafleet.bench.static_batch import PeftGroups, PeftMixed, TransformersGenerate

    return {cls.name: cls for cls in (LorafleetInProcess, LorafleetDaemon, TransformersGenerate, PeftGroups,
                                      PeftMixed, MergedAccounting)}


SYSTEM_NAMES = ("lorafleet", "lorafleet-daemon", "transformers", "peft-groups", "peft-mixed", "merged")


def get_system(name: str) -> type[System]:
    return _registry()[name]
