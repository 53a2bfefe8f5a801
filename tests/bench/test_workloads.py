"""Workloads as data: deterministic for a seed, popularity and arrivals as declared."""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter

import pytest

from lorafleet.bench.workloads import WORKLOADS, BenchRequest, Workload, adapter_name, make_requests
from lorafleet.errors import ConfigError

pytestmark = pytest.mark.unit

SHIPPED = ("uniform-8", "uniform-1000", "uniform-1000-tiered", "zipf-1000", "mixed-lengths", "cold-start",
           "base-only", "peer-base", "peer-one-adapter", "peer-round-robin", "quick")


def skewed(**changes) -> Workload:
    return dataclasses.replace(Workload("w", 4000, (4, 8), (4, 8), num_adapters=100), **changes)


def test_every_workload_the_issue_names_is_shipped():
    assert set(SHIPPED) <= set(WORKLOADS)


@pytest.mark.parametrize("name", SHIPPED)
def test_a_workload_gives_the_same_requests_for_the_same_seed(name):
    assert make_requests(WORKLOADS[name], 8192) == make_requests(WORKLOADS[name], 8192)


def test_another_seed_changes_prompts_adapters_and_arrivals():
    load = WORKLOADS["zipf-1000"]
    a, b = make_requests(load, 8192), make_requests(dataclasses.replace(load, seed=1), 8192)
    assert [r.prompt for r in a] != [r.prompt for r in b]
    assert [r.adapter for r in a] != [r.adapter for r in b]
    assert [r.arrival_s for r in a] != [r.arrival_s for r in b]


def test_adapters_and_arrivals_do_not_change_the_prompts():
    plain = Workload("w", 16, (4, 40), (4, 40))
    busy = dataclasses.replace(plain, num_adapters=7, arrival="poisson", rate=3.0, popularity="zipf")
    assert ([(r.prompt, r.max_tokens) for r in make_requests(plain, 500)]
            == [(r.prompt, r.max_tokens) for r in make_requests(busy, 500)])


def test_uniform_8_and_uniform_1000_differ_only_in_the_number_of_adapters():
    eight, thousand = WORKLOADS["uniform-8"], WORKLOADS["uniform-1000"]
    assert dataclasses.replace(thousand, name=eight.name, num_adapters=8, description=eight.description) == eight


def test_the_adapter_sweep_keeps_the_requests_and_changes_only_the_adapters():
    load = WORKLOADS["uniform-8"]
    wide = load.with_adapters(64)
    assert wide.num_adapters == 64 and wide.name == "uniform-8@64"
    a, b = make_requests(load, 8192), make_requests(wide, 8192)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert len({r.adapter for r in b}) > len({r.adapter for r in a}) == 8


def test_uniform_popularity_spreads_requests_evenly_over_the_adapters():
    counts = Counter(r.adapter for r in make_requests(skewed(), 100))
    assert set(counts) == {adapter_name(i) for i in range(100)}
    assert max(counts.values()) < 2.5 * min(counts.values())


def test_zipf_popularity_is_skewed_towards_the_first_adapters():
    counts = Counter(r.adapter for r in make_requests(skewed(popularity="zipf", zipf_alpha=1.0), 100))
    # Zipf(1) over 100: adapter 0 takes 1/H(100) ~ 19%, adapter 9 ~ 1.9%, adapter 99 ~ 0.2%
    share = counts[adapter_name(0)] / 4000
    assert 0.16 < share < 0.23
    assert counts[adapter_name(0)] > 5 * counts[adapter_name(9)]
    top10 = sum(counts[adapter_name(i)] for i in range(10))
    assert top10 / 4000 > 0.5  # uniform would give 10%


def test_poisson_arrivals_start_at_zero_with_gaps_of_mean_one_over_the_rate():
    times = [r.arrival_s for r in make_requests(skewed(arrival="poisson", rate=5.0), 100)]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(1 / 5.0, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 5.0, rel=0.1)  # exponential: sd == mean


