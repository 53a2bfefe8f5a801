"""Pure functions over what the systems measured: latency percentiles and the cold/warm TTFT.
The switch regression of a run lives with the engine (`engine/regression.py`), which also
reports it live. Percentiles are the engine's (`engine.stats.percentile`).
"""

from __future__ import annotations

from typing import Any

from lorafleet.engine.stats import percentile


def latency_summary(requests: list[dict]) -> dict:
    """p50/p99 of TTFT, TPOT and queue time; the exposed adapter-load time's p50, p99, max and
    total; all in seconds, None where no request measured it."""
    def col(key):
        return [r.get(key) for r in requests]
    out = {}
    for key in ("ttft_s", "tpot_s", "queue_s", "adapter_wait_s"):
        values = col(key)
        out[key] = {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99)}
    waits = [w for w in col("adapter_wait_s") if w is not None]
    out["adapter_wait_s"].update(max=max(waits) if waits else None, total=sum(waits) if waits else None)
    return out


def cold_warm_ttft(requests: list[dict]) -> dict | None:
    """TTFT of the first request to each adapter (cold: its adapter started on disk) against
    the later ones (warm), when the adapters are registered, not loaded, and none is evicted.
    None unless there are both."""
    seen: set[str] = set()
    cold: list[float] = []
    warm: list[float] = []
    for r in sorted(requests, key=lambda r: r["arrival_s"]):
        if r.get("adapter") is None or r.get("ttft_s") is None:
            continue
        (warm if r["adapter"] in seen else cold).append(r["ttft_s"])
        seen.add(r["adapter"])
    if not cold or not warm:
        return None
    out: dict[str, Any]
    out = {k: {"p50": percentile(v, 0.5), "p99": percentile(v, 0.99), "requests": len(v)}
           for k, v in (("cold", cold), ("warm", warm))}
    for q in ("p50", "p99"):
        out[f"cold_over_warm_{q}"] = out["cold"][q] / out["warm"][q] if out["warm"][q] else None
    return out
