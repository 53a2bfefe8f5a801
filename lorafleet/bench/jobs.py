"""What every system under test shares: the job it is given, the result it returns, and the
`System` base class whose `run` fixes the order every system follows:

  prepare   load the model (and, unless the workload starts them on disk, the adapters)
  warm_up   a couple of small untimed requests on the same model, so that kernel builds and
            loads, first allocations and first-call paths are paid before the clock starts
  replay    the workload's requests served greedily, every output forced to its full length,
            arrival times replayed in real time: the timed part
  close     free what prepare built

The replay repeats (`more_replays`) and the result is the median replay by tokens/s, every
replay's figure, with the cores other processes kept busy meanwhile, in `details["repeats"]`: a
replay of a small workload is short, shorter than the bursts of other work on a shared machine,
so one replay is one sample of whether the cores were free (neighbouring sweep points have read
far apart for that alone). A workload whose adapters start on disk replays once: only the first
replay measures cold loads.

The system modules import only this module, `machine.py` and `workloads.py`; the registry
(`systems.py`) imports the systems, so nothing imports in a circle.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lorafleet.bench.machine import cpu_seconds, default_threads, other_cores, other_cpu_seconds
from lorafleet.bench.workloads import FIRST_ORDINARY_ID, BenchRequest

MIN_REPEATS, MAX_REPEATS = 3, 5
MIN_TIMED_S, MAX_TIMED_S = 1.0, 5.0  # seconds of timed serving: enough, and no more replays past it
WARM_UP_PROMPT = [FIRST_ORDINARY_ID, FIRST_ORDINARY_ID + 1, FIRST_ORDINARY_ID + 2]
WARM_UP_ADAPTER = "bench-warm-up"


@dataclass
class Job:
    """What a worker runs: one system on one model and one workload's requests.
    `adapters`: name -> PEFT folder, every adapter the requests may name. `warm_up_adapter`: a
    PEFT folder none of the requests uses, loaded (then unloaded) by the lorafleet systems' warm-up.
    `max_requests`: a baseline serves only the first N requests (None: all); lorafleet always
    serves all. `concurrency`: the workload's closed loop (at most that many requests in
    flight), or None (each request sent at its arrival time). `quantize`: int8 or int4, the base
    served quantized (weight-only: lorafleet quantizes it as it loads, llama.cpp gets it as
    Q8_0 or Q4_0); systems that cannot serve it so skip the run. `lora_dtype`, `quantized_prefill`:
    lorafleet's `--lora-dtype` (the adapters' dtype in its pool) and `--quantized-prefill`."""

    system: str
    model_dir: str
    requests: list[BenchRequest]
    adapters: dict[str, str] = field(default_factory=dict)
    residency: str = "loaded"
    pool_fraction: float | None = None
    kv_fraction: float | None = None
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    max_requests: int | None = None
    warm_up_adapter: str | None = None
    concurrency: int | None = None
    quantize: str | None = None
    lora_dtype: str = "auto"
    quantized_prefill: str = "float32"

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
    step, the engine's own record (`time_s`, `host_s`, `num_seqs`, `num_tokens`,
    `adapters_loaded`...) with the bench's `distinct_adapters` and pool pages. Both of the
    median replay; `details["warm_up"]` says what ran before the clock.
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


@dataclass
class Replayed:
    """One timed replay of a job's requests; `details` go into the result when it is the median."""

    seconds: float
    generated_tokens: int
    requests: list[dict]
    steps: list[dict] = field(default_factory=list)
    details: dict = field(default_factory=dict)
    other_cpu_s: float | None = None  # CPU seconds other processes used meanwhile (`machine.py`)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


