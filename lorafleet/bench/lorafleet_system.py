"""lorafleet in-process: one `lorafleet.Engine`, driven the way the daemon drives it.

The replay loop adds each request when its arrival time comes (between steps) and steps while
anything is unfinished (continuous batching), sleeping only when nothing is. Adapters start as
the workload says: `loaded` (in the pool before the clock starts) or `registered` (on disk: in
the store, pulled and validated once before the clock, as after `lorafleet pull`, and registered
with the pull's digest as the daemon's resolver does; the engine's prefetcher loads them when
requests ask, the clock running).

Measured by the bench for every request (the same way as for the baselines): TTFT and TPOT from
the time each step returns its tokens. Per step, the engine's own record (`step_records()`:
time, host-side time, sequences, tokens, adapters loaded), with the bench's count of distinct
adapters among the rows that produced tokens (the base not counted; a mix's adapters each
counted: the adapters a decode step's LoRA op reads) and pool pages in use. Per request, the
engine's queue time and exposed adapter-load time (`RequestOutput.metrics`). A request that
mixes adapters is added with its `Mix`, as the daemon adds one.

On the CPU the pool is sized to hold the whole workload (KV at full length and every adapter),
so no request is preempted; on a GPU it takes the engine's default. A workload with a
`pool_fraction` gets, on any device, the KV room and room for that share of its adapters.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from lorafleet.bench import adapters
from lorafleet.bench.jobs import (WARM_UP_ADAPTER, WARM_UP_PROMPT, Job, Replayed, System, adapter_bytes,
                                  job_pool_bytes, sync)

if TYPE_CHECKING:
    from lorafleet.engine.engine import Engine

_OWN_STEP_KEYS = ("distinct_adapters", "kv_pages", "used_pages")  # the bench's; the rest is the engine's


class LorafleetInProcess(System):
    name = "lorafleet"
    subject = True
    baseline = False
    quantizable = True
    mixes = True
    engine_options: dict = {}  # what the variants below change

    def __init__(self, *args, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.engine: Engine | None = None  # prepare builds it

    def prepare(self, job: Job) -> dict:
        from lorafleet import Engine

        kwargs = dict(device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
                      max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                      quantize=job.quantize, lora_dtype=job.lora_dtype,
                      quantized_prefill=job.quantized_prefill, **self.engine_options)
        if job.pool_fraction is not None or self.device.type != "cuda":
            kwargs["pool_bytes"] = job_pool_bytes(job, self.dtype.itemsize)
        if job.residency == "registered":  # every adapter fits the host tier: device residency is measured
            kwargs["host_cache_bytes"] = max(adapter_bytes(job.adapters), 1 << 20)
        model_dir: str | Path
        stored: dict[str, tuple[Path, str]]
        model_dir, stored = job.model_dir, {}
        if job.residency == "registered":  # on disk means in the store, pulled (validated) before the clock
            model_dir, stored = adapters.stored(Path(job.model_dir), [(n, Path(p)) for n, p in job.adapters.items()])
        self.engine = engine = Engine(model_dir, **kwargs)
        details = {"pool_bytes": engine.pool.num_pages * engine.pool.page_bytes, "pool_pages": engine.pool.num_pages,
                   "residency": job.residency, "pool_fraction": job.pool_fraction,
                   "quantization": engine.model.quantization}
        t0 = time.perf_counter()
        for name, path in job.adapters.items():
            if job.residency == "loaded":
                engine.load_adapter(name, path)
            else:
                engine.register_adapter(name, *stored[name])
        if job.residency == "loaded":
            details["adapter_load_s"] = time.perf_counter() - t0  # before the clock
        else:
            details["adapters"] = ("registered from the store (pulled before the clock); the engine's "
                                   "prefetcher loads them")
        return details

    def warm_up(self, job: Job) -> dict:
        """The CPU kernels loaded, one adapter loaded (not one of the workload's, which may have
        to start on disk) and two small requests, one on it (on a mix of it at scale 0.5 when the
        workload mixes: the scaled path), one on the base."""
        from lorafleet import SamplingParams
        from lorafleet.adapters.mix import Mix

        t0, engine, kernels = time.perf_counter(), self.engine, {}
        assert engine is not None  # prepare built it
        if self.device.type == "cpu":
            from lorafleet.kernels import lora_cpu, paged_attention_cpu

            kernels = {"lora_cpu": lora_cpu.load() is not None,
                       "paged_attention_cpu": paged_attention_cpu.load() is not None}
        adapter = None
        if job.warm_up_adapter:
            engine.load_adapter(WARM_UP_ADAPTER, job.warm_up_adapter)
            adapter = WARM_UP_ADAPTER
        on = Mix.of({adapter: 0.5}) if adapter and any(r.mix for r in job.requests) else adapter
        engine.generate([WARM_UP_PROMPT] * 2, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                        adapters=[on, None])
        if adapter:
            engine.unload_adapter(adapter)  # its pages back before the clock
        self.warm_preemptions = engine.counters.num_preemptions
        return {"requests": 2, "adapter_loaded": adapter is not None, "kernels_loaded": kernels,
                "seconds": time.perf_counter() - t0}

    def replay(self, job: Job) -> Replayed:
        assert self.engine is not None  # prepare built it
        self.engine.reset_prefix_cache()  # every replay meets its prompts for the first time
        replay = Replay(self.engine)
        sync(self.device)
        seconds = replay.run(job.requests)
        sync(self.device)
        return Replayed(seconds, replay.generated, replay.request_metrics(), replay.steps,
                        {"pool": replay.pool_summary()})

    def finish(self, job: Job) -> dict:
        assert self.engine is not None  # prepare built it
        stats = self.engine.stats()
        return {"num_preemptions": self.engine.counters.num_preemptions - self.warm_preemptions,
                "prefix_cache": stats["prefix_cache"], "eviction": stats["eviction"]}

    def close(self) -> None:
        if self.engine is not None:  # None when prepare failed before it
            self.engine.close()


class Replay:
    """The streaming loop and what it measures."""

    def __init__(self, engine):
        self.engine = engine
        self.steps: list[dict] = []
        self.generated = 0
        self.arrival: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
        self.adapter: dict[str, str | None] = {}  # its label: the adapter, the mix (`a+b*0.5`) or None
        self.names: dict[str, tuple[str, ...]] = {}  # the adapters it uses
        self.engine_metrics: dict[str, dict] = {}

    def run(self, requests) -> float:
        from lorafleet import SamplingParams
        from lorafleet.adapters.mix import Mix

        engine, start = self.engine, time.perf_counter()
        pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        while pending or engine.has_unfinished():
            now = time.perf_counter() - start
            while pending and pending[0].arrival_s <= now:
                r = pending.popleft()
                params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
                rid = engine.add_request(r.prompt, params, adapter=Mix.of(r.mix) if r.mix else r.adapter)
                self.arrival[rid], self.adapter[rid], self.tokens[rid] = r.arrival_s, r.label, 0
                self.names[rid] = r.names
            if not engine.has_unfinished():
                time.sleep(max(0.0, pending[0].arrival_s - (time.perf_counter() - start)))
                continue
            self._step(start)
        seconds = time.perf_counter() - start
        self._merge_engine_records()
        return seconds

    def _step(self, start: float) -> None:
        engine = self.engine
        ran = engine.counters.num_steps
        outputs = engine.step()  # waits inside for a landing adapter when nothing can run
        now = time.perf_counter() - start
        adapters: set[str] = set()
        for out in outputs:
            rid = out.request_id
            if out.new_token_ids:
                self.first.setdefault(rid, now)
                self.last[rid] = now
                self.tokens[rid] = self.tokens.get(rid, 0) + len(out.new_token_ids)
                self.generated += len(out.new_token_ids)
                adapters.update(self.names[rid])
            if out.finished:
                self.engine_metrics[rid] = out.metrics
        if engine.counters.num_steps == ran:  # nothing ran: no record
            return
        self.steps.append({"distinct_adapters": len(adapters), "kv_pages": engine.pool.num_kv,
                           "used_pages": engine.pool.num_pages - engine.pool.num_free})

    def _merge_engine_records(self) -> None:
        """The engine keeps one record per step that ran, as we do: its figures join ours (read
        once at the end: `step_records()` copies up to 100k records)."""
        records = self.engine.step_records()[-len(self.steps):] if self.steps else []
        for ours, theirs in zip(self.steps, records):
            ours.update({k: v for k, v in theirs.items() if k not in _OWN_STEP_KEYS})

    def request_metrics(self) -> list[dict]:
        out = []
        for rid, arrival in self.arrival.items():
            n, first = self.tokens.get(rid, 0), self.first.get(rid)
            engine = self.engine_metrics.get(rid) or {}
            out.append({
                "arrival_s": arrival,
                "ttft_s": first - arrival if first is not None else None,
                "tpot_s": (self.last[rid] - first) / (n - 1) if n > 1 and first is not None else None,
                "queue_s": engine.get("queue_s"), "adapter_wait_s": engine.get("adapter_wait_s"),
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


class LorafleetNoPrefixCache(LorafleetInProcess):
    """lorafleet with its prefix cache off (`Engine(prefix_cache=False)`): what the cache buys."""

    name = "lorafleet-no-prefix-cache"
    engine_options = {"prefix_cache": False}


class LorafleetLRU(LorafleetInProcess):
    """lorafleet evicting cached KV and idle adapters in plain LRU order (`eviction="lru"`): what
    the cost order buys under pool pressure."""

    name = "lorafleet-lru"
    engine_options = {"eviction": "lru"}
