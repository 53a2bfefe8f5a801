"""GET /metrics: one Prometheus exposition rendered from an engine snapshot at scrape time.

The vLLM names LoRA-aware gateways read, with vLLM's meanings:
- `vllm:num_requests_running`, `vllm:num_requests_waiting`: requests in the running batch /
  the waiting queue; `vllm:kv_cache_usage_perc`: KV pages over the pool's pages (0..1).
- `vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}`, value the
  current time: the names of the adapters with running (waiting) requests, joined by commas,
  and the most adapters one batch may hold. lorafleet has no max-loras knob: every sequence of
  a batch may use its own adapter, so `max_lora` is `max_num_seqs`. One series: the previous
  label set is dropped at each scrape rather than left to pile up.
- `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`, `vllm:num_preemptions_total`.

- `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`: prompt tokens looked up in
  the prefix cache at admission, and found there.

lorafleet's own: `lorafleet_pool_pages{owner=free|kv|cached|adapters}`,
`lorafleet_prefix_cache_hit_rate`, `lorafleet_evictions_total{kind=kv_blocks|adapters}` (what
the one eviction order gave back, `memory/eviction.py`), `lorafleet_switch_cost_fraction` and
`..._seconds_per_token` (the live switch regression, `engine/regression.py`, once it has a
slope), the server's admission
counters, and every numeric counter of `Engine.stats()` as `lorafleet_engine_<name>` (p50/p99
summaries as a `quantile` label), so new engine counters (adapter loads, switch stalls) appear
without touching this file.
"""

from __future__ import annotations

import re
import time

import orjson

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# exported under their vLLM names, or rendered on their own below
_MAPPED = {"num_running", "num_waiting", "kv_cache_usage", "num_prompt_tokens",
           "num_generated_tokens", "num_preemptions", "pool", "adapters", "lora", "num_adapters",
           "max_num_seqs", "max_model_len", "prefix_cache", "eviction", "switches"}


def lora_queues(engine) -> dict:
    """{"running": {adapter: requests}, "waiting": {...}}; runs on the engine thread."""
    return engine.lora_queues()


def engine_snapshot(engine) -> dict:
    """Engine.stats() plus the per-adapter queues; runs on the engine thread."""
    stats = engine.stats()
    return {**stats, "lora": lora_queues(engine), "num_adapters": stats["adapters"]["registered"],
            "max_num_seqs": engine.config.max_num_seqs}


def stats_body(version: str, server: dict, snapshot: dict) -> bytes:
    """GET /v1/stats's body: with a thousand adapters it is ~450 KiB, which orjson writes in about
    a millisecond (the standard library's json took ~8 ms, FastAPI's encoder far longer; each
    poll of `lorafleet top` pays it). `lorafleet bench stats-cost` measures this function."""
    return orjson.dumps({"version": version, "server": server, "engine": snapshot})


def _name(key: str) -> str:
    return "lorafleet_engine_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Families:
    """A collector that yields families built beforehand (prometheus-client's custom collector)."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return iter(self.families)


def render(snapshot: dict, server: dict, model_name: str) -> bytes:
    label = {"model_name": model_name}
    fams = []

    def gauge(name, doc, value, labels=None):
        labels = {**label, **(labels or {})}
        g = GaugeMetricFamily(name, doc, labels=list(labels))
        g.add_metric(list(labels.values()), value)
        fams.append(g)

    def counter(name, doc, value):
        c = CounterMetricFamily(name, doc, labels=list(label))
        c.add_metric(list(label.values()), value)
        fams.append(c)

    gauge("vllm:num_requests_running", "Requests in the running batch.", snapshot["num_running"])
    gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", snapshot["num_waiting"])
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage: KV pages over the pool's pages (1 = 100%).",
          snapshot["kv_cache_usage"])
    lora = snapshot.get("lora", {})
    info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                             labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    info.add_metric([str(snapshot.get("max_num_seqs", 0)), ",".join(lora.get("running", {})),
                     ",".join(lora.get("waiting", {}))], time.time())
    fams.append(info)
    counter("vllm:prompt_tokens", "Prompt tokens computed.", snapshot.get("num_prompt_tokens", 0))
    counter("vllm:generation_tokens", "Tokens generated.", snapshot.get("num_generated_tokens", 0))
    counter("vllm:num_preemptions", "Sequences preempted (their KV recomputed later).",
            snapshot.get("num_preemptions", 0))

    prefix = snapshot["prefix_cache"]
    counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", prefix["query_tokens"])
    counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", prefix["hit_tokens"])
    gauge("lorafleet_prefix_cache_hit_rate", "Prefix cache hits over queries, in tokens.", prefix["hit_rate"])
    evictions = CounterMetricFamily("lorafleet_evictions", "Pages given back by the eviction order, by kind.",
                                    labels=[*label, "kind"])
    for kind in ("kv_blocks", "adapters"):
        evictions.add_metric([model_name, kind], snapshot["eviction"][f"evicted_{kind}"])
    fams.append(evictions)

    pool = snapshot["pool"]
    pages = GaugeMetricFamily("lorafleet_pool_pages", "Pages of the unified pool by owner.", labels=["owner"])
    for owner, key in (("free", "free_pages"), ("kv", "kv_pages"), ("cached", "cached_pages"),
                       ("adapters", "adapter_pages")):
        pages.add_metric([owner], pool[key])
    fams.append(pages)
    reg = snapshot["switches"]["regression"] or {}
    if reg.get("slope_s") is not None:
        gauge("lorafleet_switch_cost_seconds_per_token", "Per-token latency one more adapter loaded in a step adds "
              "(the switch regression within step shape, recent steps).", reg["slope_s"])
        gauge("lorafleet_switch_cost_fraction", "lorafleet_switch_cost_seconds_per_token over the mean per-token "
              "latency of the same steps.", reg["slope_fraction"])
    gauge("lorafleet_pool_pages_total", "Pages in the unified pool.", pool["total_pages"])
    gauge("lorafleet_pool_page_bytes", "Bytes per pool page.", pool["page_bytes"])
    gauge("lorafleet_adapters", "Adapters known to the daemon (any tier).", snapshot["num_adapters"])
    gauge("lorafleet_requests_pending", "Requests admitted by the server and not yet answered.", server["pending"])
    counter("lorafleet_requests_rejected", "Requests refused by the queue limit or while draining.",
            server["num_rejected"])
    counter("lorafleet_client_disconnects", "Requests whose client hung up before the answer.",
            server["num_disconnects"])

    for key, value in snapshot.items():
        if key in _MAPPED:
            continue
        if _number(value):
            gauge(_name(key), f"Engine.stats()[{key!r}].", value)
        elif isinstance(value, dict) and value and set(value) <= {"p50", "p99"}:
            g = GaugeMetricFamily(_name(key), f"Engine.stats()[{key!r}], recent window.",
                                  labels=[*label, "quantile"])
            for q, v in value.items():
                if _number(v):
                    g.add_metric([model_name, "0." + q[1:]], v)
            fams.append(g)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(fams))
    return generate_latest(registry)
