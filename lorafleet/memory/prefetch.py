"""The prefetcher: moves adapters disk -> host -> device pages ahead of need, driven by the whole
waiting queue (not only the next batch), on worker threads, so that a step never waits for a
load.

`tick(wanted)` runs on the engine thread at the start of every step:
1. harvest finished work: disk loads enter the host cache; device copies make adapters ready
   (their names are returned as this step's switches); failed loads are returned with their
   message (the engine fails only the requests for that adapter);
2. in queue order, for each adapter some waiting request wants (`want`): when it is in the host
   cache, give it pages (evicting idle adapters if that makes room; when it cannot, later
   adapters wait too, so that pages go in queue order) and start the host -> device copy (a side
   CUDA stream on GPUs, a plain copy on CPU); when it is on disk, start its load, and when pages
   can be had now, copy it in the same task (its size is known from the file header): one
   hand-off instead of two, so a cold adapter is ready one step sooner.
The engine also calls `want` the moment a request arrives, so loads start before the next step.
Only the engine thread touches the pool's allocator; workers only fill pages already allocated.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from lorafleet.memory import host_cache
from lorafleet.memory.residency import AdapterEntry, AdapterResidency


@dataclass
class TickResult:
    loaded: list[str] = field(default_factory=list)        # became ready on the device
    failed: dict[str, str] = field(default_factory=dict)   # name -> why its load failed


class Prefetcher:
    def __init__(self, residency: AdapterResidency, workers: int = 2):
        self.residency = residency
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="lorafleet-prefetch",
                                           initializer=_background_priority)
        device = residency.pool.tensor.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._loading: list[AdapterEntry] = []
        self._copying: list[AdapterEntry] = []

    @property
    def busy(self) -> bool:
        return bool(self._loading or self._copying)

    def tick(self, wanted: list[str], reserve_pages: int = 0) -> TickResult:
        """`wanted`: adapter names of the waiting requests, in queue order, without repeats."""
        result = TickResult()
        self._harvest(result)
        protect = set(wanted)
        for name in wanted:
            entry = self.residency.entries.get(name)
            if entry is not None and not self.want(entry, protect, reserve_pages):
                break  # no room now: pages go in queue order
        return result

    def want(self, entry: AdapterEntry, protect: set[str] = frozenset(), reserve_pages: int = 0) -> bool:
        """Move `entry` toward the device: from the host cache, take pages and start the copy;
        from disk, when pages can be had now, load and copy in one task (the size is known from
        the file header), else load to the host only. False when it waits for pages."""
        if entry.ready or entry.loading or entry.copying or entry.error:
            return True
        r = self.residency
        if entry.host is not None:
            if not r.allocate(entry, reserve=reserve_pages, protect=protect):
                return False
            entry.copying = self.executor.submit(r.copy_in, entry.host, entry.pages, self.stream)
            self._copying.append(entry)
            return True
        with_pages = entry.numel > 0 and r.allocate(entry, reserve=reserve_pages, protect=protect)
        entry.loading = self.executor.submit(_load, r, entry.path, entry.pages if with_pages else None,
                                             self.stream)
        self._loading.append(entry)
        return True

    def _harvest(self, result: TickResult) -> None:
        r = self.residency
        for entry in [e for e in self._loading if e.loading.done()]:
            self._loading.remove(entry)
            future, entry.loading = entry.loading, None
            try:
                host, seconds = future.result()
            except Exception as e:  # an AdapterError names the problem; anything else is a bug
                entry.error = str(e)
                r.release_pages(entry)
                result.failed[entry.name] = entry.error
                continue
            entry.disk_loads += 1
            entry.load_time_s += seconds
            entry.digest = host.digest
            self.admit_host(entry, host)
            if entry.pages is not None:  # copied in the same task
                r.mark_ready(entry)
                result.loaded.append(entry.name)
        for entry in [e for e in self._copying if e.copying.done()]:
            self._copying.remove(entry)
            future, entry.copying = entry.copying, None
            future.result()  # a failed copy into our own pool is our bug: let it raise
            r.mark_ready(entry)
            result.loaded.append(entry.name)

    def admit_host(self, entry: AdapterEntry, host) -> None:
        """Put a freshly built host copy into the cache, dropping LRU others (never one that is
        being copied to the device)."""
        r = self.residency
        entry.host = host
        keep = {e.name for e in self._copying}
        for name in r.host.put(entry.name, host, keep=keep):
            r.entries[name].host = None

    def wait_any(self, timeout: float) -> None:
        """Block until some in-flight load or copy finishes, or `timeout` seconds."""
        futures = [f for e in self._loading + self._copying for f in (e.loading, e.copying) if f is not None]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block until in-flight loads finish (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        for e in list(self._loading) + list(self._copying):
            for fut in (e.loading, e.copying):
                if isinstance(fut, Future):
                    fut.exception(timeout=max(0.0, deadline - time.monotonic()))

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


def _background_priority() -> None:
    """Workers yield the cores to the engine's steps: a load may take longer, a step must not
    (on a GPU host the loads use spare cores anyway). Linux nice is per thread, and inherited
    by the threads torch starts from this one."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: normal priority
        pass


def _load(residency: AdapterResidency, path, pages: list[int] | None, stream):
    """Worker: disk -> host (read, validate, lay out), and into `pages` when given."""
    t0 = time.perf_counter()
    host = host_cache.build_host_adapter(path, residency.base, residency.pool.tensor.dtype,
                                         residency.pin_host)
    if pages is not None:
        if host.layout.numel > len(pages) * residency.pool.page_elems:
            raise ValueError(f"{path}: weights larger than their header said")
        residency.copy_in(host, pages, stream)
    return host, time.perf_counter() - t0


def load_now(prefetcher: Prefetcher, name: str, path) -> AdapterEntry:
    """The eager form (`Engine.load_adapter`): read, validate and copy into pages before
    returning. A refused adapter changes nothing: the files are checked before the registry or
    the pool are touched, and a registration that cannot get pages is rolled back."""
    from pathlib import Path

    from lorafleet.errors import PoolExhaustedError
    from lorafleet.memory.residency import check_name

    r = prefetcher.residency
    check_name(name)
    path = Path(path)
    prefetcher.wait_idle()
    prefetcher.tick([])  # settle in-flight loads first
    t0 = time.perf_counter()
    host = host_cache.build_host_adapter(path, r.base, r.pool.tensor.dtype, r.pin_host)
    seconds = time.perf_counter() - t0
    old = r.entries.get(name)
    if old is not None and old.ready and old.path == path and old.digest == host.digest:
        return old
    if old is not None:
        r.unregister(name)  # AdapterInUseError while requests use it: nothing changed yet
    entry = r.register(name, path)
    entry.disk_loads, entry.load_time_s, entry.digest = 1, seconds, host.digest
    prefetcher.admit_host(entry, host)
    need = r.pages_needed(entry)
    try:
        fits = r.allocate(entry)
    except PoolExhaustedError:
        r.unregister(name)
        raise
    if not fits:
        r.unregister(name)
        raise PoolExhaustedError(f"adapter {name!r} needs {need} pages; {r.pool.num_free} of "
                                 f"{r.pool.num_pages} are free and running requests hold the rest")
    r.copy_in(entry.host, entry.pages, prefetcher.stream)
    r.mark_ready(entry)
    return entry
