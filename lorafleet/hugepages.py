"""Host tensors on transparent huge pages: the memory every decode step streams on the CPU (the
model's weights, `place`) and the unified page pool (`zeros`).

Why: a decode step at small batch reads every weight once, at the memory bound. On
4 KiB pages a model's weights span far more pages than the second-level TLB holds, so a step's
stream is also a page walk per page, and the software prefetches of the matmul kernel wait on
them; 2 MiB pages hold the same weights in 512 times fewer. The CPU matmuls and a streaming read
both measured faster on huge pages (`bench.lora_decode.measure_bandwidth` reads huge pages too,
so the decode bound is the machine's best).

How: an anonymous private mapping, advised MADV_HUGEPAGE before anything touches it, seen by
torch through `torch.frombuffer` (the tensor holds the mapping: it lives as long as any view of
it). Linux backs its 2 MiB-aligned extents with huge pages where transparent huge pages are
"always" or "madvise" and free huge pages can be had; elsewhere the same memory stays on 4 KiB
pages. Contents and semantics never change, only the speed: where there is no MADV_HUGEPAGE
(not Linux), for a tensor smaller than one huge page, or with LORAFLEET_HUGE_PAGES=0 (to
measure without), these are plain torch allocations. CUDA memory is not the host's: callers use
this for CPU tensors only.
"""

from __future__ import annotations

import math
import mmap
import os

import torch

ENV = "LORAFLEET_HUGE_PAGES"
HUGE_PAGE = 2 << 20
ALIGN = 64  # each placed tensor starts on a cache line


def enabled() -> bool:
    """Whether host tensors are asked for huge pages (Linux has MADV_HUGEPAGE; not turned off)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get(ENV, "1") != "0"


def _bytes(nbytes: int) -> torch.Tensor:
    """nbytes of untouched host memory (uint8), advised onto huge pages where `enabled()`."""
    if not enabled() or nbytes < HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: page faults then take huge pages
    return torch.frombuffer(m, dtype=torch.uint8)  # keeps `m` alive


def empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty(*shape, dtype=dtype)` on the CPU, on huge pages where they can be had (taken
    as the first write touches each page)."""
    return _bytes(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)


def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """`torch.zeros(*shape, dtype=dtype)` likewise (every page touched now, by the zeroing)."""
    return empty(*shape, dtype=dtype).zero_()


def place(tensors: dict[str, torch.Tensor]) -> None:
    """Move every tensor of `tensors` (CPU tensors) into one huge-page buffer, in place: each
    value becomes a contiguous view of the buffer holding the same values, and names that share
    a tensor (a tied LM head) still share one. Tensors move one at a time and the dict's
    reference to each old one is dropped as it goes, so the extra memory is one tensor's, not
    the model's, where the dict held the last reference."""
    def key(t: torch.Tensor) -> tuple:  # one tensor however many names it has
        return t.data_ptr(), t.shape, t.stride(), t.dtype

    layout: dict[tuple, int] = {}  # a tensor -> its offset in the buffer
    total = 0
    for t in tensors.values():
        if key(t) not in layout:
            layout[key(t)] = total
            total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    buf = _bytes(total)
    moved: dict[tuple, torch.Tensor] = {}
    for name in list(tensors):
        t = tensors[name]
        k = key(t)
        if k not in moved:
            off, nbytes = layout[k], t.numel() * t.element_size()
            moved[k] = buf[off:off + nbytes].view(t.dtype).view(t.shape).copy_(t)
        tensors[name] = moved[k]
        del t
