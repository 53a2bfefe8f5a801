"""Every registered adapter and where it lives: disk (registered only) -> host cache -> device
pages of the unified pool. This module owns the registry and the device tier; the host tier is
`host_cache.py`, and moving data between tiers ahead of need is `prefetch.py`.

Contracts:
- Registering costs no device memory: only the config is read and checked.
- An adapter is `ready` when its pages hold its weights; only then may a request that uses it
  be scheduled. Pages are in proportion to its size (so to its rank): no max-rank padding.
- `pins` counts running requests using the adapter: a pinned adapter is never evicted.
  `users` counts unfinished requests (running or waiting): unloading is refused while > 0.
- Eviction frees device pages of unpinned adapters, least recently used first, and only when
  pages are needed (for KV or another adapter). An adapter made ready less than
  `min_resident_steps` steps ago is spared when another adapter wants its pages (hysteresis,
  so two hot sets do not thrash the pool); KV pressure may still take it.
- Contiguous pages give zero-copy views fixed for the adapter's stay; scattered pages are
  gathered once per step instead (correct, slower).
Checked by `check_integrity()`: every adapter's pages are exactly the pool pages its owner id
holds, and pinned adapters are ready.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from lorafleet.errors import AdapterError, AdapterInUseError, AdapterNotFoundError, PoolExhaustedError
from lorafleet.lora.adapter import BaseShapes, read_adapter_config, weights_numel
from lorafleet.memory.host_cache import HostAdapter, HostCache
from lorafleet.memory.layout import GroupView
from lorafleet.memory.pool import PagePool

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name) or ".." in name:
        raise AdapterError(f"adapter name {name!r} is invalid: use 1-128 letters, digits and . _ - : @ /,"
                           " starting with a letter or digit, without '..'")
    return name


@dataclass(eq=False)
class AdapterEntry:
    name: str
    path: Path
    digest: str | None = None            # known once the weights have been read
    numel: int = 0                       # elements of its weights, from the file header
    host: HostAdapter | None = None      # set while in the host cache (or being copied)
    pages: list[int] | None = None       # device pages, allocated
    ready: bool = False                  # pages hold the weights; views valid
    views: list[dict[str, GroupView]] | None = None
    kernel_meta: np.ndarray | None = None
    layout: object = None                # memory.layout.Layout, kept while on the device
    loading: object = None               # Future of the disk -> host load
    copying: object = None               # Future of the host -> device copy
    error: str | None = None             # the last load failed with this message
    users: int = 0
    pins: int = 0
    last_used: float = 0.0
    ready_step: int = 0
    ranks: dict[str, int] = field(default_factory=dict)
    num_params: int = 0
    hits: int = 0
    misses: int = 0
    disk_loads: int = 0
    device_loads: int = 0
    evictions: int = 0
    load_time_s: float = 0.0

    @property
    def tier(self) -> str:
        return "device" if self.ready else "host" if self.host is not None else "disk"

    @property
    def contiguous(self) -> bool:
        return self.views is not None

    def info(self) -> dict:
        return {"name": self.name, "path": str(self.path), "digest": self.digest, "tier": self.tier,
                "ranks": self.ranks, "modules": sorted(self.ranks), "params": self.num_params,
                "pages": len(self.pages or ()), "contiguous": self.contiguous, "users": self.users,
                "pinned": self.pins > 0, "hits": self.hits, "misses": self.misses,
                "loads": self.disk_loads, "device_loads": self.device_loads,
                "evictions": self.evictions, "load_time_s": self.load_time_s, "error": self.error}


class AdapterResidency:
    def __init__(self, pool: PagePool, base: BaseShapes, host_cache_bytes: int,
                 min_resident_steps: int = 4):
        self.pool = pool
        self.base = base
        self.host = HostCache(host_cache_bytes)
        self.entries: dict[str, AdapterEntry] = {}
        self.min_resident_steps = min_resident_steps
        self.step = 0
        self.pin_host = pool.tensor.device.type == "cuda"

    # -- registry ----------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def get(self, name: str) -> AdapterEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered") from None

    def register(self, name: str, path: str | Path) -> AdapterEntry:
        """Check the config against the base (cheap) and record the adapter; no weights read.
        Registering a name again with another path replaces it while nothing uses it."""
        check_name(name)
        path = Path(path)
        read_adapter_config(path, self.base)
        numel = weights_numel(path)
        old = self.entries.get(name)
        if old is not None:
            if old.path == path and old.error is None:
                return old
            self.unregister(name)
        entry = AdapterEntry(name, path, numel=numel)
        self.entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        entry = self.get(name)
        if entry.users:
            raise AdapterInUseError(f"adapter {name!r} is used by {entry.users} request(s); "
                                    "unload it when they finish")
        if entry.copying is not None:
            raise AdapterInUseError(f"adapter {name!r} is being copied to the device; retry")
        if entry.pages is not None:
            self._free_device(entry)
        self.host.drop(name)
        del self.entries[name]

    # -- device tier -------------------------------------------------------------------
    def pages_needed(self, entry: AdapterEntry) -> int:
        numel = entry.host.layout.numel if entry.host is not None else entry.numel
        return -(-numel // self.pool.page_elems)

    def allocate(self, entry: AdapterEntry, reserve: int = 0, protect: set[str] = frozenset(),
                 for_kv: bool = False) -> bool:
        """Give `entry` (with a host copy) its device pages, evicting idle adapters if that
        makes room; False (nothing evicted) when it cannot fit now."""
        need = self.pages_needed(entry)
        if need > self.pool.num_pages:
            raise PoolExhaustedError(f"adapter {entry.name!r} needs {need} pages; the pool has "
                                     f"{self.pool.num_pages} in all (raise pool_bytes)")
        protect = protect | {entry.name}
        if not self.make_room(need + reserve, protect, for_kv=for_kv):
            return False
        if self.pool.largest_free_run() < need:
            self._make_contiguous(need, protect, for_kv)
        entry.pages = self.pool.allocate(need, self.pool.owner_id(entry.name))
        return True

    def _make_contiguous(self, need: int, protect: set[str], for_kv: bool) -> None:
        """Evict the idle adapters standing in the cheapest window of `need` pages, so the new
        adapter gets one run (zero-copy views, the fused CPU kernel) instead of scattered
        pages; when no window is free of KV and busy adapters, it will be scattered."""
        evictable = {self.pool.owner_id(e.name): e for e in self._idle(protect, for_kv)}
        owners = self.pool.cheapest_window(need, set(evictable))
        for oid in owners or ():
            self._free_device(evictable[oid])
            evictable[oid].evictions += 1

    def _idle(self, protect: set[str], for_kv: bool) -> list[AdapterEntry]:
        """Adapters that may be evicted now, least recently used first."""
        young = self.step - self.min_resident_steps
        return sorted((e for e in self.entries.values()
                       if e.ready and e.pins == 0 and e.copying is None and e.name not in protect
                       and (for_kv or e.ready_step <= young)),
                      key=lambda e: e.last_used)

    def copy_in(self, host: HostAdapter, pages: list[int], stream=None) -> None:
        """Host -> device pages (runs on a prefetch worker; the pages are already allocated).
        On CUDA the copy runs on the side `stream` and is complete when this returns, so the
        adapter is marked ready only after its bytes landed."""
        buf, n = host.buffer, host.layout.numel
        assert n <= len(pages) * self.pool.page_elems, "adapter larger than its pages"
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if pages == list(range(pages[0], pages[0] + len(pages))):
                dst = self.pool.tensor[pages[0]:pages[0] + len(pages)].view(-1)[:n]
                dst.copy_(buf, non_blocking=stream is not None)
            else:
                per = self.pool.page_elems
                for i, p in enumerate(pages):
                    part = buf[i * per:(i + 1) * per]
                    self.pool.tensor[p, :part.numel()].copy_(part, non_blocking=stream is not None)
        if stream is not None:
            stream.synchronize()

    def release_pages(self, entry: AdapterEntry) -> None:
        """Give back pages allocated for a load that failed."""
        if entry.pages is not None and not entry.ready:
            self.pool.free(entry.pages)
            entry.pages = None

    def mark_ready(self, entry: AdapterEntry) -> None:
        """After the copy: build the views the LoRA op reads (engine thread)."""
        host, pages = entry.host, entry.pages
        entry.digest, entry.ranks, entry.num_params = host.digest, host.ranks, host.num_params
        entry.layout = host.layout
        if pages == list(range(pages[0], pages[0] + len(pages))):
            buf = self.pool.tensor[pages[0]:pages[0] + len(pages)].view(-1)
            entry.views = host.layout.views(buf, self.base.num_layers)
            entry.kernel_meta = host.layout.kernel_meta(pages[0] * self.pool.page_elems, self.base.num_layers)
        else:
            entry.views, entry.kernel_meta = None, None
        entry.ready = True
        entry.ready_step = self.step
        entry.device_loads += 1
        entry.last_used = time.monotonic()

    def make_room(self, pages: int, protect: set[str] = frozenset(), for_kv: bool = False) -> bool:
        """Evict idle adapters (unpinned, not in `protect`, least recently used first; young ones
        only for KV) until `pages` are free. Evicts nothing when that would not suffice."""
        if self.pool.can_allocate(pages):
            return True
        idle = self._idle(protect, for_kv)
        short = pages - self.pool.num_free
        if sum(len(e.pages) for e in idle) < short:
            return False
        for e in idle:
            if self.pool.can_allocate(pages):
                break
            self._free_device(e)
            e.evictions += 1
        return True

    def _free_device(self, entry: AdapterEntry) -> None:
        self.pool.free(entry.pages)
        entry.pages, entry.ready, entry.views, entry.kernel_meta, entry.layout = None, False, None, None, None

    def pin(self, name: str) -> None:
        entry = self.entries[name]
        assert entry.ready, f"adapter {name!r} pinned while not on the device"
        entry.pins += 1
        entry.last_used = time.monotonic()

    def unpin(self, name: str) -> None:
        entry = self.entries[name]
        assert entry.pins > 0, f"adapter {name!r} unpinned more often than pinned"
        entry.pins -= 1
        entry.last_used = time.monotonic()

    def is_ready(self, name: str | None) -> bool:
        return name is None or self.entries[name].ready

    def step_views(self, entry: AdapterEntry) -> list[dict[str, GroupView]]:
        """The views for this step: the cached zero-copy ones, or a gather of scattered pages."""
        if entry.views is not None:
            return entry.views
        buf = self.pool.tensor[entry.pages].view(-1)
        return entry.layout.views(buf, self.base.num_layers)

    # -- checks & stats ----------------------------------------------------------------
    def check_integrity(self) -> None:
        by_owner = self.pool.owner_map()
        for name, e in self.entries.items():
            owned = by_owner.get(self.pool.owner_id(name), [])
            assert sorted(e.pages or []) == owned, f"adapter {name!r}: pages disagree with the pool"
            assert e.pins == 0 or e.ready, f"adapter {name!r} is pinned but not on the device"
            assert 0 <= e.pins <= e.users, f"adapter {name!r}: pins {e.pins} > users {e.users}"
            assert not e.ready or e.pages is not None
            assert e.ready or e.pages is None or e.copying is not None or e.loading is not None, \
                f"adapter {name!r}: stray pages"

    def stats(self) -> dict:
        tiers = {"device": 0, "host": 0, "disk": 0}
        for e in self.entries.values():
            tiers[e.tier] += 1
        return {"registered": len(self.entries), "tiers": tiers, "host_cache_bytes": self.host.nbytes,
                "host_cache_capacity": self.host.capacity}
