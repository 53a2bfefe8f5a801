"""The switch-cost regression, isolated: does a step get slower when adapters land?

A decode batch of `batch` requests runs with a fixed shape (every step: `batch` decode rows),
while `cold` more requests for adapters on disk wait behind `max_num_seqs` = `batch`; the
prefetcher loads their adapters (disk -> host -> device pages) on its worker threads during
those decode steps. Each step records how many adapters landed in it. Since every step has the
same shape, the slope of per-token latency against adapters landed is the cost of a switch
(engine bookkeeping plus the workers' competition for the cores), free of the prefill work that
confounds it in mixed workloads. Target: slope < 2% of the mean per-token latency per switch.

`source`: "store" (default) pulls the adapters into a store beside the base, once, and registers
them as the daemon's resolver does (with the pull's digest: loads map and lay out the weights,
no hashing, no re-validation); "folder" registers the adapter folders themselves (every load
reads, validates and hashes).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from pathlib import Path

import torch

from lorafleet.bench.adapters import build_adapters, stored
from lorafleet.bench.fixtures import build_base
from lorafleet.engine.regression import fit_slope


def run_switch_cost(shape: str = "smol", batch: int = 32, cold: int = 96, steps: int = 48,
                    ranks=(8, 16), source: str = "store", progress=None) -> dict:
    from lorafleet import Engine, SamplingParams

    base = build_base(shape)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    adapters = build_adapters(base, batch + cold, ranks, targets)
    folders: Mapping[str, tuple[Path, str | None]] = {name: (path, None) for name, path in adapters}
    if source == "store":
        base, folders = stored(base, adapters)
    engine = Engine(base, device="cpu", pool_bytes=6 << 30, max_num_seqs=batch,
                    host_cache_bytes=4 << 30)
    for name, _ in adapters[:batch]:
        engine.load_adapter(name, folders[name][0])      # the running batch's adapters: warm
    for name, _ in adapters[batch:]:
        engine.register_adapter(name, *folders[name])    # the waiting requests' adapters: on disk
    vocab = engine.model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = lambda: torch.randint(3, vocab, (16,), generator=g).tolist()  # noqa: E731
    running = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for name, _ in adapters[:batch]:
        engine.add_request(prompt(), running, adapter=name)
    engine.step()                                 # the batch's prefill
    waiting = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for name, _ in adapters[batch:]:
        engine.add_request(prompt(), waiting, adapter=name)  # loads start now, in the background
    records = []
    for i in range(steps):
        before = len(engine.step_records())
        engine.step()
        rec = engine.step_records()[before:]
        if rec and rec[0]["num_seqs"] == batch and rec[0]["num_tokens"] == batch:
            records.append(rec[0])
        if progress and i % 8 == 0:
            progress(f"step {i}: {engine.stats()['adapters']['tiers']}")
    while engine.has_unfinished():
        engine.step()
    engine.close()
    xs = [r["adapters_loaded"] for r in records]
    ys = [r["time_s"] / r["num_tokens"] for r in records]
    mean = statistics.fmean(ys)
    table = []
    for x in sorted(set(xs)):
        sel = [y for xx, y in zip(xs, ys) if xx == x]
        table.append({"adapters_loaded": x, "steps": len(sel), "per_token_ms_median": 1e3 * statistics.median(sel)})
    result = {"benchmark": "switch-cost", "shape": shape, "source": source, "batch": batch, "cold_adapters": cold,
              "ranks": list(ranks), "targets": list(targets), "decode_steps": len(records),
              "adapters_landed": sum(xs), "mean_per_token_ms": 1e3 * mean, "table": table}
    try:
        line = fit_slope(xs, ys)
        result.update(slope_ms_per_switch=1e3 * line.slope, slope_fraction=line.slope / mean,
                      target_met=line.slope / mean < 0.02)
    except ValueError as e:
        result.update(slope_ms_per_switch=None, slope_fraction=None, note=str(e))
    return result
