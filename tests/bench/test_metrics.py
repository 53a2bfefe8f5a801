"""The switch regression's arithmetic: least squares, percentiles, the within-batch slope."""

from __future__ import annotations

import random

import pytest

from lorafleet.bench.metrics import cold_warm_ttft, fit_slope, latency_summary, percentile, switch_regression


def test_fit_slope_recovers_an_exact_line():
    slope, intercept = fit_slope([0, 1, 2, 3], [1.0, 3.0, 5.0, 7.0])
    assert slope == pytest.approx(2.0) and intercept == pytest.approx(1.0)


def test_fit_slope_recovers_a_known_slope_through_noise():
    rng = random.Random(0)
    xs = [rng.randint(0, 16) for _ in range(2000)]
    ys = [0.004 + 0.00025 * x + rng.gauss(0, 0.001) for x in xs]
    slope, intercept = fit_slope(xs, ys)
    assert slope == pytest.approx(0.00025, rel=0.05)
    assert intercept == pytest.approx(0.004, rel=0.05)


@pytest.mark.parametrize("xs, ys", [([1], [2]), ([3, 3, 3], [1, 2, 3])])
def test_fit_slope_refuses_data_without_a_slope(xs, ys):
    with pytest.raises(ValueError):
        fit_slope(xs, ys)


def test_percentiles_are_nearest_rank_and_skip_missing_values():
    values = list(range(1, 101))
    assert percentile(values, 0.5) == 50 and percentile(values, 0.99) == 99
    assert percentile([None, 3.0], 0.5) == 3.0 and percentile([None], 0.5) is None


def test_latency_summary_totals_the_exposed_adapter_wait():
    summary = latency_summary([{"ttft_s": 0.1, "tpot_s": 0.01, "queue_s": None, "adapter_wait_s": 0.5},
                               {"ttft_s": 0.3, "tpot_s": 0.02, "queue_s": None, "adapter_wait_s": 0.0}])
    assert summary["ttft_s"] == {"p50": 0.1, "p99": 0.3}
    assert summary["queue_s"]["p50"] is None
    assert summary["adapter_wait_s"]["total"] == 0.5 and summary["adapter_wait_s"]["max"] == 0.5


def synthetic_steps(per_adapter_s: float, seed: int = 0) -> list[dict]:
    """Decode steps where bigger batches mix more adapters and cost less per token: the plain
    slope is confounded by batch size, the within-shape slope is `per_adapter_s`."""
    rng = random.Random(seed)
    steps = []
    for _ in range(3000):
        batch = rng.choice([4, 8, 16, 32])
        distinct = rng.randint(1, batch // 2) + batch // 4
        per_token = 0.02 / batch + 0.001 + per_adapter_s * distinct + rng.gauss(0, 1e-5)
        steps.append({"time_s": per_token * batch, "num_tokens": batch, "num_seqs": batch,
                      "distinct_adapters": distinct, "adapters_loaded": None})
    steps.append({"time_s": 0.05, "num_tokens": 500, "num_seqs": 3, "distinct_adapters": 1})  # a prefill
    steps.append({"time_s": 0.0, "num_tokens": 0, "num_seqs": 0, "distinct_adapters": 0})  # nothing ran
    return steps


def test_the_switch_regression_recovers_the_per_adapter_cost_within_shape():
    reg = switch_regression(synthetic_steps(per_adapter_s=2e-5), "distinct_adapters")
    assert reg["steps"] == 3001  # the step that computed nothing is left out
    assert reg["slope_within_shape_s"] == pytest.approx(2e-5, rel=0.05)
    assert reg["slope_s"] < 0  # the plain fit sees big batches (cheap tokens) with many adapters
    assert [row["distinct_adapters"] for row in reg["table"]] == sorted({row["distinct_adapters"]
                                                                         for row in reg["table"]})


def test_a_flat_switch_cost_fits_a_flat_line():
    reg = switch_regression(synthetic_steps(per_adapter_s=0.0, seed=1), "distinct_adapters")
    assert abs(reg["slope_within_shape_s"]) < 1e-6


def test_the_switch_regression_is_none_when_no_step_knows_the_x():
    assert switch_regression(synthetic_steps(0.0), "adapters_loaded") is None


def test_the_slope_is_also_given_as_a_fraction_of_the_mean_per_token_latency():
    reg = switch_regression(synthetic_steps(per_adapter_s=2e-5), "distinct_adapters")
    assert reg["slope_within_shape_fraction"] == pytest.approx(reg["slope_within_shape_s"] / reg["mean_per_token_s"])


def test_cold_requests_are_the_first_to_each_adapter_and_warm_ones_the_rest():
    requests = [{"arrival_s": t, "adapter": a, "ttft_s": ttft} for t, a, ttft in
                [(0.0, "x", 0.4), (0.1, "y", 0.4), (0.2, "x", 0.1), (0.3, None, 9.0), (0.4, "y", 0.1),
                 (0.5, "x", 0.1)]]
    summary = cold_warm_ttft(requests)
    assert summary["cold"] == {"p50": 0.4, "p99": 0.4, "requests": 2}
    assert summary["warm"]["requests"] == 3
    assert summary["cold_over_warm_p50"] == pytest.approx(4.0)
    assert cold_warm_ttft(requests[:2]) is None  # no warm request
