"""PNG plots (matplotlib, an optional extra: `pip install 'lorafleet[bench]'`).

  switch  per-token latency of steps of one shape against the adapters a step switched to, one
          panel per x (`engine.regression.SWITCH_XS`) that varies within a shape, one series per model:
          the steps (jittered), the median per x, the within-shape slope through their mean
  sweep   generated tokens/s against the number of adapters, one line per (model, system)

Each function returns the path written, or raises `PlotUnavailable` saying why not.
"""

from __future__ import annotations

from pathlib import Path

from lorafleet.engine.regression import adjusted_points


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
    per model: each step's per-token latency adjusted for its shape (`regression.adjusted_points`:
    the shape's part of the joint fit taken off, so any traffic draws switches, not batch size),
    the mean per x, and the headline slope (the step's shape accounted for) through them."""
    panels = []
    for x in dict.fromkeys(r["x"] for run in runs for r in run["regressions"]):
        series = []
        for i, run in enumerate(runs):
            reg = next((r for r in run["regressions"] if r["x"] == x), None)
            points = adjusted_points(run["steps"], x)
            if reg is not None and len(points) > 1:
                series.append((i, run["model"], reg, points))
        if series:
            panels.append((x, series))
    if not panels:
        raise PlotUnavailable("adapters loaded and distinct adapters vary only with the steps' shape (or not at all): "
                              "nothing to draw against them that is not batch size")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (x, series) in zip(axes[0], panels):
        tops = []
        for i, model, reg, points in series:
            color = f"C{i}"
            values, means = [p[x] for p in points], [p["per_token_ms_mean"] for p in points]
            sizes = [min(200, 10 + p["steps"]) for p in points]
            ax.scatter(values, means, s=sizes, color=color, edgecolor="black", alpha=0.8, zorder=3,
                       label=f"{model}: mean per x, shape-adjusted ({sum(p['steps'] for p in points)} steps)")
            tops.append(max(means))
            if reg["slope_s"] is not None:
                w = [p["steps"] for p in points]
                mx = sum(v * n for v, n in zip(values, w)) / sum(w)
                my = sum(m * n for m, n in zip(means, w)) / sum(w)
                lo, hi = reg["slope_ci_s"]
                ax.plot((values[0], values[-1]), [my + reg["slope_s"] * 1e3 * (v - mx) for v in (values[0], values[-1])],
                        "-", color=color, linewidth=2, zorder=4,
                        label=f"{model}: {reg['slope_s'] * 1e3:+.4f} ms/token per adapter ({reg['slope_fraction']:+.1%}; "
                              f"95%: {lo * 1e3:+.4f} to {hi * 1e3:+.4f})")
        ax.set_xlabel(x.replace("_", " ") + " in the step")
        ax.set_ylabel("per-token latency, the step's shape accounted for (ms)")
        ax.set_ylim(0, 1.5 * max(tops) if tops and max(tops) > 0 else None)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title + ": switches against per-token latency, shape-adjusted")
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
