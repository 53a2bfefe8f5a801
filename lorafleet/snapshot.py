"""The shapes of what `/v1/stats` answers: `Stats`, `{"version", "server", "engine"}`, and each of
its parts, as TypedDicts. `Engine.stats()` returns an `EngineStats`, `server.metrics.engine_snapshot`
the `EngineSnapshot` beside it in the answer, `ServerState.info()` its `ServerInfo`; `lorafleet top`,
`ps`, `status` and `/metrics` read them through these types, so a type checker catches a key
spelled wrong on either side.

TypedDicts, not dataclasses: they type the very dicts that orjson writes and the client parses back,
so `/v1/stats` is written with no conversion and the front ends read the JSON as it comes.
`NotRequired`: a key only some answers carry; `X | None`: a key always there, sometimes null. A
`tuple` is a JSON array of fixed length (a list once parsed). tests/engine/test_snapshot.py walks
a live engine's answers against these declarations, both ways: no key undeclared, no required key
missing.

A leaf: nothing of lorafleet, no torch (the TUI and the CLI import it).
"""

from typing import Literal, NotRequired, TypedDict

# no `from __future__ import annotations`: TypedDict reads NotRequired from evaluated annotations

Tier = Literal["device", "host", "disk"]
Variant = Literal["lora", "dora", "lora_bias"]
PageRun = tuple[str, int]  # [owner, pages]: "free", "kv", "cached" or an adapter's name


class Quantiles(TypedDict):
    """p50 and p99 of a recent window (`engine.stats.summary`); null before any value."""

    p50: float | None
    p99: float | None


class PoolCounts(TypedDict):
    """The unified page pool's pages by owner (`PagePool.stats`)."""

    total_pages: int
    page_bytes: int
    free_pages: int
    kv_pages: int
    cached_pages: int
    adapter_pages: int
    pages_by_adapter: dict[str, int]
    adapter_dtype: str  # the adapters' weights in the pages (`--lora-dtype`), e.g. "bfloat16"


class PoolStats(PoolCounts):
    page_map: list[PageRun]  # the pool in page order as runs of one owner


class AdapterTiers(TypedDict):
    device: int
    host: int
    disk: int


class AdaptersStats(TypedDict):
    """The registry (`AdapterResidency.stats`)."""

    registered: int
    tiers: AdapterTiers
    retired: int  # replaced or unregistered while requests still held them
    host_cache_bytes: int
    host_cache_capacity: int


class PrefixCacheStats(TypedDict):
    """`KVCacheManager.stats`."""

    enabled: bool
    cached_pages: int
    reused_cached_pages: int
    hashed_pages: int
    query_tokens: int
    hit_tokens: int
    hit_rate: float


class EvictionStats(TypedDict):
    """The one eviction order (`EvictionOrder.stats`)."""

    policy: str  # cost or lru
    recompute_s_per_token: float
    miss_s_per_byte: float
    kv_cost_s_per_byte: float
    evicted_kv_blocks: int
    evicted_adapters: int


class AdapterInfo(TypedDict):
    """One adapter's record (`AdapterEntry.info`; also `Engine.list_adapters`)."""

    name: str
    path: str
    digest: str | None  # known once its weights were read
    tier: Tier
    ranks: dict[str, int]  # module -> rank
    modules: list[str]
    variant: Variant | None  # known once loaded
    saved_modules: list[str]
    vocab_size: int | None  # its own vocabulary's; null: the base's
    invocation_tokens: NotRequired[list[int]]  # an aLoRA's invocation sequence (alora_invocation_tokens); absent: plain
    params: int
    pages: int
    users: int
    pinned: bool
    hits: int
    misses: int
    loads: int
    device_loads: int
    evictions: int
    load_time_s: float
    error: str | None  # the last load's failure
    idle_s: float | None  # since a request last used it; null: none has


class AdapterDetail(AdapterInfo):
    """A row of `adapter_details` (`engine.views.adapter_details`)."""

    load_s: Quantiles  # its recent disk loads
    stall_s: Quantiles  # its finished requests' exposed waits


class SwitchRow(TypedDict):
    """One row of the live regression's table: the steps that loaded `adapters_loaded` adapters."""

    adapters_loaded: int
    steps: int
    decode_steps: int
    per_token_ms_p50: float
    per_token_ms_mean: float
    mean_seqs: float
    mean_tokens: float


class SwitchRegression(TypedDict):
    """`engine.regression.switch_regression` on `adapters_loaded`; each slope null until fitted."""

    x: str
    steps: int
    table: list[SwitchRow]
    mean_per_token_s: float
    comparable_shapes: int
    comparable_steps: int
    slope_s: float | None
    slope_fraction: float | None
    slope_ci_s: tuple[float, float] | None  # the 95% interval of slope_s
    slope_within_s: float | None
    slope_within_fraction: float | None
    slope_pooled_s: float | None
    slope_pooled_fraction: float | None
    note: NotRequired[str]  # why slope_s is null


