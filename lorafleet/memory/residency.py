"""Every registered adapter and where it lives: disk (registered only) -> host cache -> device
pages of the unified pool.

This module is the only writer of adapter state (the fields of `AdapterEntry`). The others call
its interface: the engine `acquire`/`release` for a request's life; the scheduler `pin`/`unpin`;
the prefetcher the load transitions (`load_started`, `loaded`, `load_failed`, `copy_started`,
`copied`), `allocate`, and `stage`/`install` for eager loads; the arbiter (`arbiter.py`, the one
place that decides what leaves the pool) `evictable` and `evict`. Moving data between tiers ahead
of need is `prefetch.py`; the host tier's LRU is `host_cache.py`.

Contracts:
- Registering costs no device memory: only the config and the weights file's header are read.
  An adapter larger than the whole pool is refused there (AdapterTooLargeError: no retry helps).
- An adapter is `ready` when its pages hold its weights; only then may a request that uses it
  be scheduled. Pages are in proportion to its size (so to its rank): no max-rank padding.
- `users` counts unfinished requests that acquired the entry (running or waiting); `pins` counts
  the running ones. A pinned adapter is never evicted; unloading is refused while users > 0.
- A name points to one entry at a time (`entries`). Replacing it (`register` with another path,
  or an eager load of other weights, which is `install`ed only once its pages hold them) retires
  the old entry: requests that acquired it finish on its weights, and its pages and host copy go
  back when its last user releases it. A request never mixes two weights, and every request
  that arrives after the swap gets the new ones.
- Eviction frees device pages of unpinned adapters, among cached KV blocks (`memory/kv.py`), when
  the arbiter says so (`memory/arbiter.py`: one order, `memory/eviction.py`), and only when pages
  are needed (for KV or another adapter). An adapter made ready less than
  `min_resident_steps` steps ago for a request (one holds it, or one ran on it since) is spared
  when another adapter wants its pages (hysteresis, so two hot sets do not thrash the pool); one
  no request has held since it became ready (loaded at start, or by an API call) is not, so
  start-up loads evict as later ones do. KV pressure may still take it, but an adapter that a
  waiting request wants only when nothing else is left.
- An adapter's pages may lie anywhere in the pool: the kernels read its weights through its
  row table (in its own pages, built for those pages by the copy that fills them:
  `adapters/layout.py`; `row_table` is where it starts, fixed for its stay), so nothing is
  gathered per step and no eviction is ever made to find a contiguous run.
Checked by `check_integrity()`: every adapter's pages are exactly the pool pages its owner id
holds, no adapter owner is unknown, pins <= users, pinned adapters are ready.
"""

from __future__ import annotations

import itertools
import re
import time
from collections import OrderedDict
from pathlib import Path
from typing import Container

from lorafleet.errors import AdapterError, AdapterInUseError, AdapterNotFoundError, AdapterTooLargeError, shown
from lorafleet.adapters.batch import HeadParts
from lorafleet.adapters.alora import invocation_tokens
from lorafleet.adapters.heads import own_tokenizer
from lorafleet.adapters.adapter import BaseShapes, read_adapter_config
from lorafleet.adapters.weights_file import read_plan
from lorafleet.memory.entry import AdapterEntry, Inspected
from lorafleet.memory.host_cache import HostAdapter, HostCache
from lorafleet.memory.kv import kv_salt
from lorafleet.adapters.layout import Layout
from lorafleet.memory.pool import CACHED, PagePool
from lorafleet.snapshot import AdaptersStats, AdapterTiers

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name) or ".." in name:
        raise AdapterError("adapter name is invalid: use 1-128 letters, digits and . _ - : @ /,"
                           " starting with a letter or digit, without '..'")
    return name


