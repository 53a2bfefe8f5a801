"""lorafleet in-process: one `lorafleet.Engine`, driven the way the daemon drives it.

The replay loop adds each request when its arrival time comes (between steps) and steps while
anything is unfinished (continuous batching), sleeping only when nothing is. Adapters start as
the workload says: `loaded` (in the pool before the clock starts) or `registered` (on disk;
`engine.register_adapter` when the engine has it, so its prefetcher loads them; otherwise the
bench loads each synchronously when its first request arrives: what serving without a
prefetcher costs, counted in the step that follows and in that request's exposed wait).

Measured by the bench for every request (the same way as for the baselines): TTFT and TPOT from
the time each step returns its tokens. Per step that ran: wall time, tokens and sequences (the
engine's counters), distinct adapters among the requests that produced tokens (not counting the
base), pool pages in use. Where the engine reports them (`RequestOutput.metrics`,
`engine.step_records()`), its queue time, exposed adapter-load time and per-step time, tokens,
sequences and adapters loaded are taken instead.

On the CPU the pool is sized to hold the whole workload (KV at full length and every adapter),
so no request is preempted; on a GPU it takes the engine's default. A workload with a
`pool_fraction` gets, on any device, the KV room and room for that share of its adapters.
"""

from __future__ import annotations

import math
import time
from collections import deque
from pathlib import Path

from lorafleet.bench.systems import Job, Result, System, adapter_bytes, sync, workload_pool_bytes
from lorafleet.bench.workloads import FIRST_ORDINARY_ID as FIRST_ID

_ENGINE_STEP_KEYS = ("num_seqs", "num_tokens", "adapters_loaded")


