"""The one arbiter of room in the unified pool: whoever needs pages (the scheduler for KV, the
prefetcher for an adapter) asks here, and only here is it decided what leaves the pool.

Candidates, each offered by the module that owns it, which also evicts it when told:
- free pages (`memory/pool.py`);
- cached KV blocks, full prompt blocks kept for prefix reuse (`memory/kv.py`: `oldest_cached`,
  `evict_cached`); bringing one back means recomputing its tokens;
- idle adapters, ready and unpinned (`memory/residency.py`: `evictable`, `evict`); bringing one
  back means a request waiting for its load. Residency says which may go (never a pinned one; a
  young one that a request holds or ran on only for KV, the hysteresis); the arbiter says when.
The order between cached blocks and adapters is `memory/eviction.py`'s: the least expected loss
per byte freed (or plain LRU). Outside the order, for KV: an idle adapter that a waiting request
wants goes only when nothing else is left (`wanted`): it was loaded for that request, which would
otherwise miss the step and load it again.

Nothing is evicted for room that eviction could not complete (`make_room` checks first), and
nothing is evicted before it is needed: `reclaimable` answers what could be freed without
freeing it.
"""

from __future__ import annotations

import statistics
import time
from typing import Container

from lorafleet.memory.eviction import EvictionOrder
from lorafleet.memory.kv import KVCacheManager
from lorafleet.memory.pool import PagePool
from lorafleet.snapshot import EvictionStats, LoraCapacity


class Arbiter:
    def __init__(self, pool: PagePool, kv: KVCacheManager, adapters, order: EvictionOrder):
        """`adapters`: the `AdapterResidency` (its idle adapters are candidates)."""
        self.pool, self.kv, self.adapters, self.order = pool, kv, adapters, order

    def reclaimable(self, protect=()) -> int:
        """Pages KV could have without preempting anyone: free ones, cached KV blocks and idle
        adapters' (but those in `protect`)."""
        return self.pool.num_free + self.pool.num_cached + self.adapters.idle_pages_but(protect)

    def make_room(self, pages: int, protect: Container = frozenset(), for_kv: bool = False,
                  wanted: Container = frozenset()) -> bool:
        """Evict idle adapters (unpinned, not in `protect`; young ones only for KV) and cached KV
        blocks, in the eviction order, until `pages` are free; adapters in `wanted` (those of
        waiting requests) only when nothing else is left. Evicts nothing when that would not
        suffice."""
        if self.pool.can_allocate(pages):
            return True
        idle = self.adapters.evictable(protect, for_kv)
        short = pages - self.pool.num_free
        if self.pool.num_cached + sum(len(e.pages) for e in idle) < short:
            return False
        others = [e for e in idle if e not in wanted]
        last = [e for e in idle if e in wanted]
        now, i = time.monotonic(), 0
        while not self.pool.can_allocate(pages):
            adapter = others[i] if i < len(others) else None
            kv_since = self.kv.oldest_cached(self.order.reuse_aware)
            if adapter is None and kv_since is None:
                self.adapters.evict(last.pop(0))
                self.order.evicted("adapters")
            elif self.order.kv_first(kv_since, adapter.last_used if adapter else None, now):
                self.kv.evict_cached(self.order.reuse_aware)
                self.order.evicted("kv_blocks")
            else:
                self.adapters.evict(adapter)
                self.order.evicted("adapters")
                i += 1
        return True

    def place(self, entry, reserve: int = 0, protect: Container = frozenset(), for_kv: bool = False) -> bool:
        """Room, then pages, for the adapter `entry`, leaving `reserve` pages free besides: False
        (nothing evicted) when it cannot fit now; AdapterTooLargeError when it never can."""
        need = self.adapters.pages_needed(entry)
        self.adapters.check_fits(entry.name, need * self.pool.adapter_page_elems)
        if not self.make_room(need + reserve, protect, for_kv=for_kv):
            return False
        self.adapters.allocate(entry)
        return True

    # what a cold adapter and a recomputed prefill cost, as the steps and admissions show it: the
    # eviction order's model, fed through the arbiter that owns it
    def observe_prefill(self, seconds: float, tokens: int) -> None:
        self.order.observe_prefill(seconds, tokens)

    def observe_miss(self, waited_s: float, nbytes: int) -> None:
        self.order.observe_miss(waited_s, nbytes)

    def eviction_stats(self) -> EvictionStats:
        return self.order.stats()

    def adapter_capacity(self, max_num_seqs: int) -> LoraCapacity:
        """How many adapters the pool could hold at the median adapter size (what gateways read
        as `max_lora`): {"max_adapters", "median_pages", "sized_adapters", "basis"}, basis
        "resident" (device or host tier), "registered" (sizes from the weights files' headers,
        before any adapter is resident) or "max_num_seqs" (no adapter registered). One pass over
        the registry."""
        entries = [e for e in self.adapters.entries.values() if e.numel > 0]
        basis = "resident"
        sized = [e for e in entries if e.tier != "disk"]
        if not sized:
            basis, sized = "registered", entries
        if not sized:
            return {"max_adapters": max_num_seqs, "median_pages": None, "sized_adapters": 0, "basis": "max_num_seqs"}
        median = statistics.median(-(-e.numel // self.pool.adapter_page_elems) for e in sized)
        return {"max_adapters": max(1, int(self.pool.num_pages // median)), "median_pages": median,
                "sized_adapters": len(sized), "basis": basis}