class AdapterResidency:
    def __init__(self, pool: PagePool, base: BaseShapes, host_cache_bytes: int, min_resident_steps: int = 4,
                 base_rows=None):
        """`base_rows(layer, group, start, end)`: the base's weight rows (and bias) as served, for
        DoRA's norms and saved copies (`adapters.finish`); read by the load workers, never written."""
        self.pool = pool
        self.base = base
        self.base_rows = base_rows
        self.host: HostCache[AdapterEntry] = HostCache(host_cache_bytes)
        self.entries: dict[str, AdapterEntry] = {}   # name -> its current entry
        self.retired: set[AdapterEntry] = set()      # replaced or unloaded, still in use or in flight
        self.staged: set[AdapterEntry] = set()       # eager loads not installed yet
        self.min_resident_steps = min_resident_steps
        self.step = 0
        self.pin_host = pool.tensor.device.type == "cuda"
        self.itemsize = pool.adapter_tensor.element_size()  # an adapter's elements (`PagePool.adapter_dtype`)
        self._idle_lru: OrderedDict[AdapterEntry, None] = OrderedDict()  # ready, unpinned; LRU first
        self.idle_pages = 0  # the pages of the adapters in `_idle_lru`

    # -- registry ----------------------------------------------------------------------
    def next_step(self) -> None:
        """An engine step begins: adapters that land from now on are this step's (`ready_step`:
        an adapter stays `min_resident_steps` steps before it may be evicted)."""
        self.step += 1

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def get(self, name: str) -> AdapterEntry:
        try:
            return self.entries[name]
        except KeyError:
            e = AdapterNotFoundError(f"adapter {shown(name)} is not registered")
            e.adapter = name  # which one, for a front end to name (a mix names several)
            raise e from None

    def inspect(self, name: str, path: str | Path, tokenizer: bool = True) -> Inspected:
        """Check the adapter's config against the base and its size against the pool, from the
        config and the weights file's header alone (no tensor data is read); returns the elements
        it takes in pages. Reads only what never changes here (the base, the pool's size): any
        thread may call it, and the daemon calls it on a worker, since an adapter's config
        patterns and header are the file's to make expensive (bounded: `adapters/peft_config.py`,
        `adapters/adapter.py`). An adapter with its own vocabulary (`adapters/heads.py`) brings its own
        tokenizer, read here too (unless `tokenizer` is False) and checked against it."""
        path = Path(path)
        invocation = invocation_tokens(read_adapter_config(path, self.base))
        plan = read_plan(path, self.base)
        self.check_fits(name, plan.numel)  # before planning: the header's ranks are bounded by the pool
        layout = Layout.plan(plan.ranks, self.base, self.pool.adapter_page_elems, plan.posts, plan.heads)
        numel = layout.paged_numel(self.itemsize)
        self.check_fits(name, numel)
        copy = layout.parts.get("embed") or layout.parts.get("lm_head")
        if copy is None or copy.rows == self.base.vocab_size:
            return Inspected(numel, saved=layout.saved, invocation=invocation)
        return Inspected(numel, copy.rows, own_tokenizer(path, copy.rows, self.base.vocab_size) if tokenizer else None,
                         layout.saved, invocation)

    def register(self, name: str, path: str | Path, trusted_digest: str | None = None,
                 inspected: Inspected | None = None) -> AdapterEntry:
        """Record the adapter, `inspect`ed first unless `inspected` says what an inspection of
        `path` found (the daemon inspects on a worker). Registering a name again with the same path
        keeps it; with another path replaces it (the old one is retired). `trusted_digest`: the
        store's digest of these files, validated against this base when pulled; its loads then
        read the tensors without checking or hashing them again."""
        check_name(name)
        path = Path(path)
        if inspected is None:
            inspected = self.inspect(name, path)
        old = self.entries.get(name)
        if old is not None and old.path == path and old.error is None:
            return old
        return self._take_name(AdapterEntry(name, path, self.pool.new_owner(name), numel=inspected.numel,
                                            trusted_digest=trusted_digest, vocab_size=inspected.vocab_size,
                                            tokenizer=inspected.tokenizer, saved=inspected.saved,
                                            invocation=inspected.invocation))

    def unregister(self, name: str) -> None:
        entry = self.get(name)
        if entry.users:
            raise AdapterInUseError(f"adapter {name!r} is used by {entry.users} request(s); "
                                    "unload it when they finish")
        del self.entries[name]
        self._retire(entry)

    def check_fits(self, name: str, numel: int) -> None:
        need = -(-numel // self.pool.adapter_page_elems)
        if need > self.pool.num_pages:
            size = numel * self.itemsize
            raise AdapterTooLargeError(
                f"adapter {name!r} needs {need} pages ({size / 2**20:.1f} MiB); the pool holds "
                f"{self.pool.num_pages} pages ({self.pool.num_pages * self.pool.page_bytes / 2**20:.1f} MiB)"
                " in all (raise pool_bytes)")

    def stage(self, name: str, path: Path) -> AdapterEntry:
        """An entry for an eager load, outside the registry until `install`."""
        entry = AdapterEntry(name, path, self.pool.new_owner(name))
        self.staged.add(entry)
        return entry

    def install(self, entry: AdapterEntry) -> AdapterEntry:
        """A staged entry whose pages hold its weights takes over its name."""
        assert entry.ready and entry in self.staged
        self.staged.discard(entry)
        return self._take_name(entry)

    def _take_name(self, entry: AdapterEntry) -> AdapterEntry:
        """`entry` is what its name means from now on; the entry it replaces is retired."""
        old = self.entries.get(entry.name)
        self.entries[entry.name] = entry
        if old is not None:
            self._retire(old)
        return entry

    def discard_staged(self, entry: AdapterEntry) -> None:
        """An eager load that will not be installed (refused, or the same weights are in)."""
        self.staged.discard(entry)
        self._retire(entry)

    def _retire(self, entry: AdapterEntry) -> None:
        self.retired.add(entry)
        self._drop_if_unused(entry)

    def _drop_if_unused(self, entry: AdapterEntry) -> None:
        if entry not in self.retired or entry.users or entry.loading is not None or entry.copying is not None:
            return
        if entry.pages is not None:
            self._free_device(entry)
        self.host.drop(entry)
        entry.host = None
        self.pool.forget_owner(entry.owner)
        self.retired.discard(entry)

    # -- a request's life --------------------------------------------------------------
    def acquire(self, name: str) -> AdapterEntry:
        """A new request uses the adapter named `name` until `release`."""
        entry = self.get(name)
        entry.users += 1
        if entry.ready:
            entry.hits += 1
        else:
            entry.misses += 1
            entry.error = None  # a new request retries a load that failed before
        return entry

    def acquire_all(self, names) -> tuple[AdapterEntry, ...]:
        """`acquire` each of `names` (a mix), all or none: AdapterNotFoundError for the first
        unknown one, with those before it released."""
        held: list[AdapterEntry] = []
        try:
            for name in names:
                held.append(self.acquire(name))
        except BaseException:
            for entry in held:
                self.release(entry)
            raise
        return tuple(held)

    def record_wait(self, entry: AdapterEntry, seconds: float) -> None:
        """A finished request on `entry` waited `seconds` for it beyond queueing (exposed load)."""
        entry.recent_waits.append(seconds)

    def release(self, entry: AdapterEntry) -> None:
        assert entry.users > 0, f"adapter {entry.name!r} released more often than acquired"
        entry.users -= 1
        self._drop_if_unused(entry)

    def pin(self, entry: AdapterEntry) -> None:
        assert entry.ready, f"adapter {entry.name!r} pinned while not on the device"
        entry.pins += 1
        entry.served = True
        entry.last_used = entry.last_request = time.monotonic()
        self._from_idle(entry)

    def unpin(self, entry: AdapterEntry) -> None:
        assert entry.pins > 0, f"adapter {entry.name!r} unpinned more often than pinned"
        entry.pins -= 1
        entry.last_used = entry.last_request = time.monotonic()
        if not entry.pins:
            self._to_idle(entry)  # the most recently used end

    def _to_idle(self, entry: AdapterEntry) -> None:
        if entry not in self._idle_lru:
            assert entry.pages is not None  # idle adapters are ready
            self.idle_pages += len(entry.pages)
        self._idle_lru[entry] = None

    def _from_idle(self, entry: AdapterEntry) -> None:
        if self._idle_lru.pop(entry, False) is None:  # it was idle (the LRU's values are None)
            assert entry.pages is not None  # idle adapters are ready
            self.idle_pages -= len(entry.pages)

    # -- load transitions (the prefetcher) -----------------------------------------------
    def load_started(self, entry: AdapterEntry, future) -> None:
        entry.loading = future

    def loaded(self, entry: AdapterEntry, host: HostAdapter, seconds: float, inspected: Inspected | None = None) -> bool:
        """The disk -> host load finished (and the copy too when it had pages): True when the
        adapter is now ready on the device. `inspected`: an eager load's inspection (its entry
        was staged, never registered)."""
        if inspected is not None:
            entry.vocab_size, entry.tokenizer, entry.saved = inspected.vocab_size, inspected.tokenizer, inspected.saved
            entry.invocation = inspected.invocation
        entry.loading = None
        entry.disk_loads += 1
        entry.load_time_s += seconds
        entry.recent_loads.append(seconds)
        entry.digest = host.digest
        entry.numel = host.layout.paged_numel(self.itemsize)
        self._put_host(entry, host)
        ready = entry.pages is not None
        if ready:
            self._mark_ready(entry)
        self._drop_if_unused(entry)
        return ready

    def load_failed(self, entry: AdapterEntry, message: str) -> None:
        entry.loading = None
        entry.error = message
        if entry.pages is not None and not entry.ready:
            self.pool.free(entry.pages)
            entry.pages = None
        self._drop_if_unused(entry)

    def copy_started(self, entry: AdapterEntry, future) -> None:
        entry.copying = future

    def copied(self, entry: AdapterEntry) -> None:
        entry.copying = None
        self._mark_ready(entry)
        self._drop_if_unused(entry)

    def _put_host(self, entry: AdapterEntry, host: HostAdapter) -> None:
        """Into the host cache, dropping LRU others (never one that is being copied)."""
        entry.host = host
        for evicted in self.host.put(entry, host, evictable=lambda e: e.copying is None):
            evicted.host = None

    def _mark_ready(self, entry: AdapterEntry) -> None:
        """After the copy: what the LoRA op reads, its page table and metadata (engine thread)."""
        host = entry.host
        assert host is not None  # loaded, and kept in the host cache while it is copied
        entry.ranks, entry.num_params = host.ranks, host.num_params
        entry.row_table = host.layout.table_index(entry.pages, self.itemsize)
        entry.max_rank = max((m.r for m in host.layout.modules), default=0)  # the LoRA op's bound: projections only
        entry.posts = host.layout.posts
        entry.copies = host.layout.saved  # the copies served: those equal to the base's were dropped (`finish.py`)
        entry.heads = (HeadParts(host.layout.parts, entry.pages, self.pool.adapter_page_elems, self.pool.tensor.device)
                       if host.layout.parts else None)
        entry.kv_salt = kv_salt(host.layout.targets(), host.digest, self.base.num_layers)
        entry.ready = True
        entry.ready_step = self.step
        entry.served = False
        entry.device_loads += 1
        entry.last_used = time.monotonic()
        self._to_idle(entry)

    # -- device tier -------------------------------------------------------------------
    def pages_needed(self, entry: AdapterEntry) -> int:
        numel = entry.host.layout.paged_numel(self.itemsize) if entry.host is not None else entry.numel
        return -(-numel // self.pool.adapter_page_elems)

    def allocate(self, entry: AdapterEntry) -> None:
        """Give `entry` its device pages, which must be free (`memory/arbiter.py` makes the room)."""
        entry.pages = self.pool.allocate(self.pages_needed(entry), entry.owner)

    def evictable(self, protect: Container[AdapterEntry], for_kv: bool) -> list[AdapterEntry]:
        """Adapters that may be evicted now, least recently used first (kept in that order as
        adapters are pinned and unpinned: no sort, no scan of the registry): idle, not in
        `protect`, and, but for KV, not young for a request (the hysteresis in the module doc)."""
        young = self.step - self.min_resident_steps
        return [e for e in self._idle_lru if e not in protect
                and (for_kv or e.ready_step <= young or not (e.users or e.served))]

    def idle_pages_but(self, protect=()) -> int:
        """Pages of the idle adapters, those of the entries in `protect` left out."""
        return self.idle_pages - sum(len(e.pages) for e in protect if e in self._idle_lru)

    def evict(self, entry: AdapterEntry) -> None:
        """Free an idle adapter's pages (the arbiter's decision: `memory/arbiter.py`)."""
        self._free_device(entry)
        entry.evictions += 1
        self._drop_if_unused(entry)

    def _free_device(self, entry: AdapterEntry) -> None:
        self._from_idle(entry)
        self.pool.free(entry.pages)
        entry.pages, entry.ready, entry.row_table, entry.heads = None, False, None, None

    # -- checks & stats ----------------------------------------------------------------
    def check_integrity(self) -> None:
        by_owner = self.pool.owner_map()
        for e in itertools.chain(self.entries.values(), self.retired, self.staged):
            owned = by_owner.pop(e.owner, [])
            assert sorted(e.pages or []) == owned, f"adapter {e.name!r}: pages disagree with the pool"
            assert e.pins == 0 or e.ready, f"adapter {e.name!r} is pinned but not on the device"
            assert 0 <= e.pins <= e.users, f"adapter {e.name!r}: pins {e.pins} > users {e.users}"
            assert not e.ready or e.pages is not None
            assert e.ready or e.pages is None or e.copying is not None or e.loading is not None, \
                f"adapter {e.name!r}: stray pages"
        for e in self.retired:
            assert e.users or e.loading is not None or e.copying is not None, \
                f"retired adapter {e.name!r} kept with nothing using it"
        idle = [e for e in itertools.chain(self.entries.values(), self.retired) if e.ready and not e.pins]
        assert set(idle) == set(self._idle_lru), "the idle LRU disagrees with the adapters' state"
        assert list(self._idle_lru) == sorted(self._idle_lru, key=lambda e: e.last_used), "idle LRU out of order"
        assert self.idle_pages == sum(len(e.pages or ()) for e in self._idle_lru), "idle page count drifted"
        strays = set(by_owner) - {-1, 0, CACHED}
        assert not strays, f"pages held by unknown adapter owners {sorted(strays)}"

    def stats(self) -> AdaptersStats:
        tiers: AdapterTiers = {"device": 0, "host": 0, "disk": 0}
        for e in self.entries.values():
            tiers[e.tier] += 1
        return {"registered": len(self.entries), "tiers": tiers, "retired": len(self.retired),
                "host_cache_bytes": self.host.nbytes, "host_cache_capacity": self.host.capacity}