def test_all_at_once_arrivals_are_all_at_zero_and_base_only_has_no_adapters():
    requests = make_requests(WORKLOADS["base-only"], 8192)
    assert {r.arrival_s for r in requests} == {0.0}
    assert {r.adapter for r in requests} == {None}


def test_base_fraction_sends_that_share_of_requests_to_the_base_model():
    requests = make_requests(skewed(base_fraction=0.25), 100)
    assert sum(r.adapter is None for r in requests) / len(requests) == pytest.approx(0.25, abs=0.03)


def test_shared_prefix_prompts_start_with_their_tenants_system_prompt():
    load = WORKLOADS["shared-prefix"]
    requests = make_requests(load, 8192)
    by_tenant: dict[int, set] = {}
    for r in requests:
        assert len(r.prompt) == load.system_len + 64
        tenant = int(r.adapter.removeprefix("lora-")) % load.tenants
        by_tenant.setdefault(tenant, set()).add(tuple(r.prompt[:load.system_len]))
    assert all(len(systems) == 1 for systems in by_tenant.values())         # one system prompt per tenant
    assert len({next(iter(s)) for s in by_tenant.values()}) == len(by_tenant)  # and each its own
    assert len({tuple(r.prompt[load.system_len:]) for r in requests}) == len(requests)  # distinct questions
    popular = Counter(r.adapter for r in requests).most_common(1)[0][1]
    assert popular > len(requests) / 10  # Zipf: the first adapter takes a large share
    assert make_requests(load, 8192) == requests


def test_round_robin_gives_the_adapters_in_turn():
    requests = make_requests(skewed(popularity="round-robin", num_adapters=3, num_requests=7), 100)
    assert [r.adapter for r in requests] == [adapter_name(i % 3) for i in range(7)]


def test_the_llama_cpp_comparison_runs_the_same_requests_over_none_one_and_eight_adapters():
    """issue 18: 64 x 64+64 tokens, 8 in flight; the base, one rank-64 adapter on every request,
    8 of them in turn; each also at other numbers in flight."""
    loads = [WORKLOADS[n] for n in ("peer-base", "peer-one-adapter", "peer-round-robin")]
    runs = [make_requests(w, 8192) for w in loads]
    assert all(w.concurrency == 8 and w.ranks == (64,) and w.arrival == "all-at-once" for w in loads)
    lengths = [[(r.prompt, r.max_tokens) for r in run] for run in runs]
    assert lengths[1] == lengths[2] == lengths[0]
    assert {len(r.prompt) for r in runs[0]} == {64} and {r.max_tokens for r in runs[0]} == {64} and len(runs[0]) == 64
    assert [{r.adapter for r in run} for run in runs] == [{None}, {adapter_name(0)},
                                                          {adapter_name(i) for i in range(8)}]
    one = loads[0].with_concurrency(1)
    assert one.name == "peer-base-1-in-flight" and one.concurrency == 1 and make_requests(one, 8192) == runs[0]


def test_requests_are_plain_data_that_round_trip_through_json():
    import json

    r = make_requests(WORKLOADS["quick"], 512)[0]
    assert BenchRequest(**json.loads(json.dumps(dataclasses.asdict(r)))) == r


@pytest.mark.parametrize("changes, field", [
    (dict(arrival="poisson"), "rate"), (dict(arrival="bursty"), "arrival"),
    (dict(popularity="pareto"), "popularity"), (dict(ranks=()), "ranks"),
    (dict(targets=("lm_head",)), "targets"), (dict(base_fraction=1.5), "base_fraction"),
    (dict(residency="host"), "residency"), (dict(num_adapters=-1), "num_adapters"),
    (dict(pool_fraction=0.5), "pool_fraction"), (dict(tenants=3), "system_len"),
    (dict(kv_fraction=0.5), "kv_fraction"), (dict(residency="registered", pool_fraction=0.0), "pool_fraction"),
    (dict(concurrency=0), "concurrency"), (dict(concurrency=4, arrival="poisson", rate=1.0), "concurrency"),
    (dict(popularity="round-robin", base_fraction=0.5), "base_fraction"),
])
def test_a_bad_workload_is_refused_naming_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        skewed(**changes)
