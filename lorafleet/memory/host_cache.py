"""The host tier: adapters parsed, validated and laid out in host memory (pinned on CUDA), ready
for one copy into pool pages. Bounded by a byte budget, least recently used out first.

Building a `HostAdapter` reads and checks the files (disk -> host); it runs on the prefetcher's
worker threads, never on the engine thread.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, Hashable, TypeVar

import torch

from lorafleet.errors import AdapterError
from lorafleet.adapters.adapter import BaseShapes, load_adapter
from lorafleet.adapters.finish import drop_base_copies, finish_dora, relaid
from lorafleet.adapters.layout import LAYOUT_FILE, Layout, read_saved


@dataclass(eq=False)
class HostAdapter:
    digest: str
    layout: Layout
    buffer: torch.Tensor          # flat [layout.numel] (the weights, rows in place), the pool's dtype
    ranks: dict[str, int]         # module -> max rank over layers
    num_params: int

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def build_host_adapter(path: Path, base: BaseShapes, page_elems: int, dtype: torch.dtype, pin: bool,
                       trusted_digest: str | None = None, base_rows=None) -> HostAdapter:
    """Disk -> host: parse and validate (AdapterError on any problem), lay out for pages of
    `page_elems`, done. With
    `trusted_digest` (a stored adapter, validated, hashed and laid out when it was pulled) the
    saved layout is memory-mapped instead (`adapters.layout.read_saved`): on the CPU at float32
    the host copy is that mapping (the page cache's pages, no copy at all). Either way the
    buffer is laid out at float32 and rounded to `dtype` once, so both give the same bits.
    A DoRA adapter's epilogue is computed here, against the base's weights (`base_rows`, the
    engine's: `adapters.finish`), once per load, and saved copies of the embedding or LM head
    that equal the base's are dropped (`adapters.finish.drop_base_copies`)."""
    saved = read_saved(Path(path) / LAYOUT_FILE, trusted_digest, base, page_elems) if trusted_digest else None
    if saved is not None:
        assert trusted_digest is not None  # read_saved was given it
        layout, buffer, ranks = saved
        if layout.page_elems != page_elems:  # saved for float32's pages, held in 16 bits here
            layout, buffer = relaid(layout, buffer, page_elems, base)
        if "dora" in layout.posts.values():
            buffer = _dora(layout, buffer.clone(), base_rows, path)  # the mapping is read only
        layout, buffer = _drop_copies(layout, buffer, base_rows, base)
        return HostAdapter(trusted_digest, layout, _host_copy(buffer, dtype, pin), ranks, layout.numel)
    adapter = load_adapter(path, base)  # float32: laid out at float32, as stored adapters are
    layout = Layout.of(adapter, base, page_elems)
    buffer = torch.zeros(layout.numel, dtype=torch.float32)  # the gaps between rows: zeros, as saved
    layout.fill(buffer, adapter)
    if "dora" in layout.posts.values():
        buffer = _dora(layout, buffer, base_rows, path)
    layout, buffer = _drop_copies(layout, buffer, base_rows, base)
    return HostAdapter(adapter.digest, layout, _host_copy(buffer, dtype, pin), adapter.ranks, adapter.num_params)


def _drop_copies(layout: Layout, buffer: torch.Tensor, base_rows, base: BaseShapes):
    if base_rows is None:
        return layout, buffer
    return drop_base_copies(layout, buffer, base_rows, base.vocab_size)


def _dora(layout: Layout, buffer: torch.Tensor, base_rows, path) -> torch.Tensor:
    if base_rows is None:
        raise AdapterError(f"{path}: a DoRA adapter needs its base's weights to load (none given here)")
    finish_dora(layout, buffer, base_rows)
    return buffer


def _host_copy(buffer: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """`buffer` (float32) as the host tier keeps it: itself at float32 unpinned, else one copy
    at `dtype` (rounded once), pinned for the device's asynchronous copies when `pin`."""
    if dtype == torch.float32 and not pin:
        return buffer
    out = torch.empty(buffer.numel(), dtype=dtype, pin_memory=pin)
    out.copy_(buffer)
    return out


K = TypeVar("K", bound=Hashable)  # what the cache is keyed by (the residency's entries)


class HostCache(Generic[K]):
    """key (an adapter's registry entry) -> HostAdapter, LRU, at most `capacity` bytes (one
    adapter larger than the budget is still kept while it is the only one: it must pass through
    to reach the device). Keys are entries, not names: a name replaced by new weights may have
    its old and new copies here at once."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[K, HostAdapter] = OrderedDict()
        self.nbytes = 0

    def __contains__(self, key: K) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: K, item: HostAdapter, evictable: Callable[[K], bool] = lambda k: True) -> list[K]:
        """Insert; evict least recently used entries for which `evictable(key)` holds while over
        budget. Returns the keys evicted."""
        self.drop(key)
        self._items[key] = item
        self.nbytes += item.nbytes
        evicted = []
        for victim in list(self._items):
            if self.nbytes <= self.capacity:
                break
            if victim is not key and evictable(victim):
                self.drop(victim)
                evicted.append(victim)
        return evicted

    def drop(self, key: K) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self.nbytes -= item.nbytes