class Switches(TypedDict):
    """`engine.regression.live_switches`: the engine's last steps."""

    window_steps: int
    loaded_per_step: list[tuple[int, int]]  # [adapters loaded, steps], by adapters loaded
    regression: SwitchRegression | None  # null before a step computed tokens


class SchedulerStats(TypedDict):
    """The admission policy's snapshot (`engine.policy`)."""

    policy: str  # vtc or fcfs
    counters: NotRequired[dict[str, float]]  # vtc: each adapter's service counter


class MixCounts(TypedDict):
    """Requests that named a mix of adapters, since start (`Counters.mixes`)."""

    requests: int
    adapters: int  # adapters those mixes named, in all
    by_size: dict[str, int]  # adapters in a mix (a decimal string) -> requests


class Mixes(MixCounts):
    running: int
    waiting: int


class SelfCheck(TypedDict):
    """What `engine.selfcheck.self_check` found at start: a comparison, or why none was made."""

    kernels: str
    skipped: NotRequired[str]
    max_abs_diff: NotRequired[float]
    tolerance: NotRequired[float]
    seconds: NotRequired[float]


class DecodeGraphsStats(TypedDict):
    """`DecodeGraphs.stats`; `{"enabled": false}` alone where the engine has none."""

    enabled: bool
    captured: NotRequired[bool]
    buckets: NotRequired[list[int]]
    captures: NotRequired[int]
    keys: NotRequired[list[list[int]]]
    max_captures: NotRequired[int]
    replays: NotRequired[int]
    uploads: NotRequired[int]
    recaptures: NotRequired[int]
    eager_fallbacks: NotRequired[int]
    capture_s: NotRequired[float]
    capture_bytes: NotRequired[int]


class AloraCounts(TypedDict):
    """Finished requests on an aLoRA adapter, since start (`Counters.record_finished`)."""

    requests: int
    reused_tokens: int  # their prompt tokens served by the prefix cache


class CounterStats(TypedDict):
    """The engine's counters and recent windows (`engine.stats.Counters.snapshot`)."""

    num_steps: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_requests_finished: int
    num_requests_aborted: int
    num_preemptions: int
    num_discarded: int
    num_adapter_loads: int
    alora: AloraCounts
    queue_time_s: Quantiles
    adapter_wait_s: Quantiles
    step_time_s: Quantiles
    ttft_s: Quantiles
    tpot_s: Quantiles


class EngineStats(CounterStats):
    """`Engine.stats()` (`engine.views.stats`)."""

    model: str
    device: str
    dtype: str
    quantization: str | None  # int8 or int4: the base's projections and LM head
    weight_bytes: int
    max_model_len: int
    pool: PoolStats
    adapters: AdaptersStats
    prefix_cache: PrefixCacheStats
    eviction: EvictionStats
    adapter_details: dict[str, AdapterDetail]  # every adapter in use, resident or ever asked for
    untouched_adapters: list[str]  # the rest: registered on disk, never asked for
    switches: Switches
    scheduler: SchedulerStats
    kv_cache_usage: float
    num_running: int
    num_waiting: int
    mixes: Mixes
    kernels: str
    kernels_label: str
    self_check: SelfCheck | None  # null where it did not run
    decode_graphs: DecodeGraphsStats


class LoraQueues(TypedDict):
    """Requests per adapter (`Engine.lora_queues`)."""

    running: dict[str, int]
    waiting: dict[str, int]


class LoraCapacity(TypedDict):
    """Adapters the pool could hold at the median size (`Arbiter.adapter_capacity`)."""

    max_adapters: int
    median_pages: float | None
    sized_adapters: int
    basis: str  # resident, registered or max_num_seqs: the adapters median_pages is over


class EngineSnapshot(EngineStats):
    """`/v1/stats`'s `engine` (`server.metrics.engine_snapshot`): `Engine.stats()` and these."""

    lora: LoraQueues
    num_adapters: int
    max_num_seqs: int
    lora_capacity: LoraCapacity


class ServerInfo(TypedDict):
    """`/v1/stats`'s `server` (`ServerState.info`)."""

    pid: int
    socket: str
    model: str  # the base's served name
    model_path: str
    sampling_defaults: dict[str, float]
    started: float
    uptime_s: float
    tcp: str | None  # host:port where it listens on TCP too
    pending: int
    max_pending: int
    draining: bool
    num_rejected: int
    num_disconnects: int
    engine_alive: bool
    engine_steps_failed: int


class Stats(TypedDict):
    """`GET /v1/stats` (`server.metrics.stats`; `Client.stats`)."""

    version: str
    server: ServerInfo
    engine: EngineSnapshot
