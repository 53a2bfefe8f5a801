"""The switch regression: what an adapter switch costs, from the engine's step records.

Per-token latency of a step (its time over the tokens it computed) against the adapters it
switched to. Two x's, each where known: `adapters_loaded` (adapters that landed in the pool for
that step: switches) and `distinct_adapters` (the adapters its batch mixes: segments of the LoRA
op). Every step that computed tokens counts. The shape of a step moves per-token latency far more
than any switch (a prefill's tokens cost less each than a decode's; a bigger batch amortises the
weights over more tokens) and moves with the x's (a bigger batch mixes more adapters; a load lands
in the step that prefills its request), so the headline slope is fitted with the shape as
covariates: per-token latency on x, 1 / tokens (a step's fixed cost spread over its tokens),
sequences, tokens and log2 tokens, by least squares, with a 95% confidence interval (`adjusted_fit`):
any traffic gives it, where exact same-shape groups almost never occur. Beside it: the slope
within shape (x and y minus their mean over the steps of the same shape (sequences, tokens
bucket), then one fit: the fixed-effects estimator), where such groups exist, and the fit over
every step pooled. A flat line (slope ~0) says switches cost nothing.

Pure functions (numpy, no torch): the engine reports the regression over its recent steps live
(`Engine.stats()["switches"]`, what `lorafleet top` draws) and the bench over a whole run.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import islice
from typing import NamedTuple, Sequence, cast

import numpy as np

from lorafleet.engine.stats import percentile
from lorafleet.snapshot import SwitchRegression, Switches

SWITCH_XS = ("adapters_loaded", "distinct_adapters")


class Line(NamedTuple):
    slope: float
    intercept: float


def fit_slope(xs: Sequence[float] | np.ndarray, ys: Sequence[float] | np.ndarray) -> Line:
    """Ordinary least squares y = slope * x + intercept. Raises ValueError with fewer than two
    points or when every x is the same (no slope to fit)."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} xs but {len(ys)} ys")
    n = len(xs)
    if n < 2:
        raise ValueError("a slope needs at least two points")
    x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    mx, my = x.mean(), y.mean()
    dx = x - mx
    sxx = float(dx @ dx)
    if sxx == 0:
        raise ValueError("every x is the same: no slope to fit")
    slope = float(dx @ (y - my)) / sxx
    return Line(slope, float(my - slope * mx))


Z95 = 1.959964  # the normal quantile of a two-sided 95% interval (the fits have hundreds of steps)


def shape_columns(seqs: np.ndarray, tokens: np.ndarray) -> list[np.ndarray]:
    """A step's shape as covariates: what moves per-token latency besides the switches."""
    return [1.0 / tokens, seqs, tokens, np.log2(tokens)]


def _design(xs: np.ndarray, shape: list[np.ndarray]) -> np.ndarray | None:
    """[1, the `shape` columns that add to the rank, in order, xs]; None where xs adds nothing
    (it is a function of the shape: its effect cannot be told from the shape's)."""
    cols = [np.ones_like(xs)]
    for c in shape:
        if np.linalg.matrix_rank(np.column_stack(cols + [c])) > len(cols):
            cols.append(c)
    if np.linalg.matrix_rank(np.column_stack(cols + [xs])) == len(cols):
        return None
    return np.column_stack(cols + [xs])


def adjusted_fit(xs: np.ndarray, ys: np.ndarray, shape: list[np.ndarray]) -> tuple[float, float] | None:
    """Least squares of ys on an intercept, the `shape` columns and xs (`_design`): (x's
    coefficient, its standard error), or None where xs has no variance left once the shape is
    accounted for, or there are too few steps."""
    design = _design(xs, shape)
    if design is None or design.shape[0] <= design.shape[1] + 1:
        return None
    n, k = design.shape
    coef = np.linalg.lstsq(design, ys, rcond=None)[0]
    resid = ys - design @ coef
    cov = np.linalg.pinv(design.T @ design) * (float(resid @ resid) / (n - k))
    return float(coef[-1]), float(np.sqrt(max(cov[-1, -1], 0.0)))


def adjusted_points(steps: list[dict], x: str) -> list[dict]:
    """Per value of `x`: the steps' mean per-token latency adjusted for their shape (each step's
    shape part of the joint fit taken off, the mean shape part put back): what a plot of switches
    against latency shows for any traffic. [] where no fit."""
    sample = [s for s in steps if s.get(x) is not None and s["num_tokens"] > 0]
    if len(sample) < 3:
        return []
    xs = np.array([s[x] for s in sample], dtype=np.float64)
    seqs = np.array([s["num_seqs"] for s in sample], dtype=np.float64)
    tokens = np.array([s["num_tokens"] for s in sample], dtype=np.float64)
    ys = np.array([s["time_s"] for s in sample], dtype=np.float64) / tokens
    design = _design(xs, shape_columns(seqs, tokens))
    if design is None or design.shape[0] <= design.shape[1]:
        return []
    coef = np.linalg.lstsq(design, ys, rcond=None)[0]
    part = design[:, 1:-1] @ coef[1:-1]  # the shape's, the intercept and x's left in
    adjusted = ys - part + part.mean()
    return [{x: float(v), "steps": int((xs == v).sum()), "per_token_ms_mean": float(adjusted[xs == v].mean()) * 1e3}
            for v in sorted(set(xs.tolist()))]


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


