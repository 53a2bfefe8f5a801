"""The switch plot compares steps of one shape, or says that no such comparison exists."""

from __future__ import annotations

import pytest

from lorafleet.bench import plots
from lorafleet.engine.regression import switch_regressions

pytestmark = pytest.mark.unit


def step(seqs: int, distinct: int, per_token_s: float) -> dict:
    return {"time_s": per_token_s * seqs, "num_seqs": seqs, "num_tokens": seqs, "distinct_adapters": distinct,
            "adapters_loaded": 0}


def test_the_switch_plot_draws_one_shapes_steps_when_adapters_vary_within_it(tmp_path):
    pytest.importorskip("matplotlib")
    steps = [step(8, d, 0.001 + 1e-5 * d) for d in (1, 2, 3, 4) * 5] + [step(2, 1, 0.004)]
    runs = [{"model": "micro", "steps": steps, "regressions": switch_regressions(steps)}]
    png = plots.plot_switch(runs, "switches", tmp_path / "switch.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_switch_plot_refuses_steps_whose_adapters_change_only_with_their_shape(tmp_path):
    """Bigger batches mixing more adapters: a plot of them would draw batch size."""
    steps = [step(b, b // 2, 0.01 / b) for b in (2, 4, 8, 16) for _ in range(3)]
    runs = [{"model": "micro", "steps": steps, "regressions": switch_regressions(steps)}]
    with pytest.raises(plots.PlotUnavailable, match="nothing to draw"):
        plots.plot_switch(runs, "switches", tmp_path / "switch.png")
    assert not (tmp_path / "switch.png").exists()
