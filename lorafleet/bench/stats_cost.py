"""`lorafleet bench stats-cost`: what `GET /v1/stats` costs the engine (< 1% of its
throughput at one poll per second).

The daemon answers `/v1/stats` (and `/metrics`) with `server.metrics.engine_snapshot(engine)`,
run on the engine thread between two steps, then serialises it to JSON with
`server.metrics.stats_body` (on the event loop's thread, which holds the GIL meanwhile: the
engine thread waits either way). One engine, in-process:
  setup  `num_adapters` adapters registered (on disk; ranks 8/16 on q/k/v/o, as the switch bench),
         then a decode-heavy workload mixing adapters until the step log holds `min_steps` steps:
         rounds of `requests` requests (default 3 x `batch`; `batch` decoding at once, `max_tokens`
         tokens each) over `mix` adapters, another `mix` each round: adapters load in the
         background, several stay resident, and the live switch regression over the last 1,000
         steps has loads to fit.
  poll   (after `gc.freeze()`, as the daemon once started)
         `polls` polls timed between steps of that workload, still running; a poll is
         `engine_snapshot(engine)` plus `stats_body(...)` (the route's own): median and p99, the
         snapshot's part alone, the JSON's size. `cost_fraction`: the mean poll (what throughput
         loses: the rare slow poll, a garbage collection, counts) over the
         `interval_s` between polls (1 s: the issue's figure, target < 1%). `profile`: a few more
         polls under cProfile, time per poll in each function `engine_snapshot` and `Engine.stats`
         call (cProfile's overhead inflates the times: read the shares).
  A/B    the same workload (same prompts, same adapters, resident by then) run `rounds` times
         without polls and `rounds` times with one poll between steps whenever >= `interval_s`
         has passed since the last began (one client polling at 1 Hz, as the engine thread sees
         it), interleaved off, on, off, on, ...: generated tokens/s of each (medians) and their
         ratio, also per pair (each polled run over the one before it). A noisy machine moves these
         more than 1%: quote the ratio of one run, with `other_cores` (what other processes kept
         busy meanwhile) and `steps_s_ratio` (the steps' own time, polled runs over the others:
         where it follows the tokens/s ratio, the steps got slower, the polls did not take the time).
"""

from __future__ import annotations

import cProfile
import gc
import json
import os
import pstats
import random
import statistics
import time
from typing import Callable, cast

from lorafleet.bench.adapters import build_adapters
from lorafleet.bench.fixtures import build_base, get_shape
from lorafleet.bench.jobs import WARM_UP_PROMPT
from lorafleet.snapshot import ServerInfo
from lorafleet.bench.machine import cpu_seconds, load_average, other_cores, other_cpu_seconds
from lorafleet.bench.workloads import ATTENTION_MODULES, FIRST_ORDINARY_ID

TARGET_FRACTION = 0.01
INTERVAL_S = 1.0          # one poll per second
PROFILE_POLLS = 10
WAVES = 3                 # requests per run: three batches' worth, by default
RUN_TIMEOUT_S = 900.0     # one run of the workload that takes longer is stuck: give up


def poll(engine) -> tuple[float, float, int]:
    """One `/v1/stats` as the engine sees it: (seconds in all, seconds of the snapshot, JSON bytes)."""
    from lorafleet.server.metrics import engine_snapshot, stats_body

    t0 = time.perf_counter()
    snapshot = engine_snapshot(engine)
    t1 = time.perf_counter()
    body = stats_body("bench", cast(ServerInfo, {}), snapshot)  # the engine's part is what is measured
    return time.perf_counter() - t0, t1 - t0, len(body)


