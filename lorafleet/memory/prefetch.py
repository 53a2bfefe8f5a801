"""The prefetcher: moves adapters disk -> host -> device pages ahead of need, driven by the whole waiting queue,
on worker threads, so that a step never waits for a load. It runs the work; `residency.py` records every state
change. Only the engine thread touches the pool's allocator; workers fill pages already allocated.

`tick(wanted)`, on the engine thread before every step (and `want` as each request arrives):
1. `harvest()` finished work: loads enter the host cache, copies make adapters ready (returned as switches), a
   failed load is returned with its message (failing only its adapter's requests), eager loads move on;
2. in queue order (`want`), pages for each adapter in the host cache, evicting idle ones (none to be had: later
   adapters wait too, so pages go in queue order), and its copy (on a side CUDA stream on GPUs); a load for one
   on disk, copying in the same task when pages can be had now (the header gives the size): a step sooner;
3. when that work's typical time is at most `MAX_TICK_WAIT_S`, wait for it up to `TICK_WAIT_LOADS` typical
   times, harvesting as it lands, so a cold adapter serves in this step, not after the next (maybe a long
   prefill). A multiple, since half the loads take longer than typical and a miss costs a whole step; typical
   is the median of the last `RECENT` loads (copies), since one outlier lifts a mean past the cap.

Eager loads (`load_eager`: `Engine.load_adapter`, `/v1/load_lora_adapter`) read, validate and hash on a worker
too, so running requests keep their pace; the staged entry takes over its name only once its pages hold the
weights (the old ones serve until then). The returned future holds its info, or why it was refused.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Container

import torch

from lorafleet import openmp
from lorafleet.errors import AdapterError, AdapterTooLargeError, PoolExhaustedError, ShuttingDownError
from lorafleet.memory import host_cache
from lorafleet.memory.arbiter import Arbiter
from lorafleet.memory.host_cache import HostAdapter
from lorafleet.adapters.layout import pieces
from lorafleet.memory.pool import PagePool
from lorafleet.memory.entry import AdapterEntry
from lorafleet.memory.residency import AdapterResidency, check_name

log = logging.getLogger("lorafleet.prefetch")

MAX_TICK_WAIT_S = 0.01  # `tick` waits when the typical load (copy) is this long at most, and never longer
TICK_WAIT_LOADS = 3.0  # the tick's deadline, in typical (median) loads or copies
PRIOR_LOAD_S = 0.005
PRIOR_COPY_S = 0.002
RECENT = 16  # loads (and copies) whose median is the typical time


@dataclass
class TickResult:
    loaded: list[str] = field(default_factory=list)                    # became ready on the device
    failed: dict[AdapterEntry, str] = field(default_factory=dict)      # why its load failed


class Prefetcher:
    def __init__(self, residency: AdapterResidency, arbiter: Arbiter, workers: int = 2):
        self.residency = residency
        self.arbiter = arbiter  # pages for an adapter: room is the arbiter's to make
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="lorafleet-prefetch",
                                           initializer=_worker_start)
        device = residency.pool.tensor.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._fence = None  # CUDA event after the last step launched (`after`): copies into pages wait for it
        self._loading: list[AdapterEntry] = []
        self._copying: list[AdapterEntry] = []
        self._eager: dict[AdapterEntry, Future] = {}   # staged entry -> the caller's future
        self._result = TickResult()                    # harvested, not yet handed to a step
        self.load_s = PRIOR_LOAD_S                     # typical seconds of a disk load (median of recent)
        self.copy_s = PRIOR_COPY_S                     # of a host -> device copy
        self._recent_loads: deque = deque(maxlen=RECENT)
        self._recent_copies: deque = deque(maxlen=RECENT)

    @property
    def busy(self) -> bool:
        return bool(self._loading or self._copying or self._eager)

    @property
    def eager_pending(self) -> bool:
        return bool(self._eager)

    def after(self, fence) -> None:
        """Copies into pages from now on wait for `fence` (a CUDA event recorded after the step
        just launched, which may still write pages freed meanwhile: a dropped row's KV)."""
        self._fence = fence

    def tick(self, wanted: list[AdapterEntry], reserve_pages: int = 0) -> TickResult:
        """`wanted`: the adapters of the waiting requests, in queue order, without repeats.
        Returns what landed or failed since the last tick."""
        self.harvest()
        protect = set(wanted)
        self._want_in_order(wanted, protect, reserve_pages)
        loads = any(e in protect for e in self._loading)
        copies = any(e in protect for e in self._copying)
        typical = max(self.load_s if loads else 0.0, self.copy_s if copies else 0.0)
        if (loads or copies) and typical <= MAX_TICK_WAIT_S:
            deadline = time.monotonic() + min(MAX_TICK_WAIT_S, TICK_WAIT_LOADS * typical)
            while any(e in protect for e in self._loading + self._copying):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.wait_any(left)
                self.harvest()
                self._want_in_order(wanted, protect, reserve_pages)  # landed on the host only: pages now
        result, self._result = self._result, TickResult()
        return result

    def _want_in_order(self, wanted: list[AdapterEntry], protect: set[AdapterEntry], reserve_pages: int) -> None:
        for entry in wanted:
            if not self.want(entry, protect, reserve_pages):
                break  # no room now: pages go in queue order

    def want(self, entry: AdapterEntry, protect: Container[AdapterEntry] = frozenset(), reserve_pages: int = 0) -> bool:
        """Move `entry` toward the device (the module doc's step 2). False when it waits for pages."""
        if entry.ready or entry.loading or entry.copying or entry.error:
            return True
        r = self.residency
        try:
            if entry.host is not None:
                if not self.arbiter.place(entry, reserve=reserve_pages, protect=protect):
                    return False
                self._start_copy(entry)
                self._copying.append(entry)
                return True
            with_pages = entry.numel > 0 and self.arbiter.place(entry, reserve=reserve_pages, protect=protect)
        except AdapterTooLargeError as e:  # only its own requests fail
            r.load_failed(entry, str(e))
            self._result.failed[entry] = str(e)
            return True
        r.load_started(entry, self.executor.submit(_load, r, entry.name, entry.path, entry.pages if with_pages else None,
                                                   self.stream, entry.trusted_digest, after=self._fence))
        self._loading.append(entry)
        return True

    def load_eager(self, name: str, path: str | Path) -> Future:
        """Start an eager load of `name` from `path`; the future resolves (on the engine thread,
        at a later `harvest`) to the adapter's info once it serves, or to its refusal."""
        check_name(name)
        r = self.residency
        entry = r.stage(name, Path(path))
        r.load_started(entry, self.executor.submit(_load, r, entry.name, entry.path, None, self.stream, eager=True))
        done: Future = Future()
        done.set_running_or_notify_cancel()
        self._eager[entry] = done
        return done

    # -- harvesting ----------------------------------------------------------------------
    def harvest(self) -> None:
        r = self.residency
        for entry in [e for e in self._loading if e.loading is not None and e.loading.done()]:
            self._loading.remove(entry)
            assert entry.loading is not None  # every entry in _loading has its load's future
            try:
                host, seconds, _ = entry.loading.result()
            except Exception as e:  # an AdapterError names the problem; anything else is a bug
                r.load_failed(entry, _reason(e, entry))
                assert entry.error is not None  # load_failed set it
                self._result.failed[entry] = entry.error
                continue
            self._recent_loads.append(seconds)
            self.load_s = statistics.median(self._recent_loads)
            if r.loaded(entry, host, seconds):  # copied in the same task
                self._result.loaded.append(entry.name)
        for entry in [e for e in self._copying if e.copying is not None and e.copying.done()]:
            self._copying.remove(entry)
            assert entry.copying is not None  # every entry in _copying has its copy's future
            self._recent_copies.append(entry.copying.result())  # a failed copy into our pool is our bug: raise
            self.copy_s = statistics.median(self._recent_copies)
            r.copied(entry)
            self._result.loaded.append(entry.name)
        for entry, done in list(self._eager.items()):
            if entry.loading is not None and entry.loading.done():
                self._eager_loaded(entry, done)
            elif entry.copying is not None and entry.copying.done():
                entry.copying.result()
                r.copied(entry)
                r.install(entry)
                self._result.loaded.append(entry.name)
                del self._eager[entry]
                done.set_result(entry.info())

    def _eager_loaded(self, entry: AdapterEntry, done: Future) -> None:
        """An eager load read its files: refuse it, find the same weights already in, or give it
        pages (never the old weights' under its name: they serve until the swap) and copy."""
        r = self.residency
        assert entry.loading is not None  # harvest saw it done
        try:
            host, seconds, inspected = entry.loading.result()
        except Exception as e:  # noqa: BLE001
            r.load_failed(entry, _reason(e, entry))
            return self._eager_refused(entry, done, e if isinstance(e, AdapterError) else AdapterError(entry.error))
        r.loaded(entry, host, seconds, inspected)
        old = r.entries.get(entry.name)
        if old is not None and old.ready and old.path == entry.path and old.digest == entry.digest:
            self._eager_done(entry, done)
            return done.set_result(old.info())
        try:
            fits = self.arbiter.place(entry, protect={old} if old is not None else set())
        except AdapterTooLargeError as e:
            return self._eager_refused(entry, done, e)
        if not fits:
            pool = r.pool
            return self._eager_refused(entry, done, PoolExhaustedError(
                f"adapter {entry.name!r} needs {r.pages_needed(entry)} pages; {pool.num_free} of "
                f"{pool.num_pages} are free and running requests hold the rest; retry later"))
        self._start_copy(entry)

    def _start_copy(self, entry: AdapterEntry) -> None:
        """Host copy -> the pages `entry` was just given, on a worker."""
        r = self.residency
        assert entry.host is not None and entry.pages is not None  # loaded, and placed
        r.copy_started(entry, self.executor.submit(_timed_copy, r.pool, entry.host, entry.pages, self.stream,
                                                   self._fence))

    def _eager_refused(self, entry: AdapterEntry, done: Future, error: Exception) -> None:
        self._eager_done(entry, done)
        done.set_exception(error)

    def _eager_done(self, entry: AdapterEntry, done: Future) -> None:
        del self._eager[entry]
        self.residency.discard_staged(entry)

    # -- waiting -------------------------------------------------------------------------
    def wait_any(self, timeout: float) -> None:
        """Block until some in-flight load or copy finishes, or `timeout` seconds."""
        futures = [f for e in self._loading + self._copying + list(self._eager)
                   for f in (e.loading, e.copying) if f is not None]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block until in-flight loads and copies finish (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        for e in self._loading + self._copying + list(self._eager):
            for fut in (e.loading, e.copying):
                if isinstance(fut, Future):
                    fut.exception(timeout=max(0.0, deadline - time.monotonic()))

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        for done in self._eager.values():
            if not done.done():
                done.set_exception(ShuttingDownError("the engine stopped before the adapter was loaded"))
        self._eager.clear()


def _reason(e: Exception, entry: AdapterEntry) -> str:
    if isinstance(e, AdapterError):
        return str(e)
    log.error("loading adapter %s failed", entry.name, exc_info=e)
    return f"adapter {entry.name!r} could not be loaded ({type(e).__name__})"


# nice 10, not 19: a worker holds the GIL at times, and a low-priority thread descheduled holding it
# stalls the engine thread (priority inversion): 15 and 19 did, 10 and 12 did not
WORKER_NICE = 10


def _worker_start() -> None:
    """A worker yields the cores to the engine's steps (a load may take longer, a step must not; Linux
    nice is per thread) and runs its torch ops alone: a team of its own would cut the engine's OpenMP
    spinning short (`lorafleet/openmp.py`)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: normal priority
        pass
    openmp.serial_thread()


def _load(residency: AdapterResidency, name: str, path, pages: list[int] | None, stream,
          trusted_digest: str | None = None, eager: bool = False, after=None):
    """Worker: disk -> host (read, validate, hash, lay out; a stored adapter is only read:
    `AdapterEntry.trusted_digest`), and into `pages` when given. Returns (host, seconds, the inspection:
    an eager load's vocabulary, tokenizer and saved modules, its entry never registered; else None)."""
    t0 = time.perf_counter()
    pool = residency.pool
    inspected = None
    if trusted_digest is None:  # sizes from the header before any tensor is read (it may have changed since)
        inspected = residency.inspect(name, path, tokenizer=eager)
    host = host_cache.build_host_adapter(path, residency.base, pool.adapter_page_elems, pool.adapter_dtype,
                                         residency.pin_host, trusted_digest, residency.base_rows)
    if pages is not None:
        if host.layout.paged_numel(residency.itemsize) > len(pages) * pool.adapter_page_elems:
            raise AdapterError(f"{path}: the weights are larger than the file's header says")
        copy_in(pool, host, pages, stream, after)
    return host, time.perf_counter() - t0, inspected if eager else None


def _timed_copy(pool: PagePool, host: HostAdapter, pages: list[int], stream=None, after=None) -> float:
    """Worker: `copy_in`, returning its seconds."""
    t0 = time.perf_counter()
    copy_in(pool, host, pages, stream, after)
    return time.perf_counter() - t0


def copy_in(pool: PagePool, host: HostAdapter, pages: list[int], stream=None, after=None) -> None:
    """Worker: host buffer -> its (already allocated) device pages, then their row table
    (`Layout.row_table`). On CUDA the copies run on the side `stream`, after `after` (the fence: the
    last step launched may still write an ended request's KV into these pages), and are complete when
    this returns, so the adapter is marked ready only once its bytes landed."""
    layout = host.layout
    start, words, _ = layout.row_table(pages, pool.adapter_tensor.element_size())
    # pageable: an asynchronous copy from it is staged before it returns, and it is a few KB
    table = torch.from_numpy(words).view(pool.adapter_dtype)
    assert start + table.numel() <= len(pages) * pool.adapter_page_elems, "adapter larger than its pages"
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        if after is not None and stream is not None:
            stream.wait_event(after)
        _copy_logical(pool, pages, 0, host.buffer, stream is not None)
        _copy_logical(pool, pages, start, table, stream is not None)
    if stream is not None:
        stream.synchronize()


def _copy_logical(pool: PagePool, pages: list[int], o: int, src: torch.Tensor, non_blocking: bool) -> None:
    """src (flat) into the adapter's logical elements [o, o + len(src)): one copy per run of
    consecutive pages."""
    flat = pool.adapter_tensor.view(-1)
    for at, lo, n in pieces(pages, pool.adapter_page_elems, o, src.numel()):
        flat[at:at + n].copy_(src[lo:lo + n], non_blocking=non_blocking)
