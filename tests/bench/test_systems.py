"""The systems under test, run in-process on the micro model: arrivals replayed, every request
served and measured, baselines capped and skipped as the report says."""

from __future__ import annotations

import dataclasses

import pytest

from lorafleet.bench.adapters import workload_adapters
from lorafleet.bench.lorafleet_system import LorafleetInProcess
from lorafleet.bench.systems import Job, MergedAccounting, weight_bytes
from lorafleet.bench.workloads import BenchRequest, Workload, make_requests

SMALL = Workload("small", 6, (4, 12), (3, 6), num_adapters=3, ranks=(4, 8), base_fraction=0.2, seed=2)


def job_for(micro_dir, load: Workload, system: str = "lorafleet", **kwargs) -> Job:
    adapters = {n: str(p) for n, p in workload_adapters(micro_dir, load)}
    return Job(system, str(micro_dir), make_requests(load, 512), adapters, load.residency, load.pool_fraction,
               threads=1, **kwargs)


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


def test_adapters_on_disk_are_loaded_on_first_use_and_the_wait_is_exposed(micro_dir):
    job = job_for(micro_dir, dataclasses.replace(SMALL, residency="registered"))
    result = LorafleetInProcess(threads=1).run(job)
    check_served(result, job)
    waits = [m["adapter_wait_s"] for m in result.requests if m["adapter"] is not None]
    assert sum(waits) > 0
    assert all(m["adapter_wait_s"] in (0, 0.0, None) for m in result.requests if m["adapter"] is None)
    assert any(s["adapters_loaded"] for s in result.steps if s["adapters_loaded"] is not None)
    from lorafleet import Engine

    assert result.details["step_records"] == ("engine" if hasattr(Engine, "step_records") else "bench")


def test_a_pool_fraction_leaves_room_for_that_share_of_the_adapters_only(micro_dir):
    from lorafleet.bench.systems import adapter_bytes, workload_pool_bytes

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
    from lorafleet.bench.systems import get_system

    job = job_for(micro_dir, SMALL, system)
    result = get_system(system)(threads=1, batch_size=2).run(job)
    check_served(result, job)
    assert result.details["computed_tokens"] >= result.generated_tokens


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