def run_stats_cost(shape: str = "smol", num_adapters: int = 1000, batch: int = 16, requests: int | None = None,
                   max_tokens: int = 48, mix: int = 16, min_steps: int = 1000, polls: int = 50, rounds: int = 3,
                   interval_s: float = INTERVAL_S, prompt_len: int = 16, device: str = "auto",
                   threads: int | None = None, pool_bytes: int | None = None, root=None, progress=None) -> dict:
    """The report of `lorafleet bench stats-cost` on one engine (the module doc: setup, poll, A/B)."""
    import torch

    from lorafleet import Engine, SamplingParams
    from lorafleet.server.metrics import engine_snapshot

    if threads:
        torch.set_num_threads(threads)
    mix, requests = min(mix, num_adapters), requests or WAVES * batch
    say = progress or (lambda message: None)
    base = build_base(shape, root)
    say(f"{shape}: building or reusing {num_adapters} adapters")
    folders = dict(build_adapters(base, num_adapters, ranks=(8, 16), targets=ATTENTION_MODULES))
    engine = Engine(base, device=device, max_num_seqs=batch, pool_bytes=pool_bytes)  # None: the daemon's default
    try:
        register_s = _register_and_warm_up(engine, folders)
        workload = _workload(shape, list(folders), num_adapters, mix, requests, prompt_len)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        say(f"{shape}: filling the step log to {min_steps} steps")
        fill_rounds, fill_s = _fill_step_log(engine, workload, params, min_steps)
        # as the daemon does once it has started (server/daemon.py): what lives for good (the
        # model, the registry) leaves the collector's sight, so a collection a poll's
        # allocations set off does not walk it
        gc.collect()
        gc.freeze()
        say(f"{shape}: {polls} polls between steps")
        times, snaps, sizes, profiler = _timed_polls(engine, workload, params, polls)
        snapshot = engine_snapshot(engine)
        log_steps = len(engine.step_records())
        say(f"{shape}: A/B, {rounds} runs without polls and {rounds} with one a second, interleaved")
        runs = _ab_runs(engine, workload, params, rounds, interval_s)
    finally:
        gc.unfreeze()
        engine.close()

    poll_report, ab = _poll_report(times, snaps, sizes, snapshot), _ab_report(runs, rounds)
    return {
        "benchmark": "stats-cost", "shape": shape, "device": str(engine.device), "num_adapters": num_adapters,
        "batch": batch, "requests": requests, "max_tokens": max_tokens, "prompt_len": prompt_len, "mix": mix,
        "threads": torch.get_num_threads(),
        "setup": {"register_s": register_s, "fill_rounds": fill_rounds, "fill_s": fill_s},
        "engine": _engine_report(snapshot, log_steps), "poll": poll_report,
        "interval_s": interval_s, "cost_fraction": poll_report["mean_s"] / interval_s, "target": TARGET_FRACTION,
        "target_met": poll_report["mean_s"] / interval_s < TARGET_FRACTION if interval_s == INTERVAL_S else None,
        "profile": _profile(profiler, PROFILE_POLLS), "ab": ab,
        "environment": {"load_average_after": load_average(), "cpu_count": os.cpu_count()},
    }


