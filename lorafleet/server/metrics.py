"""GET /metrics: one Prometheus exposition rendered from an engine snapshot at scrape time.

The vLLM names LoRA-aware gateways read, with vLLM's meanings (the names, labels and value
conventions are those of the endpoint picker's model server protocol: kubernetes-sigs/
gateway-api-inference-extension docs/proposals/003-model-server-protocol, and llm-d/llm-d-router
docs/plugin-metric-protocol.md, "LoRA Adapter Serving" and "LoRA Adapter Residency"):
- `vllm:num_requests_running`, `vllm:num_requests_waiting`: requests in the running batch /
  the waiting queue (the pickers' queue-scorer reads the waiting one); `vllm:kv_cache_usage_perc`:
  KV pages over the pool's pages, 0..1 (a fraction, as vLLM's: the kv-cache-utilization scorer
  scores 1 minus it).
- `vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}`, value the
  current time (the picker keeps the series with the largest value, so one series suffices: the
  previous label set is dropped at each scrape rather than left to pile up). The adapters with
  requests in the running batch / in the waiting queue, joined by commas; an adapter with only
  waiting requests is in `waiting_lora_adapters` alone. `max_lora`: how many adapters the
  pool could hold at the median size (`lora_capacity`); the lora-affinity scorer (llm-d-router
  pkg/epp/framework/plugins/scheduling/scorer/loraaffinity) takes an endpoint with fewer than
  `max_lora` adapters running plus waiting to have room for one more. These are the meanings
  vLLM's users report: request activity, not residency (an idle resident adapter is in neither
  list), hence the residency gauges below.
- `vllm:lora_adapter_loaded{adapter_name, level, pinned, rank}`, value 1: one series per
  resident adapter, as vLLM's residency gauges (the lora-load-state scorer and the
  lora-residency filter read them; a series at 0 counts as absent there, so none is ever
  written at 0). `level="gpu"` for the device tier (pages of lorafleet's pool: "gpu" even when
  the pool is on a CPU, since to a scorer it means "serves with no load"), `level="cpu"` for
  the host tier only (read and laid out, not in the pool). An adapter back on disk (evicted from
  both, or never loaded) has no series. `pinned` "true"/"false": "true" while a running request
  holds the adapter (the eviction order never takes a pinned one; lorafleet has no permanent
  pin); `rank`: its largest rank over its modules, as a decimal string (llm-d-router's metrics
  extractor keeps a `rank` label and reads it as an integer).
- `vllm:num_gpu_loaded_lora_adapters`: the number of `level="gpu"` series, present from startup
  (at 0), so a picker knows the server reports residency before any adapter is loaded.
  `vllm:max_gpu_lora_adapters`: the same number as `max_lora` (the capacity the scorer's
  free-slot and headroom terms use), present from startup too.
  These three carry `model_name` (the base's served name: the residency scorer takes a request
  naming it to need no adapter), as the other vLLM gauges here do.
- `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`, `vllm:num_preemptions_total`.
- A request on a mix (several adapters, the `adapters` field) counts in `running_lora_adapters`
  / `waiting_lora_adapters` for each of its adapters (each is in use, as far as a picker
  knows), and its adapters are pinned while it runs. lorafleet's own series count mixes:
  `lorafleet_mix_requests_total{adapters}` (requests by mix size), `lorafleet_mix_adapters_total`,
  `lorafleet_mix_requests_running` and `..._waiting`; and aLoRA requests:
  `lorafleet_alora_requests_total`, `lorafleet_alora_reused_prompt_tokens_total` (prompt tokens of
  finished aLoRA requests the prefix cache served).
- `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`: prompt tokens looked up in
  the prefix cache at admission, and found there.

`lora_capacity` (in the snapshot, so in /v1/stats too): lorafleet has no adapter slots; every
sequence of a batch may use its own adapter and adapters take pool pages in proportion to their
size. So the capacity is the pool's pages over the median pages of the adapters whose size is
known: the resident ones (device or host tier) first; before any is resident, every registered
adapter (its size is read from its weights file's header at registration); with no adapter
registered at all, `max_num_seqs` (the most one batch can use), `basis` saying which. KV shares
the pool, so under load fewer fit: it is an upper bound, as vLLM's `max_loras` is for its slots.

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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from lorafleet.snapshot import EngineSnapshot, EngineStats, LoraQueues, ServerInfo, Stats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# exported under their vLLM names, or rendered on their own below
_MAPPED = {"num_running", "num_waiting", "kv_cache_usage", "num_prompt_tokens",
           "num_generated_tokens", "num_preemptions", "pool", "adapters", "lora", "num_adapters",
           "max_num_seqs", "max_model_len", "prefix_cache", "eviction", "switches", "lora_capacity",
           "adapter_details", "mixes", "alora"}


def lora_queues(engine) -> LoraQueues:
    """{"running": {adapter: requests}, "waiting": {...}}; runs on the engine thread."""
    return engine.lora_queues()


def engine_snapshot(engine) -> EngineSnapshot:
    """`/v1/stats`'s `engine`: Engine.stats() plus the per-adapter queues and the pool's adapter
    capacity; runs on the engine thread."""
    stats: EngineStats = engine.stats()
    return {**stats, "lora": lora_queues(engine), "num_adapters": stats["adapters"]["registered"],
            "max_num_seqs": engine.max_num_seqs, "lora_capacity": engine.lora_capacity()}


def v1_stats(version: str, server: ServerInfo, engine: EngineSnapshot) -> Stats:
    """GET /v1/stats's answer, before `stats_body` writes it."""
    return {"version": version, "server": server, "engine": engine}


