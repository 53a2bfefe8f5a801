"""The systems under test, run in-process on the micro model: a warm-up before the clock,
arrivals replayed, every request served and measured, replays repeated, baselines capped and
skipped as the report says."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from lorafleet.bench.adapters import warm_up_adapter, workload_adapters
from lorafleet.bench.jobs import MAX_REPEATS, Job, more_replays, weight_bytes
from lorafleet.bench.lorafleet_system import LorafleetInProcess
from lorafleet.bench.systems import MergedAccounting, get_system
from lorafleet.bench.workloads import BenchRequest, Workload, make_requests
from tests.fixtures import slow_down

SMALL = Workload("small", 6, (4, 12), (3, 6), num_adapters=3, ranks=(4, 8), base_fraction=0.2, seed=2)


def job_for(micro_dir, load: Workload, system: str = "lorafleet", **kwargs) -> Job:
    adapters = {n: str(p) for n, p in workload_adapters(micro_dir, load)}
    return Job(system, str(micro_dir), make_requests(load, 512), adapters, load.residency, load.pool_fraction,
               threads=1, warm_up_adapter=str(warm_up_adapter(micro_dir)), **kwargs)


def check_served(result, job: Job) -> None:
    assert result.status == "ok", result.reason
    assert result.num_requests == len(job.requests)
    assert result.generated_tokens == sum(r.max_tokens for r in job.requests)
    assert len(result.requests) == len(job.requests)
    for m in result.requests:
        assert m["ttft_s"] > 0 and m["tpot_s"] >= 0


def test_lorafleet_replays_poisson_arrivals_and_measures_every_request(micro_dir):
    job = job_for(micro_dir, dataclasses.replace(SMALL, arrival="poisson", rate=40.0))
    result = LorafleetInProcess(threads=1).run(job)
    check_served(result, job)
    assert result.seconds >= job.requests[-1].arrival_s  # the last request was not served early
    assert sorted(m["arrival_s"] for m in result.requests) == [r.arrival_s for r in job.requests]
    assert result.steps and all(s["time_s"] > 0 and s["num_tokens"] > 0 for s in result.steps if s["num_seqs"])
    pool = result.details["pool"]
    assert 0 < pool["peak_occupancy"] <= 1 and pool["peak_adapter_pages"] > 0


def test_adapters_on_disk_are_loaded_on_first_use_and_the_wait_is_exposed(micro_dir, monkeypatch):
    from lorafleet.memory import prefetch

    slow_down(monkeypatch, prefetch, "_load", 20 * prefetch.MAX_TICK_WAIT_S)  # longer than the tick ever waits
    job = job_for(micro_dir, dataclasses.replace(SMALL, residency="registered"))
    result = LorafleetInProcess(threads=1).run(job)
    check_served(result, job)
    waits = [m["adapter_wait_s"] for m in result.requests if m["adapter"] is not None]
    assert sum(waits) > 0
    assert all(m["adapter_wait_s"] in (0, 0.0, None) for m in result.requests if m["adapter"] is None)
    assert any(s["adapters_loaded"] for s in result.steps)  # the engine's prefetcher landed them
    assert len(result.details["repeats"]) == 1  # a second replay would find them loaded: not cold


@pytest.mark.parametrize("seconds, again", [([0.1], True), ([0.1] * 3, True), ([0.4] * 3, False), ([2.0, 2.0], True),
                                            ([0.1] * 5, False), ([30.0], False), ([4.0, 4.0], False)])
def test_replays_repeat_to_three_and_a_second_of_serving_but_stop_at_five_or_five_seconds(seconds, again):
    assert more_replays(seconds) is again


@pytest.fixture(scope="module")
def small_run(micro_dir):
    return LorafleetInProcess(threads=1).run(job_for(micro_dir, SMALL))


def test_every_step_carries_the_engines_own_record(small_run):
    result = small_run
    for step in result.steps:  # host_s and num_generated exist only in the engine's records
        assert 0 <= step["host_s"] <= step["time_s"] and step["num_generated"] <= step["num_seqs"]
        assert 0 <= step["distinct_adapters"] <= step["num_seqs"]
    assert sum(s["num_generated"] for s in result.steps) == result.generated_tokens


def test_lorafleet_warms_up_its_kernels_and_an_adapter_before_the_clock(small_run):
    warm = small_run.details["warm_up"]
    assert warm["requests"] == 2 and warm["adapter_loaded"] and warm["seconds"] > 0
    assert set(warm["kernels_loaded"]) == {"lora_cpu", "paged_attention_cpu"}


def test_a_short_replay_is_repeated_and_the_median_replay_is_reported(small_run):
    result = small_run
    repeats = result.details["repeats"]
    assert 1 < len(repeats) <= MAX_REPEATS  # micro serves SMALL in far less than MIN_TIMED_S
    middle = sorted(r["tokens_per_s"] for r in repeats)[(len(repeats) - 1) // 2]
    assert result.generated_tokens / result.seconds == pytest.approx(middle)


def test_a_pool_fraction_leaves_room_for_that_share_of_the_adapters_only(micro_dir):
    from lorafleet.bench.jobs import adapter_bytes, workload_pool_bytes

    load = dataclasses.replace(SMALL, num_requests=12, num_adapters=8, residency="registered", pool_fraction=0.25)
    job = job_for(micro_dir, load)
    result = LorafleetInProcess(threads=1).run(job)
    check_served(result, job)
    page = result.details["pool"]["page_bytes"]
    room = result.details["pool_bytes"] - workload_pool_bytes(micro_dir, job.requests, 4, floor=False)
    share = adapter_bytes(job.adapters) * 0.25
    assert share <= room <= share + 3 * page  # page rounding: one page per adapter that fits


@pytest.mark.parametrize("system", ["transformers", "peft-groups", "peft-mixed"])
def test_a_baseline_serves_the_same_requests_in_static_batches(micro_dir, system):
    pytest.importorskip("peft")
    job = job_for(micro_dir, SMALL, system)
    result = get_system(system)(threads=1, batch_size=2).run(job)
    check_served(result, job)
    assert result.details["computed_tokens"] >= result.generated_tokens
    assert result.details["warm_up"]["requests"] == 2  # one on an adapter (ignored by transformers), one base


def test_a_capped_baseline_serves_the_first_requests_and_says_so(micro_dir):
    from lorafleet.bench.static_batch import TransformersGenerate

    job = job_for(micro_dir, SMALL, "transformers", max_requests=2)
    result = TransformersGenerate(threads=1).run(job)
    assert result.num_requests == 2 and result.generated_tokens == sum(r.max_tokens for r in job.requests[:2])
    assert "first 2 of 6" in result.details["capped"]


def test_peft_systems_skip_a_workload_without_adapters(micro_dir):
    from lorafleet.bench.static_batch import PeftMixed

    result = PeftMixed(threads=1).run(job_for(micro_dir, dataclasses.replace(SMALL, num_adapters=0)))
    assert result.status == "skipped" and "no adapters" in result.reason


def test_peft_groups_batches_one_adapter_at_a_time_oldest_first():
    from lorafleet.bench.static_batch import PeftGroups

    waiting = [BenchRequest([3], 1, a) for a in ["x", "y", "x", None, "x", "y"]]
    system = PeftGroups(threads=1, batch_size=2)
    assert [r.adapter for r in system._pick(waiting)] == ["x", "x"]
    assert [r.adapter for r in system._pick(waiting)] == ["y", "y"]
    assert [r.adapter for r in waiting] == [None, "x"]


def test_merged_accounting_charges_one_base_copy_per_adapter_used(micro_dir):
    job = job_for(micro_dir, SMALL, "merged")
    used = {r.adapter for r in job.requests} - {None}
    result = MergedAccounting().run(job)
    assert result.details["memory_bytes"] == weight_bytes(micro_dir) * (1 + len(used))


def test_a_job_round_trips_through_json(micro_dir):
    job = job_for(micro_dir, SMALL, max_requests=3)
    assert Job.from_json(job.to_json()) == job


def test_the_system_modules_do_not_import_the_registry():
    code = ("import sys, lorafleet.bench.lorafleet_system, lorafleet.bench.static_batch, "
            "lorafleet.bench.daemon_system, lorafleet.bench.llamacpp, lorafleet.bench.llamacpp_build, "
            "lorafleet.bench.llamacpp_convert; "
            "print('lorafleet.bench.systems' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_other_cores_is_the_machines_busy_time_less_ours_over_the_wall_time():
    from lorafleet.bench.machine import cpu_seconds, other_cores, other_cpu_seconds

    assert other_cores(other_cpu_seconds((10.0, 2.0), (12.5, 3.0)), 1.0) == 1.5  # 2.5 busy core-seconds, 1 ours
    assert other_cpu_seconds(None, (1.0, 1.0)) is None and other_cores(None, 1.0) is None
    assert other_cores(0.05, 0.05) is None  # shorter than the kernel's accounting can tell
    busy, ours = cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert cpu_seconds((child.pid,))[1] >= ours and busy >= ours > 0
    finally:
        child.kill()
        child.wait()


@pytest.mark.heavy  # a whole benchmark run
def test_the_prefix_cache_variants_serve_the_same_requests_and_say_what_they_ran(micro_dir):
    """Shared system prompts: lorafleet finds them cached (each replay starts with the cache
    empty, so the hits are the replay's own); the cacheless variant finds nothing; the LRU one
    runs its order."""
    from lorafleet.bench.lorafleet_system import LorafleetLRU, LorafleetNoPrefixCache

    load = Workload("sp", 8, (10, 20), (3, 4), num_adapters=2, ranks=(4,), tenants=2, system_len=40,
                    arrival="poisson", rate=20.0, seed=3)
    job = job_for(micro_dir, load)
    runs = {cls.name: cls(threads=1).run(job) for cls in (LorafleetInProcess, LorafleetNoPrefixCache, LorafleetLRU)}
    for result in runs.values():
        check_served(result, job)
    cache, replays = runs["lorafleet"].details["prefix_cache"], len(runs["lorafleet"].details["repeats"])
    # at most the 2 system-prompt blocks of each request per replay: a replay that found the
    # previous one's blocks would also hit each prompt's third block (its question's start)
    assert cache["enabled"] and 0 < cache["hit_tokens"] <= replays * len(job.requests) * 32
    assert runs["lorafleet-no-prefix-cache"].details["prefix_cache"]["hit_tokens"] == 0
    assert not runs["lorafleet-no-prefix-cache"].details["prefix_cache"]["enabled"]
    assert runs["lorafleet-lru"].details["eviction"]["policy"] == "lru"
    assert runs["lorafleet"].details["eviction"]["policy"] == "cost"
