"""The host tier: adapters parsed, validated and laid out in host memory (pinned on CUDA), ready
for one copy into pool pages. Bounded by a byte budget, least recently used out first.

Building a `HostAdapter` reads and checks the files (disk -> host); it runs on the prefetcher's
worker threads, never on the engine thread.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Hashable

import torch

from lorafleet.lora.adapter import BaseShapes, load_adapter, load_trusted
from lorafleet.memory.layout import Layout


@dataclass(eq=False)
class HostAdapter:
    digest: str
    layout: Layout
    buffer: torch.Tensor          # flat [layout.numel], the pool's dtype
    ranks: dict[str, int]         # module -> max rank over layers
    num_params: int

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def build_host_adapter(path: Path, base: BaseShapes, dtype: torch.dtype, pin: bool,
                       trusted_digest: str | None = None) -> HostAdapter:
    """Disk -> host: parse and validate (AdapterError on any problem), lay out, done. With
    `trusted_digest` (a stored adapter, validated and hashed when it was pulled) the tensors are
    read without checks or hashing."""
    adapter = (load_trusted(path, base, trusted_digest, dtype=dtype) if trusted_digest
               else load_adapter(path, base, dtype=dtype))
    layout = Layout.of(adapter, base)
    buffer = torch.empty(layout.numel, dtype=dtype, pin_memory=pin)
    layout.fill(buffer, adapter)
    ranks: dict[str, int] = {}
    for (_, module), w in adapter.weights.items():
        ranks[module] = max(ranks.get(module, 0), w.rank)
    return HostAdapter(adapter.digest, layout, buffer, ranks, adapter.num_params)


class HostCache:
    """key (an adapter's registry entry) -> HostAdapter, LRU, at most `capacity` bytes (one
    adapter larger than the budget is still kept while it is the only one: it must pass through
    to reach the device). Keys are entries, not names: a name replaced by new weights may have
    its old and new copies here at once."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[Hashable, HostAdapter] = OrderedDict()
        self.nbytes = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: Hashable, item: HostAdapter, evictable: Callable[[Hashable], bool] = lambda k: True) -> list:
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

    def drop(self, key: Hashable) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self.nbytes -= item.nbytes
