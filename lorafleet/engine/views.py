"""What the engine says about itself, read across its parts and written by none of them: the
stats snapshot (`Engine.stats`, `/v1/stats`), the per-adapter queues, and the integrity check the
tests run after every step. Read only: each part keeps the one writer of its own state."""

from __future__ import annotations

import itertools

from lorafleet.engine.regression import live_switches
from lorafleet.engine.stats import summary
from lorafleet.snapshot import (AdapterDetail, AdapterInfo, CounterStats, EngineStats, LoraQueues, MixCounts,
                                PoolCounts)


def lora_queues(scheduler) -> LoraQueues:
    """Requests per adapter name, running and waiting (a mix counts for each of its adapters)."""
    running: dict[str, int] = {}
    waiting: dict[str, int] = {}
    for counts, reqs in ((running, scheduler.running), (waiting, scheduler.waiting)):
        for r in reqs:
            for name in r.names:
                counts[name] = counts.get(name, 0) + 1
    return {"running": running, "waiting": waiting}


def adapter_details(adapters) -> tuple[dict[str, AdapterDetail], list[str]]:
    """(`adapter_details`, `untouched_adapters`) of `Engine.stats()`. `adapter_details`: name -> its
    record (`AdapterEntry.info`) with the p50/p99 of its recent loads (`load_s`) and of its
    finished requests' exposed waits (`stall_s`), for every adapter a request ever named or that
    holds memory; `untouched_adapters`: the names of the rest,
    registered on disk and never asked for (nothing to say but the name: their files are first
    read on their first request). A fleet of thousands polled every second pays for the adapters
    in use, not for the registry (`lorafleet bench stats-cost`)."""
    details: dict[str, AdapterDetail] = {}
    untouched: list[str] = []
    for e in adapters.entries.values():
        if e.tier == "disk" and not (e.hits or e.misses or e.users or e.disk_loads or e.error):
            untouched.append(e.name)
        else:
            info: AdapterInfo = e.info()
            details[e.name] = {**info, "load_s": summary(e.recent_loads), "stall_s": summary(e.recent_waits)}
    return details, untouched


def stats(engine) -> EngineStats:
    pool: PoolCounts = engine.pool.stats()
    details, untouched = adapter_details(engine.adapters)
    mixes: MixCounts = engine.counters.mixes()
    counters: CounterStats = engine.counters.snapshot()
    return {
        "model": str(engine.model_path),
        "device": str(engine.device),
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "quantization": engine.model.quantization,  # None, int8 or int4 (the base's projections and LM head)
        "weight_bytes": engine.model.weight_bytes,
        "max_model_len": engine.max_model_len,
        "pool": {**pool, "page_map": engine.pool.page_runs()},
        "adapters": engine.adapters.stats(),
        "prefix_cache": engine.kv.stats(),
        "eviction": engine.arbiter.eviction_stats(),
        "adapter_details": details,
        "untouched_adapters": untouched,
        "switches": live_switches(engine.counters.steps),
        "scheduler": engine.scheduler.policy.snapshot(),
        "kv_cache_usage": pool["kv_pages"] / pool["total_pages"],
        "num_running": len(engine.scheduler.running),
        "num_waiting": engine.scheduler.num_waiting,
        # requests on several adapters: counted at arrival, and those running or waiting now
        "mixes": {**mixes, "running": sum(r.mix is not None for r in engine.scheduler.running),
                  "waiting": sum(r.mix is not None for r in engine.scheduler.waiting)},
        "kernels": engine.model.kernels.name,
        "kernels_label": engine.model.kernels.label,  # with the CPU variant: what `lorafleet verify --socket` checks
        "self_check": engine.self_check,  # engine/selfcheck.py's finding at start, None where it did not run
        "decode_graphs": engine.runner.graphs.stats() if engine.runner.graphs else {"enabled": False},
        **counters,
    }


def check_integrity(engine) -> None:
    """The pool's, the prefix cache's and the registry's own checks; then every request that
    names an adapter holds its entry, the registry's user and pin counts equal the requests'
    holds and the running ones' pins, block tables belong to running requests alone and hold
    what they computed, every full block of it named for the prefix cache, and only the step in
    flight has tokens drawn and not read."""
    engine.pool.check_integrity()
    engine.kv.check_integrity()
    engine.adapters.check_integrity()
    users: dict = {}
    pins: dict = {}
    for r in engine.requests.values():
        assert tuple(e.name for e in r.loras) == r.names, f"{r.request_id}: adapters not held"
        assert len(r.scales) == len(r.loras), f"{r.request_id}: a scale per adapter"
        for e in r.loras:
            users[e] = users.get(e, 0) + 1
    for r in engine.scheduler.running:
        for e in r.loras:
            pins[e] = pins.get(e, 0) + 1
    for entry in itertools.chain(engine.adapters.entries.values(), engine.adapters.retired):
        assert entry.users == users.pop(entry, 0), f"adapter {entry.name!r}: users count is off"
        assert entry.pins == pins.pop(entry, 0), f"adapter {entry.name!r}: pin count is off"
    assert not users, "requests hold adapters the registry does not know"
    live = {r.request_id for r in engine.scheduler.running}
    assert live <= set(engine.kv.rows), "a running request has no block table"
    assert set(engine.kv.rows) <= live, "pages held by a request that is not running"
    drawing = set(engine.inflight.reqs) if engine.inflight is not None else set()
    for r in engine.requests.values():  # a token drawn and not read: only in the step in flight
        assert r.num_pending == (r in drawing), f"{r.request_id}: {r.num_pending} tokens drawn and not read"
    kv = engine.kv
    for r in engine.scheduler.running:  # the scheduler names blocks only when a chunk fills one
        row = kv.rows[r.request_id]
        assert kv.capacity(r.request_id) >= r.num_computed, f"{r.request_id}: computed past its pages"
        assert not kv.prefix_cache or kv.num_hashed[row] >= r.num_computed // kv.block_size, \
            f"{r.request_id}: a full block left unnamed"
