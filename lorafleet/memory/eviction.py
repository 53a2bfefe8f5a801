"""One eviction order for the two kinds of evictable pages in the unified pool: cached KV blocks
(`memory/kv.py`; bringing one back means recomputing its tokens) and idle adapters
(`memory/residency.py`; bringing one back means a request waiting for its load).

A victim is the candidate with the smallest expected loss per byte freed:

    score = (cost to bring it back, per byte) / (seconds it has been idle)

The cost is per kind, measured by the engine while it serves, as exponential moving averages
started from priors: for a cached block, the forward-pass seconds per token of the steps that
computed prompts, times the tokens of a block (`observe_prefill`); for an adapter, the time a
request whose adapter was not on the device when it arrived was kept waiting for it, per byte of
that adapter (`observe_miss`: the exposed wait, zero when the load finished before the request
could have run anyway; not the load's CPU time: a load of 2 ms that misses a step boundary
costs the request a whole step). The idle time stands for how unlikely a reuse is (a page idle
twice as long is taken to be half as likely to be wanted soon). Within a kind every candidate
has the same cost, so the order is least recently used, except that cached blocks no admission
has reused yet go before blocks that were reused (`reuse_aware`: a block reused once is a
shared prefix, likely wanted again; most never-reused ones are one request's question and
answer); across kinds a page is kept longer the dearer its kind is to bring back. With
`policy="lru"` cost and reuse are left out: plain LRU over both kinds (the comparison the
`shared-prefix-pressure` benchmark makes).

Outside the order, for KV (admissions, growth): an idle adapter that a waiting request wants
goes only when nothing else is left (`AdapterResidency.make_room`'s `wanted`), whatever the
policy; it was loaded for that request, which would otherwise miss the step and load it again.

This object decides and counts; the residency evicts adapters and the KV manager cached blocks.
"""

from __future__ import annotations

from lorafleet.snapshot import EvictionStats

POLICIES = ("cost", "lru")
EWMA = 0.2
PRIOR_RECOMPUTE_S_PER_TOKEN = 1e-4
PRIOR_MISS_S_PER_BYTE = 1e-9


class EvictionOrder:
    def __init__(self, policy: str, block_size: int, page_bytes: int):
        if policy not in POLICIES:
            raise ValueError(f"eviction policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.reuse_aware = policy == "cost"  # cached blocks: never reused before reused
        self.block_size = block_size
        self.page_bytes = page_bytes
        self.recompute_s_per_token = PRIOR_RECOMPUTE_S_PER_TOKEN
        self.miss_s_per_byte = PRIOR_MISS_S_PER_BYTE
        self.evictions = {"kv_blocks": 0, "adapters": 0}

    def evicted(self, kind: str) -> None:
        """The arbiter evicted one of `kind` ("kv_blocks" or "adapters") by this order."""
        self.evictions[kind] += 1

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        if tokens > 0 and seconds > 0:
            self.recompute_s_per_token += EWMA * (seconds / tokens - self.recompute_s_per_token)

    def observe_miss(self, waited_s: float, nbytes: int) -> None:
        """A request whose adapter (of `nbytes`) was not on the device at its arrival was
        admitted after waiting `waited_s` for it (0: it lost nothing)."""
        if nbytes > 0 and waited_s >= 0:
            self.miss_s_per_byte += EWMA * (waited_s / nbytes - self.miss_s_per_byte)

    @property
    def kv_cost(self) -> float:
        """Seconds per byte to recompute a cached block."""
        return self.recompute_s_per_token * self.block_size / self.page_bytes

    def score(self, cost_per_byte: float, idle_since: float, now: float) -> float:
        """Lower goes first."""
        age = max(now - idle_since, 1e-6)
        return -age if self.policy == "lru" else cost_per_byte / age

    def kv_first(self, kv_idle_since: float | None, adapter_idle_since: float | None, now: float) -> bool:
        """Whether the oldest cached block goes before the oldest idle adapter (None: no such
        candidate)."""
        if kv_idle_since is None or adapter_idle_since is None:
            return adapter_idle_since is None
        return (self.score(self.kv_cost, kv_idle_since, now)
                <= self.score(self.miss_s_per_byte, adapter_idle_since, now))

    def stats(self) -> EvictionStats:
        return {"policy": self.policy, "recompute_s_per_token": self.recompute_s_per_token,
                "miss_s_per_byte": self.miss_s_per_byte, "kv_cost_s_per_byte": self.kv_cost,
                "evicted_kv_blocks": self.evictions["kv_blocks"], "evicted_adapters": self.evictions["adapters"]}
