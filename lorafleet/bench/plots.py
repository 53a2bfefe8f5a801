"""PNG plots (matplotlib, an optional extra: `pip install 'lorafleet[bench]'`).

  switch  per-token latency of steps of one shape against the adapters a step switched to, one
          panel per x (`engine.regression.SWITCH_XS`) that varies within a shape, one series per model:
          the steps (jittered), the median per x, the within-shape slope through their mean
  sweep   generated tokens/s against the number of adapters, one line per (model, system)

Each function returns the path written, or raises `PlotUnavailable` saying why not.
"""

from __future__ import annotations

import random
from pathlib import Path

from lorafleet.engine.regression import comparable_groups
from lorafleet.engine.stats import percentile


class PlotUnavailable(Exception):
    pass


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("matplotlib is not installed (pip install 'lorafleet[bench]', or from a clone pip install -e '.[bench]')") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def plot_switch(runs: list[dict], title: str, out: Path) -> Path:
    """`runs`: [{"model", "steps" (records), "regressions" (engine.regression.switch_regressions)}]. Per x,
    per model, the steps of the one shape with the most steps among those whose steps differ in
    x (a bigger batch mixes more adapters and costs less per token: across shapes the points
    would draw batch size, not switches), the median per x, and the within-shape slope through
    that shape's mean."""
    panels = []
    for x in dict.fromkeys(r["x"] for run in runs for r in run["regressions"]):
        series = []
        for i, run in enumerate(runs):
            reg = next((r for r in run["regressions"] if r["x"] == x), None)
            groups = comparable_groups(run["steps"], x)
            if reg is not None and groups:
                series.append((i, run["model"], reg, max(groups.items(), key=lambda kv: len(kv[1]))))
        if series:
            panels.append((x, series))
    if not panels:
        raise PlotUnavailable("no two steps of the same shape (sequences, tokens) differ in adapters loaded "
                              "or distinct adapters: nothing to compare like for like")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    jitter = random.Random(0)
    for ax, (x, series) in zip(axes[0], panels):
        tops = []  # the y range stops above the 95th percentile: a few stalls would flatten the rest
        for i, model, reg, ((seqs, _), steps) in series:
            color = f"C{i}"
            ys = [s["time_s"] / s["num_tokens"] * 1e3 for s in steps]
            tokens = sorted({s["num_tokens"] for s in steps})
            shape = "decode" if tokens == [seqs] else f"{tokens[0]}-{tokens[-1]} tokens"
            ax.scatter([s[x] + jitter.uniform(-0.15, 0.15) for s in steps], ys, s=6, alpha=0.3, color=color,
                       label=f"{model}: {len(steps)} steps of {seqs} sequences, {shape}")
            values = sorted({s[x] for s in steps})
            medians = [percentile([y for s, y in zip(steps, ys) if s[x] == v], 0.5) for v in values]
            ax.plot(values, medians, "D", color=color, markeredgecolor="black", markersize=8, zorder=3)
            tops.append(max(sorted(ys)[int(0.95 * (len(ys) - 1))], *medians))
            if reg["slope_s"] is not None:
                mx, my, ends = sum(s[x] for s in steps) / len(steps), sum(ys) / len(ys), (values[0], values[-1])
                ax.plot(ends, [my + reg["slope_s"] * 1e3 * (v - mx) for v in ends], "-", color=color, linewidth=2,
                        zorder=4, label=f"{model}: {reg['slope_s'] * 1e3:+.4f} ms/token per adapter "
                              f"({reg['slope_fraction']:+.1%}) within shape")
        ax.set_xlabel(x.replace("_", " ") + " in the step")
        ax.set_ylabel("step time / tokens in the step (ms)")
        ax.set_ylim(0, 1.5 * max(tops) if tops and max(tops) > 0 else None)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title + ": steps of one shape")
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