def max_lora(snapshot: EngineSnapshot) -> int:
    """`max_lora` and `vllm:max_gpu_lora_adapters`: the snapshot's `lora_capacity`."""
    return int(snapshot["lora_capacity"]["max_adapters"])


LEVELS = {"device": "gpu", "host": "cpu"}  # lorafleet's tier -> the residency gauge's level


def residency(snapshot: EngineSnapshot) -> list[tuple[str, str, str, str]]:
    """(adapter_name, level, pinned, rank) of every resident adapter, from `adapter_details`
    (which holds every adapter not on disk)."""
    out = []
    for name, a in snapshot["adapter_details"].items():
        level = LEVELS.get(a["tier"])
        if level is not None:
            out.append((name, level, "true" if a["pinned"] else "false", str(max(a["ranks"].values(), default=0))))
    return out


def stats_body(version: str, server: ServerInfo, snapshot: EngineSnapshot) -> bytes:
    """GET /v1/stats's body, written by orjson: with many adapters the body is large (idle
    adapters go by name only to keep it small), and the standard library's json and FastAPI's
    encoder measured far slower (each poll of `lorafleet top` pays it). `lorafleet bench
    stats-cost` measures this function."""
    return orjson.dumps(v1_stats(version, server, snapshot))


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


class _Exposition:
    """The families of one scrape, in the order they are added; `gauge` and `counter` label theirs
    with the model's name."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.label = {"model_name": model_name}
        self.families: list[Metric] = []

    def add(self, family: Metric) -> None:
        self.families.append(family)

    def gauge(self, name, doc, value, labels=None) -> None:
        labels = {**self.label, **(labels or {})}
        g = GaugeMetricFamily(name, doc, labels=list(labels))
        g.add_metric(list(labels.values()), value)
        self.add(g)

    def counter(self, name, doc, value) -> None:
        c = CounterMetricFamily(name, doc, labels=list(self.label))
        c.add_metric(list(self.label.values()), value)
        self.add(c)


def render(snapshot: EngineSnapshot, server: ServerInfo, model_name: str) -> bytes:
    """GET /metrics's body: the snapshot and the server's counters as one Prometheus exposition (the
    module doc names the series)."""
    out = _Exposition(model_name)
    _request_families(out, snapshot)
    _residency_families(out, snapshot)
    _token_and_cache_families(out, snapshot)
    _mix_families(out, snapshot)
    _pool_and_server_families(out, snapshot, server)
    _engine_families(out, snapshot)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(out.families))
    return generate_latest(registry)


def _request_families(out: _Exposition, snapshot: EngineSnapshot) -> None:
    """vLLM's requests running and waiting (in all, and by adapter: lora_requests_info) and KV usage."""
    out.gauge("vllm:num_requests_running", "Requests in the running batch.", snapshot["num_running"])
    out.gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", snapshot["num_waiting"])
    out.gauge("vllm:kv_cache_usage_perc", "KV-cache usage: KV pages over the pool's pages (1 = 100%).",
              snapshot["kv_cache_usage"])
    lora = snapshot.get("lora", {})
    info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                             labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    info.add_metric([str(max_lora(snapshot)), ",".join(lora.get("running", {})),
                     ",".join(lora.get("waiting", {}))], time.time())
    out.add(info)


def _residency_families(out: _Exposition, snapshot: EngineSnapshot) -> None:
    """vLLM's residency gauges: a series per resident adapter, the count in the pool, the capacity."""
    loaded = GaugeMetricFamily("vllm:lora_adapter_loaded", "1 while the adapter is resident: level gpu (in the "
                               "pool, serves with no load) or cpu (host tier only).",
                               labels=[*out.label, "adapter_name", "level", "pinned", "rank"])
    resident = residency(snapshot)
    for name, level, pinned, rank in resident:
        loaded.add_metric([out.model_name, name, level, pinned, rank], 1)
    out.add(loaded)
    out.gauge("vllm:num_gpu_loaded_lora_adapters", "Adapters in the pool (lora_adapter_loaded level=gpu).",
              sum(level == "gpu" for _, level, _, _ in resident))
    out.gauge("vllm:max_gpu_lora_adapters", "Adapters the pool could hold at the median adapter size (= max_lora).",
              max_lora(snapshot))


