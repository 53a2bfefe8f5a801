"""PNG plots (matplotlib, an optional extra: `pip install 'lorafleet[bench]'`).

  switch  per-token latency of steps against the adapters a step switched to, one panel per x
          (`metrics.SWITCH_XS`) that varies, one series per model: the steps (jittered), the
          median per x, the fitted slope (within shape when it can be fitted) through the mean
  sweep   generated tokens/s against the number of adapters, one line per (model, system)

Each function returns the path written, or raises `PlotUnavailable` saying why not.
"""

from __future__ import annotations

import random
from pathlib import Path


class PlotUnavailable(Exception):
    pass


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("matplotlib is not installed (pip install 'lorafleet[bench]')") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def plot_switch(runs: list[dict], title: str, out: Path) -> Path:
    """`runs`: [{"model", "steps" (records), "regressions" (metrics.switch_regressions)}]."""
    xs = list(dict.fromkeys(r["x"] for run in runs for r in run["regressions"]))
    varied = [x for x in xs if any(len(r["table"]) > 1 for run in runs for r in run["regressions"] if r["x"] == x)]
    xs = varied or xs  # a panel whose x never varies says nothing
    if not xs:
        raise PlotUnavailable("no decode step to plot")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(xs), figsize=(6 * len(xs), 4.5), squeeze=False)
    jitter = random.Random(0)
    for ax, x in zip(axes[0], xs):
        tops = []  # the y range stops above the 95th percentile: a few stalls would flatten the rest
        for i, run in enumerate(runs):
            reg = next((r for r in run["regressions"] if r["x"] == x), None)
            if reg is None:
                continue
            color = f"C{i}"
            steps = [s for s in run["steps"] if s.get(x) is not None and s["num_tokens"] > 0]
            ys = [s["time_s"] / s["num_tokens"] * 1e3 for s in steps]
            ax.scatter([s[x] + jitter.uniform(-0.15, 0.15) for s in steps], ys, s=6, alpha=0.3, color=color)
            tops.append(max(sorted(ys)[int(0.95 * (len(ys) - 1))], *(r["per_token_ms_p50"] for r in reg["table"])))
            ax.plot([row[x] for row in reg["table"]], [row["per_token_ms_p50"] for row in reg["table"]],
                    "D", color=color, markeredgecolor="black", markersize=8, zorder=3,
                    label=f"{run['model']}: median")
            within, slope = reg["slope_within_shape_s"], reg["slope_s"]
            if slope is not None:  # the within-shape slope when there is one, through the mean point
                lo, hi = reg["table"][0][x], reg["table"][-1][x]
                mx = sum(s[x] for s in steps) / len(steps)
                line = within if within is not None else slope
                fraction = reg["slope_within_shape_fraction" if within is not None else "slope_fraction"]
                label = (f"{run['model']}: {line * 1e3:+.4f} ms/token per adapter ({fraction:+.1%})"
                         + (" within shape" if within is not None else ""))
                ax.plot([lo, hi], [(reg["mean_per_token_s"] + line * (v - mx)) * 1e3 for v in (lo, hi)],
                        "-", color=color, linewidth=2, zorder=4, label=label)
        ax.set_xlabel(x.replace("_", " ") + " in the step")
        ax.set_ylabel("step time / tokens in the step (ms)")
        ax.set_ylim(0, 1.5 * max(tops) if tops and max(tops) > 0 else None)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, plt, out)


def plot_sweep(points: list[dict], title: str, out: Path) -> Path:
    """`points`: [{"model", "system", "num_adapters", "tokens_per_s"}]."""
    points = [p for p in points if p.get("tokens_per_s")]
    if not points:
        raise PlotUnavailable("no sweep point generated tokens")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for model, system in dict.fromkeys((p["model"], p["system"]) for p in points):
        line = sorted((p["num_adapters"], p["tokens_per_s"]) for p in points
                      if p["model"] == model and p["system"] == system)
        ax.plot(*zip(*line), "o-", label=f"{model} · {system}")
    counts = sorted({p["num_adapters"] for p in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(c) for c in counts])
    ax.minorticks_off()
    ax.set_xlabel("adapters in the workload")
    ax.set_ylabel("generated tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    return _save(fig, plt, out)


def _save(fig, plt, out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