class System:
    name = "system"
    subject = False      # a lorafleet system: its figures are divided by the baselines'
    isolated = True      # runs in a worker process of its own
    baseline = True      # serves at most `job.max_requests` requests
    closed_loop = False  # replays a workload's `concurrency` (its closed loop); the others skip it
    quantizable = False  # serves a quantized base (`job.quantize`); the others skip such a job
    mixes = False        # serves requests that mix adapters (`BenchRequest.mix`); the others skip such a job
    no_mixes = "serves one adapter per request, not a mix of several"  # the reason they give

    def __init__(self, device: str = "auto", dtype: str = "auto", threads: int | None = None):
        self.device_name = device
        self.dtype_name = dtype
        self.threads = threads or default_threads()

    def _setup(self):
        """Set the thread count; return (torch.device, torch.dtype)."""
        import torch

        from lorafleet.model.loader import resolve_device

        torch.set_num_threads(self.threads)
        device = resolve_device(self.device_name)
        if self.dtype_name == "auto":  # fp32 on CPUs (their bf16 matmuls are slow), bf16 on GPUs
            dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        else:
            dtype = getattr(torch, self.dtype_name)
        return device, dtype

    def served(self, job: Job) -> list[BenchRequest]:
        if self.baseline and job.max_requests:
            return job.requests[:job.max_requests]
        return job.requests

    # -- what each system provides -----------------------------------------------------------
    def skip_reason(self, job: Job) -> str | None:
        return None

    def prepare(self, job: Job) -> dict:
        """Load the model (and adapters); return details for the report."""
        raise NotImplementedError

    def warm_up(self, job: Job) -> dict:
        """Untimed small requests; return what ran (the report's `details["warm_up"]`)."""
        raise NotImplementedError

    def replay(self, job: Job) -> Replayed:
        raise NotImplementedError

    def pids(self) -> tuple[int, ...]:
        """Processes besides this one that serve (their CPU is not other work)."""
        return ()

    def finish(self, job: Job) -> dict:
        """Details known once every replay ran."""
        return {}

    def close(self) -> None:
        pass

    # -- the order every system follows ------------------------------------------------------
    def run(self, job: Job) -> Result:
        if job.concurrency is not None and not self.closed_loop:
            return Result(self.name, status="skipped",
                          reason=f"replays arrival times only, not a closed loop of {job.concurrency} in flight")
        if job.quantize and not self.quantizable:
            return Result(self.name, status="skipped",
                          reason=f"serves full-precision bases only, not one quantized in {job.quantize}")
        if not self.mixes and any(r.mix for r in job.requests):
            return Result(self.name, status="skipped", reason=self.no_mixes)
        reason = self.skip_reason(job)
        if reason:
            return Result(self.name, status="skipped", reason=reason)
        self.device, self.dtype = self._setup()
        try:
            details = self.prepare(job)
            details["warm_up"] = self.warm_up(job)
            replays = [self._timed_replay(job)]
            while job.residency == "loaded" and more_replays([r.seconds for r in replays]):
                replays.append(self._timed_replay(job))
            details.update(self.finish(job))
        finally:
            self.close()
        median = sorted(replays, key=lambda r: r.tokens_per_s)[(len(replays) - 1) // 2]
        others = [r.other_cpu_s for r in replays]
        others_s = None if None in others else sum(o for o in others if o is not None)
        details.update(median.details, device=str(self.device), dtype=str(self.dtype), threads=self.threads,
                       other_cores=other_cores(others_s, sum(r.seconds for r in replays)),
                       repeats=[{"seconds": r.seconds, "tokens_per_s": r.tokens_per_s,
                                 "other_cores": other_cores(r.other_cpu_s, r.seconds)} for r in replays])
        served = self.served(job)
        if len(served) < len(job.requests):
            details["capped"] = (f"served the first {len(served)} of {len(job.requests)} "
                                 "requests (--max-baseline-requests)")
        return Result(self.name, num_requests=len(served), generated_tokens=median.generated_tokens,
                      seconds=median.seconds, details=details, requests=median.requests, steps=median.steps)

    def _timed_replay(self, job: Job) -> Replayed:
        before = cpu_seconds(self.pids())
        replayed = self.replay(job)
        replayed.other_cpu_s = other_cpu_seconds(before, cpu_seconds(self.pids()))
        return replayed


def more_replays(seconds: list[float]) -> bool:
    """Whether to replay again: until `MIN_REPEATS` replays and `MIN_TIMED_S` of serving, but
    never past `MAX_REPEATS` or `MAX_TIMED_S` (a baseline's one replay can take minutes)."""
    total = sum(seconds)
    if len(seconds) >= MAX_REPEATS or total >= MAX_TIMED_S:
        return False
    return len(seconds) < MIN_REPEATS or total < MIN_TIMED_S


def repeat_spread(details: dict) -> float | None:
    """The fastest replay's tokens/s over the slowest's; None with fewer than two."""
    tps = [r["tokens_per_s"] for r in details.get("repeats", []) if r["tokens_per_s"]]
    return max(tps) / min(tps) if len(tps) > 1 else None


def weight_bytes(model_dir: Path) -> int:
    """Bytes of a model folder's safetensors files (its weights, headers aside)."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def adapter_bytes(adapters: dict[str, str]) -> int:
    return sum(weight_bytes(Path(p)) for p in adapters.values())


def kv_page_bytes(model_dir: Path, itemsize: int) -> int:
    """The engine's KV page for this model, from the engine's own formula and block size."""
    from lorafleet.config import EngineConfig
    from lorafleet.memory.kv import kv_page_elems
    from lorafleet.model.config import ModelConfig

    cfg = ModelConfig.from_folder(model_dir)
    return kv_page_elems(cfg.num_layers, EngineConfig.block_size, cfg.num_kv_heads, cfg.head_dim) * itemsize


def workload_pool_bytes(model_dir: Path, requests: list[BenchRequest], itemsize: int,
                        adapters: int = 0, num_adapters: int = 0, floor: bool = True, kv_fraction: float = 1.0) -> int:
    """Bytes of KV pages for every request at its full length at once (`kv_fraction` of that),
    plus room for `num_adapters` adapters of `adapters` bytes in all (a page each for
    rounding); at least 64 MiB when `floor`."""
    from lorafleet.config import EngineConfig

    page_bytes, block = kv_page_bytes(model_dir, itemsize), EngineConfig.block_size
    pages = math.ceil(kv_fraction * sum(math.ceil((len(r.prompt) + r.max_tokens) / block) for r in requests)) + 8
    if adapters:
        pages += math.ceil(adapters / page_bytes) + num_adapters
    return max(pages * page_bytes, 64 << 20 if floor else 0)


def job_pool_bytes(job: Job, itemsize: int) -> int:
    """The pool the lorafleet systems get: the KV of the whole workload at full length and every
    adapter (so nothing is preempted), or, with a `pool_fraction`, room for that share of them
    (and with a `kv_fraction`, KV room for that share of the workload's requests only)."""
    weights, fraction = adapter_bytes(job.adapters), job.pool_fraction
    if fraction is not None:  # room for that share of the adapters: the tiers at work
        return workload_pool_bytes(Path(job.model_dir), job.requests, itemsize, int(weights * fraction),
                                   math.ceil(len(job.adapters) * fraction), floor=False,
                                   kv_fraction=job.kv_fraction or 1.0)
    return workload_pool_bytes(Path(job.model_dir), job.requests, itemsize, weights, len(job.adapters))


def sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