def switch_regression(steps: list[dict], x: str) -> dict | None:
    """The regression of per-token latency (s) on `x` over the steps that computed tokens;
    None when no step knows `x`. Keys: x, steps, table (per x value: steps, decode steps, median
    and mean per-token ms, mean sequences and tokens, all shapes together), mean_per_token_s;
    the headline `slope_s` (`slope_fraction`: over the mean per-token latency; the target is
    < 0.02 per switch) is fitted with the step's shape as covariates (`adjusted_fit`), its 95%
    interval `slope_ci_s`; `slope_within_s` is fitted within shape, over `comparable_steps`
    steps in `comparable_shapes` shapes (the steps `comparable_groups` keeps), None without such
    steps; `slope_pooled_s` pools every step (confounded: bigger batches mix more adapters and
    cost less per token). `note` says why a slope is None. Vectorised: the engine runs it over 1,000 steps on every poll of
    `/v1/stats`."""
    sample = [s for s in steps if s.get(x) is not None and s["num_tokens"] > 0]
    if not sample:
        return None
    xs = np.array([s[x] for s in sample], dtype=np.float64)
    seqs = np.array([s["num_seqs"] for s in sample], dtype=np.float64)
    tokens = np.array([s["num_tokens"] for s in sample], dtype=np.float64)
    per_token = np.array([s["time_s"] for s in sample], dtype=np.float64) / tokens
    table = []
    for k in sorted({s[x] for s in sample}):
        m = xs == k
        p50 = percentile(per_token[m].tolist(), 0.5)
        assert p50 is not None  # k is some step's x
        table.append({x: k, "steps": int(m.sum()), "decode_steps": int((tokens[m] == seqs[m]).sum()),
                      "per_token_ms_p50": p50 * 1e3,
                      "per_token_ms_mean": float(per_token[m].mean()) * 1e3,
                      "mean_seqs": float(seqs[m].mean()), "mean_tokens": float(tokens[m].mean())})
    mean = float(per_token.mean())
    # shapes (shape_of) whose steps differ in x: comparable_groups' selection, as arrays
    ids: dict[tuple[int, int], int] = {}
    shape = np.array([ids.setdefault(shape_of(s), len(ids)) for s in sample])
    lo, hi = np.full(shape.max() + 1, np.inf), np.full(shape.max() + 1, -np.inf)
    np.minimum.at(lo, shape, xs)
    np.maximum.at(hi, shape, xs)
    varied = hi > lo
    keep = varied[shape]
    out = {"x": x, "steps": len(sample), "table": table, "mean_per_token_s": mean,
           "comparable_shapes": int(varied.sum()), "comparable_steps": int(keep.sum()),
           "slope_s": None, "slope_fraction": None, "slope_ci_s": None,
           "slope_within_s": None, "slope_within_fraction": None, "slope_pooled_s": None, "slope_pooled_fraction": None}
    label = x.replace("_", " ")
    if len(sample) < 2:
        out["note"] = "no slope yet: one step so far"
        return out
    if xs.min() == xs.max():
        out["note"] = f"no slope yet: every step so far has {label} {int(xs[0])}"
        return out
    pooled = fit_slope(xs, per_token).slope
    out["slope_pooled_s"], out["slope_pooled_fraction"] = pooled, pooled / mean
    fit = adjusted_fit(xs, per_token, shape_columns(seqs, tokens))
    if fit is not None:
        slope, se = fit
        out["slope_s"], out["slope_fraction"] = slope, slope / mean
        out["slope_ci_s"] = (slope - Z95 * se, slope + Z95 * se)
    else:
        out["note"] = (f"no slope yet: {label} does not vary once the steps' shape is accounted for, "
                       "or too few steps")
    if keep.any():
        g, gx, gy = shape[keep], xs[keep], per_token[keep]
        count = np.bincount(g)
        count[count == 0] = 1
        within = fit_slope(gx - (np.bincount(g, gx) / count)[g], gy - (np.bincount(g, gy) / count)[g]).slope
        out["slope_within_s"], out["slope_within_fraction"] = within, within / mean
    return out


def switch_regressions(steps: list[dict]) -> list[dict]:
    return [r for x in SWITCH_XS if (r := switch_regression(steps, x)) is not None]


LIVE_WINDOW = 1000  # the engine's live regression: over its most recent steps


def live_switches(steps: Sequence[dict], window: int = LIVE_WINDOW) -> Switches:
    """What `Engine.stats()["switches"]` reports over the last `window` steps (`steps`: the
    engine's step log, oldest first): `loaded_per_step`, [(adapters loaded, steps), ...] (the
    histogram of switches per step), and `regression`, the switch regression on
    `adapters_loaded` (None before any step computed tokens)."""
    recent = list(islice(reversed(steps), window))[::-1]
    hist: defaultdict[int, int] = defaultdict(int)
    for s in recent:
        hist[s["adapters_loaded"]] += 1
    # switch_regression keys its table by its x: here adapters_loaded, as SwitchRegression declares
    regression = cast("SwitchRegression | None", switch_regression(recent, "adapters_loaded"))
    return {"window_steps": len(recent), "loaded_per_step": [(k, hist[k]) for k in sorted(hist)],
            "regression": regression}