class LorafleetInProcess(System):
    name = "lorafleet"
    subject = True
    baseline = False

    def __init__(self, *args, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens

    def run(self, job: Job) -> Result:
        from lorafleet import SamplingParams

        device, dtype = self._setup()
        engine = self._engine(job, device, dtype)
        engine.generate([[FIRST_ID, FIRST_ID + 1, FIRST_ID + 2]],
                        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        warm_preemptions = engine.stats().get("num_preemptions", 0)
        details = {"device": str(device), "dtype": str(dtype), "threads": self.threads,
                   "pool_bytes": engine.pool.num_pages * engine.pool.page_bytes,
                   "pool_pages": engine.pool.num_pages, "residency": job.residency,
                   "pool_fraction": job.pool_fraction}
        lazy = self._place_adapters(engine, job, details)
        replay = Replay(engine, lazy)
        sync(device)
        seconds = replay.run(job.requests)
        sync(device)
        details["pool"] = replay.pool_summary()
        details["step_records"] = "engine" if replay.merge_engine_records() else "bench"
        details["num_preemptions"] = engine.stats().get("num_preemptions") - warm_preemptions
        if hasattr(engine, "close"):
            engine.close()
        return Result(self.name, num_requests=len(job.requests), generated_tokens=replay.generated,
                      seconds=seconds, details=details, requests=replay.request_metrics(), steps=replay.steps)

    def _engine(self, job: Job, device, dtype):
        from lorafleet import Engine
        from lorafleet.config import EngineConfig

        kwargs = dict(device=str(device), dtype=str(dtype).removeprefix("torch."),
                      max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens)
        weights, fraction = adapter_bytes(job.adapters), job.pool_fraction
        if fraction is not None:  # room for that share of the adapters: the tiers at work
            kwargs["pool_bytes"] = workload_pool_bytes(Path(job.model_dir), job.requests, dtype.itemsize,
                                                       int(weights * fraction),
                                                       math.ceil(len(job.adapters) * fraction), floor=False)
        elif device.type != "cuda":
            kwargs["pool_bytes"] = workload_pool_bytes(Path(job.model_dir), job.requests, dtype.itemsize,
                                                       weights, len(job.adapters))
        if job.residency == "registered" and "host_cache_bytes" in EngineConfig.__dataclass_fields__:
            # every adapter fits the host tier: device residency is what the workload measures
            kwargs["host_cache_bytes"] = max(weights, 1 << 20)
        return Engine(job.model_dir, **kwargs)

    @staticmethod
    def _place_adapters(engine, job: Job, details: dict) -> dict[str, str]:
        """Load or register the adapters; return those the bench must load on first use."""
        t0 = time.perf_counter()
        if job.residency == "loaded":
            for name, path in job.adapters.items():
                engine.load_adapter(name, path)
            details["adapter_load_s"] = time.perf_counter() - t0  # before the clock
            return {}
        if hasattr(engine, "register_adapter"):
            for name, path in job.adapters.items():
                engine.register_adapter(name, path)
            details["adapters"] = "registered on disk; the engine's prefetcher loads them"
            return {}
        details["adapters"] = ("this engine has no register_adapter: the bench loads each adapter "
                               "synchronously when its first request arrives (no prefetch)")
        return dict(job.adapters)


class Replay:
    """The streaming loop and what it measures."""

    def __init__(self, engine, lazy: dict[str, str]):
        self.engine = engine
        self.lazy = dict(lazy)
        self.steps: list[dict] = []
        self.generated = 0
        self.arrival: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
        self.adapter: dict[str, str | None] = {}
        self.engine_metrics: dict[str, dict] = {}
        self.load_wait: dict[str, float] = {}

    def run(self, requests) -> float:
        from lorafleet import SamplingParams

        engine, start = self.engine, time.perf_counter()
        pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        while pending or engine.has_unfinished():
            now = time.perf_counter() - start
            load_s, loads = 0.0, 0
            while pending and pending[0].arrival_s <= now:
                r = pending.popleft()
                waited = self._load_on_first_use(r.adapter)
                load_s, loads = load_s + waited, loads + (waited > 0)
                params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
                rid = engine.add_request(r.prompt, params, adapter=r.adapter)
                self.arrival[rid], self.adapter[rid], self.tokens[rid] = r.arrival_s, r.adapter, 0
                if waited:
                    self.load_wait[rid] = waited
            if not engine.has_unfinished():
                time.sleep(max(0.0, pending[0].arrival_s - (time.perf_counter() - start)))
                continue
            self._step(start, load_s, loads)
        return time.perf_counter() - start

    def _load_on_first_use(self, adapter: str | None) -> float:
        path = self.lazy.pop(adapter, None) if adapter is not None else None
        if path is None:
            return 0.0
        t0 = time.perf_counter()
        self.engine.load_adapter(adapter, path)
        return time.perf_counter() - t0

    def _step(self, start: float, load_s: float, loads: int) -> None:
        engine, counters = self.engine, self.engine.counters
        before = (counters.num_steps, counters.num_prompt_tokens, counters.num_generated_tokens)
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        now = t1 - start
        adapters = set()
        for out in outputs:
            rid = out.request_id
            if out.new_token_ids:
                self.first.setdefault(rid, now)
                self.last[rid] = now
                self.tokens[rid] = self.tokens.get(rid, 0) + len(out.new_token_ids)
                self.generated += len(out.new_token_ids)
                adapters.add(out.adapter)
            if out.finished and getattr(out, "metrics", None):
                self.engine_metrics[rid] = out.metrics
        if counters.num_steps == before[0]:  # nothing ran: waiting for an adapter to land
            if not outputs and not hasattr(engine, "step_records"):
                time.sleep(0.001)  # an engine with a prefetcher waits on it inside step()
            return
        self.steps.append({
            "time_s": t1 - t0 + load_s,
            "num_seqs": counters.step_batch_sizes[-1],
            "num_tokens": (counters.num_prompt_tokens - before[1]) + (counters.num_generated_tokens - before[2]),
            # the adapters of the rows that sampled: all of them in a decode step (the regression's)
            "distinct_adapters": len(adapters - {None}),
            # the bench's own loads; an engine that loads adapters itself reports its own (merge)
            "adapters_loaded": None if hasattr(engine, "register_adapter") else loads,
            "load_s": load_s,
            "kv_pages": engine.pool.num_kv,
            "used_pages": engine.pool.num_pages - engine.pool.num_free,
        })

    def merge_engine_records(self) -> bool:
        """Take the engine's own per-step figures (issue 5: `step_records()`, one per step that
        ran, like ours) for time, sequences, tokens and adapters loaded. False when it keeps none."""
        if not hasattr(self.engine, "step_records") or not self.steps:
            return False
        records = self.engine.step_records()[-len(self.steps):]
        if len(records) != len(self.steps):
            return False
        for ours, theirs in zip(self.steps, records):
            ours.update({k: theirs[k] for k in _ENGINE_STEP_KEYS if k in theirs})
            ours["time_s"] = theirs.get("time_s", ours["time_s"] - ours["load_s"]) + ours["load_s"]
        return True

    def request_metrics(self) -> list[dict]:
        out = []
        for rid, arrival in self.arrival.items():
            n, first = self.tokens.get(rid, 0), self.first.get(rid)
            engine = self.engine_metrics.get(rid, {})
            out.append({
                "arrival_s": arrival,
                "ttft_s": first - arrival if first is not None else None,
                "tpot_s": (self.last[rid] - first) / (n - 1) if n > 1 else None,
                "queue_s": engine.get("queue_s"),
                "adapter_wait_s": engine.get("adapter_wait_s", self.load_wait.get(rid, 0.0)),
                "tokens": n, "adapter": self.adapter[rid],
            })
        return out

    def pool_summary(self) -> dict:
        pool = self.engine.pool
        used = [s["used_pages"] for s in self.steps] or [0]
        kv = [s["kv_pages"] for s in self.steps] or [0]
        return {"total_pages": pool.num_pages, "page_bytes": pool.page_bytes,
                "peak_used_pages": max(used), "peak_kv_pages": max(kv),
                "peak_adapter_pages": max(u - k for u, k in zip(used, kv)),
                "peak_occupancy": max(used) / pool.num_pages,
                "mean_occupancy": sum(used) / len(used) / pool.num_pages}