def _token_and_cache_families(out: _Exposition, snapshot: EngineSnapshot) -> None:
    """Tokens computed and generated, preemptions, the prefix cache's lookups and the pages evicted."""
    out.counter("vllm:prompt_tokens", "Prompt tokens computed.", snapshot.get("num_prompt_tokens", 0))
    out.counter("vllm:generation_tokens", "Tokens generated.", snapshot.get("num_generated_tokens", 0))
    out.counter("vllm:num_preemptions", "Sequences preempted (their KV recomputed later).",
                snapshot.get("num_preemptions", 0))
    prefix = snapshot["prefix_cache"]
    out.counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", prefix["query_tokens"])
    out.counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", prefix["hit_tokens"])
    out.gauge("lorafleet_prefix_cache_hit_rate", "Prefix cache hits over queries, in tokens.", prefix["hit_rate"])
    evictions = CounterMetricFamily("lorafleet_evictions", "Pages given back by the eviction order, by kind.",
                                    labels=[*out.label, "kind"])
    eviction = snapshot["eviction"]
    for kind, n in (("kv_blocks", eviction["evicted_kv_blocks"]), ("adapters", eviction["evicted_adapters"])):
        evictions.add_metric([out.model_name, kind], n)
    out.add(evictions)


def _mix_families(out: _Exposition, snapshot: EngineSnapshot) -> None:
    """Requests on a mix of adapters: by the mix's size, the adapters named, those running and waiting."""
    mixes = snapshot["mixes"]
    by_size = CounterMetricFamily("lorafleet_mix_requests", "Requests that named a mix of several adapters "
                                  "(the adapters field), by the number of adapters in the mix.",
                                  labels=[*out.label, "adapters"])
    for k, n in mixes["by_size"].items():
        by_size.add_metric([out.model_name, k], n)
    out.add(by_size)
    out.counter("lorafleet_mix_adapters", "Adapters named by mixes, in all (over lorafleet_mix_requests_total: the "
                "mean mix).", mixes["adapters"])
    out.gauge("lorafleet_mix_requests_running", "Requests on a mix in the running batch.", mixes["running"])
    out.gauge("lorafleet_mix_requests_waiting", "Requests on a mix waiting to be scheduled.", mixes["waiting"])
    alora = snapshot["alora"]
    out.counter("lorafleet_alora_requests", "Finished requests on an aLoRA adapter (active from its invocation "
                "tokens on).", alora["requests"])
    out.counter("lorafleet_alora_reused_prompt_tokens", "Prompt tokens of finished aLoRA requests served by the "
                "prefix cache (the history before the invocation is the base's).", alora["reused_tokens"])


def _pool_and_server_families(out: _Exposition, snapshot: EngineSnapshot, server: ServerInfo) -> None:
    """The pool's pages by owner, the switch cost once it has a slope, and the server's admission counters."""
    pool = snapshot["pool"]
    pages = GaugeMetricFamily("lorafleet_pool_pages", "Pages of the unified pool by owner.", labels=["owner"])
    for owner, n in (("free", pool["free_pages"]), ("kv", pool["kv_pages"]), ("cached", pool["cached_pages"]),
                     ("adapters", pool["adapter_pages"])):
        pages.add_metric([owner], n)
    out.add(pages)
    reg = snapshot["switches"]["regression"]
    if reg is not None and reg["slope_s"] is not None:
        out.gauge("lorafleet_switch_cost_seconds_per_token", "Per-token latency one more adapter loaded in a step "
                  "adds (the switch regression, the step's shape accounted for, recent steps).", reg["slope_s"])
        out.gauge("lorafleet_switch_cost_fraction", "lorafleet_switch_cost_seconds_per_token over the mean per-token "
                  "latency of the same steps.", reg["slope_fraction"])
    out.gauge("lorafleet_pool_pages_total", "Pages in the unified pool.", pool["total_pages"])
    out.gauge("lorafleet_pool_page_bytes", "Bytes per pool page.", pool["page_bytes"])
    out.gauge("lorafleet_adapters", "Adapters known to the daemon (any tier).", snapshot["num_adapters"])
    out.gauge("lorafleet_requests_pending", "Requests admitted by the server and not yet answered.", server["pending"])
    out.counter("lorafleet_requests_rejected", "Requests refused by the queue limit or while draining.",
                server["num_rejected"])
    out.counter("lorafleet_client_disconnects", "Requests whose client hung up before the answer.",
                server["num_disconnects"])


def _engine_families(out: _Exposition, snapshot: EngineSnapshot) -> None:
    """Every other numeric entry of Engine.stats() as `lorafleet_engine_<name>`, p50/p99 summaries as
    a `quantile` label."""
    for key, value in snapshot.items():
        if key in _MAPPED:
            continue
        if _number(value):
            out.gauge(_name(key), f"Engine.stats()[{key!r}].", value)
        elif isinstance(value, dict) and value and set(value) <= {"p50", "p99"}:
            g = GaugeMetricFamily(_name(key), f"Engine.stats()[{key!r}], recent window.",
                                  labels=[*out.label, "quantile"])
            for q, v in value.items():
                if _number(v):
                    g.add_metric([out.model_name, "0." + q[1:]], v)
            out.add(g)
