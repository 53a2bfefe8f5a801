"""The switch regression: what an adapter switch costs, from the engine's step records.

Per-token latency of a step (its time over the tokens it computed) against the adapters it
switched to. Two x's, each where known: `adapters_loaded` (adapters that landed in the pool for
that step: switches) and `distinct_adapters` (the adapters its batch mixes: segments of the LoRA
op). Every step that computed tokens counts. The shape of a step moves per-token latency far more
than any switch (a prefill's tokens cost less each than a decode's; a bigger batch amortises the
weights over more tokens) and moves with the x's (a bigger batch mixes more adapters; a load lands
in the step that prefills its request), so the headline slope is fitted within shape: x and y
minus their mean over the steps of the same shape (sequences, tokens bucket), then one fit (the
fixed-effects estimator); the fit over every step pooled is kept beside it. A flat line (slope
~0) says switches cost nothing.

Pure functions, no torch: the engine reports the regression over its recent steps live
(`Engine.stats()["switches"]`, what `lorafleet top` draws) and the bench over a whole run.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import islice
from typing import NamedTuple, Sequence

from lorafleet.engine.stats import percentile


SWITCH_XS = ("adapters_loaded", "distinct_adapters")


class Line(NamedTuple):
    slope: float
    intercept: float


def fit_slope(xs: Sequence[float], ys: Sequence[float]) -> Line:
    """Ordinary least squares y = slope * x + intercept. Raises ValueError with fewer than two
    points or when every x is the same (no slope to fit)."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} xs but {len(ys)} ys")
    n = len(xs)
    if n < 2:
        raise ValueError("a slope needs at least two points")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("every x is the same: no slope to fit")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return Line(slope, my - slope * mx)



def shape_of(step: dict) -> tuple[int, int]:
    """A step's shape for the switch regression: its sequences and its tokens' power-of-two
    bucket (decode steps: tokens == sequences, so the bucket is exact)."""
    return step["num_seqs"], step["num_tokens"].bit_length()


def comparable_groups(steps: list[dict], x: str) -> dict[tuple[int, int], list[dict]]:
    """The steps that computed tokens and know `x`, by shape, keeping only shapes whose steps
    differ in `x`: the only steps that say anything about `x` at a fixed shape."""
    groups = defaultdict(list)
    for s in steps:
        if s.get(x) is not None and s["num_tokens"] > 0:
            groups[shape_of(s)].append(s)
    return {k: v for k, v in groups.items() if len({s[x] for s in v}) > 1}


def _within(groups: list[list[tuple[float, float]]]) -> tuple[list[float], list[float]]:
    """(x, y) pairs minus their group's mean."""
    xs, ys = [], []
    for members in groups:
        mx = sum(v for v, _ in members) / len(members)
        my = sum(y for _, y in members) / len(members)
        xs += [v - mx for v, _ in members]
        ys += [y - my for _, y in members]
    return xs, ys


def switch_regression(steps: list[dict], x: str) -> dict | None:
    """The regression of per-token latency (s) on `x` over the steps that computed tokens;
    None when no step knows `x`. Keys: x, steps, table (per x value: steps, decode steps, median
    and mean per-token ms, mean sequences and tokens, all shapes together), mean_per_token_s;
    the headline `slope_s` (`slope_fraction`: over the mean per-token latency; issue 5 asks
    < 0.02 per switch) is fitted within shape, over `comparable_steps` steps in
    `comparable_shapes` shapes (`comparable_groups`); `slope_pooled_s` pools every step
    (confounded: bigger batches mix more adapters and cost less per token). `note` says why a
    slope is None."""
    sample = [s for s in steps if s.get(x) is not None and s["num_tokens"] > 0]
    if not sample:
        return None
    per_token = [s["time_s"] / s["num_tokens"] for s in sample]
    buckets = defaultdict(list)
    for s, y in zip(sample, per_token):
        buckets[s[x]].append((y, s))
    table = [{x: k, "steps": len(v), "decode_steps": sum(s["num_tokens"] == s["num_seqs"] for _, s in v),
              "per_token_ms_p50": percentile([y for y, _ in v], 0.5) * 1e3,
              "per_token_ms_mean": sum(y for y, _ in v) / len(v) * 1e3,
              "mean_seqs": sum(s["num_seqs"] for _, s in v) / len(v),
              "mean_tokens": sum(s["num_tokens"] for _, s in v) / len(v)} for k, v in sorted(buckets.items())]
    mean = sum(per_token) / len(per_token)
    groups = comparable_groups(sample, x)
    out = {"x": x, "steps": len(sample), "table": table, "mean_per_token_s": mean,
           "comparable_shapes": len(groups), "comparable_steps": sum(len(g) for g in groups.values()),
           "slope_s": None, "slope_fraction": None, "slope_pooled_s": None, "slope_pooled_fraction": None}
    try:
        pooled = fit_slope([float(s[x]) for s in sample], per_token).slope
        out["slope_pooled_s"], out["slope_pooled_fraction"] = pooled, pooled / mean
    except ValueError as e:
        out["note"] = f"no slope: {e}"
        return out
    if not groups:
        out["note"] = (f"no two steps of the same shape (sequences, tokens) differ in {x.replace('_', ' ')}: "
                       "no like-for-like comparison")
        return out
    within = fit_slope(*_within([[(float(s[x]), s["time_s"] / s["num_tokens"]) for s in g]
                                 for g in groups.values()])).slope
    out["slope_s"], out["slope_fraction"] = within, within / mean
    return out


def switch_regressions(steps: list[dict]) -> list[dict]:
    return [r for x in SWITCH_XS if (r := switch_regression(steps, x)) is not None]


LIVE_WINDOW = 1000  # the engine's live regression: over its most recent steps


def live_switches(steps: Sequence[dict], window: int = LIVE_WINDOW) -> dict:
    """What `Engine.stats()["switches"]` reports over the last `window` steps (`steps`: the
    engine's step log, oldest first): `loaded_per_step`, [[adapters loaded, steps], ...] (the
    histogram of switches per step), and `regression`, the switch regression on
    `adapters_loaded` (None before any step computed tokens)."""
    recent = list(islice(reversed(steps), window))[::-1]
    hist = defaultdict(int)
    for s in recent:
        hist[s["adapters_loaded"]] += 1
    return {"window_steps": len(recent), "loaded_per_step": [[k, hist[k]] for k in sorted(hist)],
            "regression": switch_regression(recent, "adapters_loaded")}