def _register_and_warm_up(engine, folders: dict) -> float:
    """Registers every adapter of `folders` (name -> folder) and runs a first short generation;
    the seconds the registrations took."""
    from lorafleet import SamplingParams

    t0 = time.perf_counter()
    for name in folders:
        engine.register_adapter(name, folders[name])
    register_s = time.perf_counter() - t0
    engine.generate([WARM_UP_PROMPT] * 2, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    return register_s


def _workload(shape: str, adapters: list[str], num_adapters: int, mix: int, requests: int,
              prompt_len: int) -> Callable[[int], list[tuple[list[int], str]]]:
    """Round k's requests, (prompt, adapter) each: the same `requests` random prompts every round,
    over `mix` adapters spread over the registry, another set each round."""
    rng = random.Random(0)
    vocab = get_shape(shape).vocab_size
    prompts = [[rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(prompt_len)] for _ in range(requests)]
    stride = max(1, num_adapters // mix)

    def workload(k: int) -> list[tuple[list[int], str]]:
        names = [adapters[(j * stride + k) % num_adapters] for j in range(mix)]
        return [(p, names[i % len(names)]) for i, p in enumerate(prompts)]
    return workload


def _fill_step_log(engine, workload, params, min_steps: int) -> tuple[int, float]:
    """Rounds of the workload (round 1, 2, ...) until the step log holds `min_steps` steps: (rounds, seconds)."""
    t0, fill_rounds = time.perf_counter(), 0
    while len(engine.step_records()) < min_steps:
        fill_rounds += 1
        _serve(engine, workload(fill_rounds), params)
    return fill_rounds, time.perf_counter() - t0


def _timed_polls(engine, workload, params, polls: int) -> tuple[list[float], list[float], list[int], cProfile.Profile]:
    """`polls` polls between steps of round 0's workload, then PROFILE_POLLS more under cProfile: each
    timed poll's seconds, its snapshot's seconds, its JSON's bytes; the profiler."""
    times: list[float] = []
    snaps: list[float] = []
    sizes: list[int] = []
    profiled = 0
    profiler = cProfile.Profile()

    def timed(engine):
        nonlocal profiled
        if len(times) < polls:
            seconds, snapshot_s, size = poll(engine)
            times.append(seconds)
            snaps.append(snapshot_s)
            sizes.append(size)
        elif profiled < PROFILE_POLLS:
            profiler.runcall(poll, engine)
            profiled += 1
    while len(times) < polls or profiled < PROFILE_POLLS:
        _serve(engine, workload(0), params, between=timed)
    return times, snaps, sizes, profiler


def _ab_runs(engine, workload, params, rounds: int, interval_s: float) -> list[dict]:
    """Round 0's workload `rounds` times without polls and `rounds` times with one every `interval_s`,
    interleaved off, on, off, ...: each run's time, tokens, steps, polls and the other cores' load."""
    runs = []
    gc.collect()
    for i in range(2 * rounds):
        polled: list[float]
        polling, polled = i % 2 == 1, []
        cpu, before = cpu_seconds(), engine.counters.num_steps
        between = _every(interval_s, polled) if polling else None
        seconds, tokens = _serve(engine, workload(0), params, between=between)
        steps = engine.step_records()[before - engine.counters.num_steps:]
        runs.append({"polling": polling, "seconds": seconds, "generated_tokens": tokens,
                     "tokens_per_s": tokens / seconds, "steps": len(steps),
                     "steps_s": sum(r["time_s"] for r in steps), "polls": len(polled), "poll_s": sum(polled),
                     "other_cores": other_cores(other_cpu_seconds(cpu, cpu_seconds()), seconds)})
    return runs


def _engine_report(snapshot, log_steps: int) -> dict:
    """What the polled engine held: its step log, adapters and pool, and the live switch regression."""
    return {"steps_in_log": log_steps, "window_steps": snapshot["switches"]["window_steps"],
            "registered": snapshot["adapters"]["registered"], "tiers": snapshot["adapters"]["tiers"],
            "page_map_runs": len(snapshot["pool"]["page_map"]), "total_pages": snapshot["pool"]["total_pages"],
            "pool_bytes": snapshot["pool"]["total_pages"] * snapshot["pool"]["page_bytes"],
            "switch_slope_s": reg["slope_s"] if (reg := snapshot["switches"]["regression"]) else None,
            "loads_in_window": sum(k * n for k, n in snapshot["switches"]["loaded_per_step"])}


def _poll_report(times: list[float], snaps: list[float], sizes: list[int], snapshot) -> dict:
    """The timed polls: their seconds (median, p99, mean, min), the snapshot's part, the JSON's bytes
    (and the five largest keys')."""
    from lorafleet.engine.stats import percentile

    return {"calls": len(times), "median_s": statistics.median(times), "p99_s": percentile(times, 0.99),
            "mean_s": statistics.fmean(times), "min_s": min(times),
            "snapshot_median_s": statistics.median(snaps), "json_bytes": int(statistics.median(sizes)),
            "json_bytes_by_key": dict(sorted(((k, len(json.dumps(v))) for k, v in snapshot.items()),
                                             key=lambda kv: -kv[1])[:5])}


def _ab_report(runs: list[dict], rounds: int) -> dict:
    """The A/B runs and their medians: tokens/s with polls over without (overall and per pair), the
    steps' own time likewise, and the polls' share of the polled runs."""
    off = statistics.median(r["tokens_per_s"] for r in runs if not r["polling"])
    on = statistics.median(r["tokens_per_s"] for r in runs if r["polling"])
    steps_on = statistics.median(r["steps_s"] for r in runs if r["polling"])
    steps_off = statistics.median(r["steps_s"] for r in runs if not r["polling"])
    # each polled run over the one without polls before it
    pairs = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(runs[::2], runs[1::2])]
    return {"rounds": rounds, "order": ["on" if r["polling"] else "off" for r in runs], "runs": runs,
            "tokens_per_s_off": off, "tokens_per_s_on": on, "ratio": on / off, "pair_ratios": pairs,
            "steps_s_ratio": steps_on / steps_off,
            "polls": sum(r["polls"] for r in runs), "poll_share_of_on_runs":
                sum(r["poll_s"] for r in runs if r["polling"]) / sum(r["seconds"] for r in runs if r["polling"])}


def _serve(engine, requests: list[tuple[list[int], str]], params, between=None,
           timeout_s: float = RUN_TIMEOUT_S) -> tuple[float, int]:
    """Add the requests, step until every one finished (`between(engine)` after each step but
    the last); (wall seconds, tokens generated). RuntimeError after `timeout_s`."""
    t0 = time.perf_counter()
    ids = {engine.add_request(prompt, params, adapter=adapter) for prompt, adapter in requests}
    tokens = 0
    while time.perf_counter() - t0 < timeout_s:
        for out in engine.step():
            if out.finished and out.request_id in ids:
                if out.finish_reason != "length":
                    raise RuntimeError(f"request {out.request_id} ended with {out.finish_reason}: {out.error}")
                ids.discard(out.request_id)
                tokens += len(out.token_ids)
        if not ids:
            return time.perf_counter() - t0, tokens
        if between is not None:
            between(engine)
    for rid in ids:
        engine.abort(rid)
    raise RuntimeError(f"{len(ids)} of {len(requests)} requests unfinished after {timeout_s:g} s")


def _every(interval_s: float, polled: list[float]):
    """A `between` that polls once >= `interval_s` has passed since the run began or the last
    poll began (a client polling at 1 / interval_s Hz), and appends each poll's seconds to `polled`."""
    last = time.perf_counter()

    def between(engine):
        nonlocal last
        now = time.perf_counter()
        if now - last >= interval_s:
            last = now
            polled.append(poll(engine)[0])
    return between


def _profile(profiler: cProfile.Profile, calls: int, top: int = 12) -> list[dict]:
    """Time per poll in each function `poll`, `engine_snapshot` and `Engine.stats` call (those
    three expanded), most first: which part of a poll costs what (cProfile's own overhead
    included, so the shares matter more than the absolute times)."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]  # undocumented, not in typeshed
    expanded = {key for key in stats if (key[0].endswith(os.path.join("bench", "stats_cost.py")) and key[2] == "poll")
                or (key[0].endswith(os.path.join("server", "metrics.py")) and key[2] == "engine_snapshot")
                or (key[0].endswith(os.path.join("engine", "engine.py")) and key[2] == "stats")}
    rows = []
    for key, (_, _, _, _, callers) in stats.items():
        if key in expanded:
            continue
        from_expanded = [v for caller, v in callers.items() if caller in expanded]
        if from_expanded:
            rows.append({"function": _label(key), "calls_per_poll": sum(v[1] for v in from_expanded) / calls,
                         "ms_per_poll": 1e3 * sum(v[3] for v in from_expanded) / calls})
    total = sum(r["ms_per_poll"] for r in rows) or 1.0
    rows.sort(key=lambda r: -r["ms_per_poll"])
    return [{**r, "share": r["ms_per_poll"] / total} for r in rows[:top]]


def _label(key: tuple) -> str:
    path, line, name = key
    if path == "~":
        return name  # a builtin: "<built-in method ...>"
    parts = path.replace(os.sep, "/").split("/")
    short = "/".join(parts[parts.index("lorafleet") + 1:]) if "lorafleet" in parts else parts[-1]
    return f"{name} ({short}:{line})"
