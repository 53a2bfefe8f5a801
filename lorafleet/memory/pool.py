"""THE unified page pool: one tensor, allocated once at start-up, cut into equal pages that hold
either KV blocks or adapter weights.

Invariants (checked by `check_integrity()`, which tests run after every engine step):
- every page has exactly one owner: free, KV (held by one or more sequences' block tables),
  cached (a full KV block no sequence holds, kept for prefix reuse and evictable: `memory/kv.py`
  owns which), or one adapter;
- free + KV + cached + adapter pages == total pages, and the counters agree with the owner table;
- the tensor is never reallocated: its address is fixed for the life of the pool, whatever
  moves in or out of its pages, so captured CUDA graphs stay valid (`engine/graphs.py`);
- one extra row past the pages, `scratch_page`, is never allocated: padding rows of a captured
  decode step write their K/V there, harming no sequence.

Allocation is a predicate/action pair: `can_allocate(n)` then `allocate(n, owner)`; `allocate`
raises when the predicate was false. KV pages are taken from the low end (one at a time, as
sequences grow: a min-heap of free pages, no scan of the owner table) and adapter pages from the
high end (a scan: adapter loads are rare next to KV growth), so the two kinds rarely interleave.
Adapter pages need not be contiguous: every kernel reads an adapter through its page table, so
pages never fragment anything, and no page ever moves.

Adapters may be held narrower than the KV cache (`adapter_dtype`: bfloat16 or float16 in a float32
pool, the server's `--lora-dtype`): the same pages, seen through `adapter_tensor`, the pool's bytes
as that dtype (`adapter_page_elems` to a page). A view, not a second pool: one page budget for both
kinds, and the kernels read an adapter's rows as they always do, in half the bytes.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from lorafleet.errors import ConfigError, PoolExhaustedError
from lorafleet import hugepages
from lorafleet.model.loader import DTYPES
from lorafleet.snapshot import PageRun, PoolCounts

FREE = -1
CACHED = -2  # KV blocks kept for prefix reuse, held by no sequence (memory/kv.py)
KV = 0  # owner ids >= 1 are adapters (see `new_owner`)


def narrower(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The dtypes a pool of `dtype` may hold its adapters in: its own, and a 16-bit one under
    float32 (the kernels widen it in registers against fp32 activations)."""
    return (dtype, torch.bfloat16, torch.float16) if dtype == torch.float32 else (dtype,)


def lora_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """`--lora-dtype` (`EngineConfig.lora_dtype`) for a pool of `dtype`: auto is the pool's own."""
    want = dtype if name == "auto" else DTYPES[name]
    if want not in narrower(dtype):
        raise ConfigError(f"lora_dtype={name}: adapters are held in the model's dtype ({str(dtype)[6:]}), or in "
                          f"bfloat16 or float16 under a float32 model")
    return want


class PagePool:
    def __init__(self, num_pages: int, page_elems: int, dtype: torch.dtype, device: torch.device | str,
                 adapter_dtype: torch.dtype | None = None):
        if num_pages < 1 or page_elems < 1:
            raise ValueError("a pool needs at least one page of at least one element")
        adapter_dtype = adapter_dtype or dtype
        if adapter_dtype not in narrower(dtype):
            raise ValueError(f"a pool of {dtype} cannot hold adapters in {adapter_dtype} (`narrower`)")
        self.num_pages = num_pages
        self.page_elems = page_elems
        # zeros, not empty: on the CPU every page is touched (faulted in) now, not by the first
        # adapter copied into it, whose page faults would stall the steps running beside it.
        # One row more than the pages handed out: `scratch_page`, which no one owns, receives
        # what the padding rows of a fixed-shape (graph-captured) decode step write
        # On the CPU, on huge pages where the host has them (`hugepages`: the pages are scattered,
        # and a decode step reads many of them)
        device = torch.device(device)
        self.tensor = (hugepages.zeros(num_pages + 1, page_elems, dtype=dtype) if device.type == "cpu" else
                       torch.zeros(num_pages + 1, page_elems, dtype=dtype, device=device))  # [P + 1, E]
        self.scratch_page = num_pages
        self.adapter_tensor = self.tensor.view(adapter_dtype)  # [P + 1, adapter_page_elems]: the same bytes
        self.adapter_page_elems = self.adapter_tensor.shape[1]
        self._owner = np.full(num_pages, FREE, dtype=np.int64)  # page -> owner id
        self._owner_names: dict[int, str] = {KV: "kv", CACHED: "cached"}
        self._next_owner = KV + 1
        self._pages_by_owner: dict[int, int] = {KV: 0, CACHED: 0}
        self.num_free = num_pages
        self._free_heap = list(range(num_pages))  # a min-heap; entries may be stale (page taken)

    @property
    def page_bytes(self) -> int:
        return self.page_elems * self.tensor.element_size()

    @property
    def adapter_dtype(self) -> torch.dtype:
        return self.adapter_tensor.dtype

    @property
    def num_kv(self) -> int:
        return self._pages_by_owner[KV]

    @property
    def num_cached(self) -> int:
        return self._pages_by_owner[CACHED]

    def new_owner(self, label: str) -> int:
        """A new owner id (>= 1) for one adapter's pages; `label` (its name) is what stats show.
        Two owners may share a label: an adapter replaced while requests still use it."""
        oid = self._next_owner
        self._next_owner += 1
        self._owner_names[oid] = label
        self._pages_by_owner[oid] = 0
        return oid

    def forget_owner(self, oid: int) -> None:
        """The owner is gone for good (it holds no page)."""
        assert self._pages_by_owner[oid] == 0, f"owner {self._owner_names[oid]} forgotten with pages"
        del self._pages_by_owner[oid], self._owner_names[oid]

    # -- predicate / action -------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    def allocate(self, n: int, owner: int = KV) -> list[int]:
        """Take n free pages for `owner` (KV, or an id from `new_owner`)."""
        if not self.can_allocate(n):
            raise PoolExhaustedError(f"page pool: {n} pages requested, {self.num_free} free "
                                     f"of {self.num_pages}")
        if n == 0:
            return []
        if owner == KV:
            pages = self._lowest_free(n)
        else:
            pages = np.flatnonzero(self._owner == FREE)[-n:]
        self._owner[pages] = owner
        self._pages_by_owner[owner] += n
        self.num_free -= n
        return pages.tolist()

    def retag(self, pages: list[int], owner: int) -> None:
        """KV pages become cached (their last sequence let go of them) or cached pages KV again
        (a sequence reuses them): the only moves between owners without a free."""
        assert owner in (KV, CACHED)
        if not pages:
            return
        idx = np.asarray(pages, dtype=np.int64)
        other = CACHED if owner == KV else KV
        assert (self._owner[idx] == other).all(), f"retag of pages not owned by {self._owner_names[other]}"
        self._owner[idx] = owner
        self._pages_by_owner[other] -= len(idx)
        self._pages_by_owner[owner] += len(idx)

    def _lowest_free(self, n: int) -> np.ndarray:
        out: list[int]
        heap, owner, out = self._free_heap, self._owner, []
        while len(out) < n:
            p = heapq.heappop(heap)
            if owner[p] == FREE and (not out or out[-1] != p):  # skip stale and repeated entries
                out.append(p)
        return np.asarray(out, dtype=np.int64)

    def free(self, pages) -> None:
        """Give back `pages` (a list or an int array)."""
        if len(pages) == 0:
            return
        idx = np.asarray(pages, dtype=np.int64)
        owners = self._owner[idx]
        assert (owners != FREE).all(), f"double free of pages {idx[owners == FREE].tolist()}"
        assert len(np.unique(idx)) == len(idx), "page freed twice in one call"
        for oid, count in zip(*np.unique(owners, return_counts=True)):
            self._pages_by_owner[int(oid)] -= int(count)
        self._owner[idx] = FREE
        self.num_free += len(idx)
        if len(self._free_heap) + len(idx) > 2 * self.num_pages:  # too many stale entries: rebuild
            self._free_heap = np.flatnonzero(self._owner == FREE).tolist()  # sorted: a valid heap
        else:
            for p in idx.tolist():
                heapq.heappush(self._free_heap, p)

    # -- views & checks -----------------------------------------------------------------
    def pages_of(self, owner: int) -> np.ndarray:
        return np.flatnonzero(self._owner == owner)

    def owner_map(self) -> dict[int, list[int]]:
        """owner id -> its pages (sorted), every owner in one pass over the owner table."""
        order = np.argsort(self._owner, kind="stable")
        owners = self._owner[order]
        cuts = np.flatnonzero(np.diff(owners)) + 1
        return {int(group_owners[0]): pages.tolist()
                for group_owners, pages in zip(np.split(owners, cuts), np.split(order, cuts)) if len(pages)}

    def page_runs(self) -> list[PageRun]:
        """The pool in page order as runs of one owner: [[label, pages], ...], labels "free", "kv",
        "cached" or an adapter's name; the runs' pages sum to `num_pages`. What `lorafleet top`
        draws as its pool map (a fragmented pool has many short runs)."""
        starts = np.concatenate(([0], np.flatnonzero(np.diff(self._owner)) + 1))
        lengths = np.diff(np.concatenate((starts, [self.num_pages])))
        names = {FREE: "free", **self._owner_names}
        return [(names[o], n) for o, n in zip(self._owner[starts].tolist(), lengths.tolist())]

    def check_integrity(self) -> None:
        counts = dict(zip(*np.unique(self._owner, return_counts=True)))
        free = int(counts.pop(FREE, 0))
        assert free == self.num_free, f"free counter {self.num_free} != {free} free pages"
        for oid, n in self._pages_by_owner.items():
            assert int(counts.pop(oid, 0)) == n, f"owner {self._owner_names[oid]}: counter {n} wrong"
        assert not counts, f"pages owned by unknown owners {counts}"
        assert free + sum(self._pages_by_owner.values()) == self.num_pages
        assert set(np.flatnonzero(self._owner == FREE).tolist()) <= set(self._free_heap), \
            "a free page is missing from the free heap"

    def stats(self) -> PoolCounts:
        adapters: dict[str, int] = {}
        for o, n in self._pages_by_owner.items():
            if o > KV and n:
                label = self._owner_names[o]
                adapters[label] = adapters.get(label, 0) + n
        return {
            "total_pages": self.num_pages, "page_bytes": self.page_bytes,
            "free_pages": self.num_free, "kv_pages": self.num_kv, "cached_pages": self.num_cached,
            "adapter_pages": sum(adapters.values()), "pages_by_adapter": adapters,
            "adapter_dtype": str(self.adapter_dtype).removeprefix("torch."),
        }
