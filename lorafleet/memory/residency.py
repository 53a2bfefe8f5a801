"""Adapters resident in the unified pool: their pages, reference counts, and the views the
LoRA op reads.

An adapter is serialised into one flat buffer laid over its pages, per layer and projection
group (see `lora/batch.py`): the A matrices of a group's targeted modules back to back (so the
group's shrink is one matmul over one [sum r, in] view), then each module's B, pre-multiplied by
the adapter's scale. Pages are in proportion to the adapter's size (so to its rank): no padding
to a maximum rank. When the pool gives a contiguous run (the usual case), every view is a
zero-copy slice of the pool tensor, fixed for the adapter's life; scattered pages are gathered
into one buffer per step instead (correct, slower; counted in stats).

Invariants (`check_integrity`): an adapter's pages are exactly the pool pages its owner id
holds; an adapter with references (unfinished requests) is never unloaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from lorafleet.errors import AdapterError, AdapterInUseError, AdapterNotFoundError, PoolExhaustedError
from lorafleet.lora.adapter import BaseShapes, LoraAdapter, load_adapter
from lorafleet.kernels.lora_cpu import META_FIELDS
from lorafleet.lora.batch import GROUP_INDEX, GROUPS
from lorafleet.memory.pool import PagePool

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")

# views[layer][group] = (A stacked [sum r, in], [(output column, row offset in A, Bt [r, out])])
GroupView = tuple[torch.Tensor, list[tuple[int, int, torch.Tensor]]]


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name) or ".." in name:
        raise AdapterError(f"adapter name {name!r} is invalid: use 1-128 letters, digits and . _ - : @ /,"
                           " starting with a letter or digit, without '..'")
    return name


@dataclass
class Layout:
    """Where each tensor sits in the flat buffer: (layer, group) -> (a_offset, a_rows, in,
    [(module slot j, output column, row offset in A, bt_offset, out, r)]). A is [rows, in]
    row-major; each Bt = (scale * B)^T is [r, out] row-major."""

    entries: dict[tuple[int, str], tuple[int, int, int, list[tuple[int, int, int, int, int, int]]]]
    numel: int

    @classmethod
    def of(cls, adapter: LoraAdapter, base: BaseShapes) -> Layout:
        entries, off = {}, 0
        for layer in range(base.num_layers):
            for group, modules in GROUPS.items():
                cols = [0]
                for m in modules:
                    cols.append(cols[-1] + base.features[m][1])
                present = [(j, adapter.weights[(layer, m)]) for j, m in enumerate(modules)
                           if (layer, m) in adapter.weights]
                if not present:
                    continue
                fan_in = present[0][1].a.shape[1]
                a_off, rows = off, sum(w.rank for _, w in present)
                off += rows * fan_in
                bs, row = [], 0
                for j, w in present:
                    bs.append((j, cols[j], row, off, w.b.shape[0], w.rank))
                    off += w.b.numel()
                    row += w.rank
                entries[(layer, group)] = (a_off, rows, fan_in, bs)
        return cls(entries, off)

    def fill(self, buf: torch.Tensor, adapter: LoraAdapter) -> None:
        """Write the adapter's tensors into `buf` (flat) at their offsets, B scaled, transposed."""
        for (layer, group), (a_off, rows, fan_in, bs) in self.entries.items():
            modules = GROUPS[group]
            for j, _, row, b_off, out, r in bs:
                w = adapter.weights[(layer, modules[j])]
                buf[a_off + row * fan_in: a_off + (row + r) * fan_in].copy_(w.a.reshape(-1))
                buf[b_off: b_off + out * r].view(r, out).copy_((w.b * w.scale).t())

    def views(self, buf: torch.Tensor, num_layers: int) -> list[dict[str, GroupView]]:
        out: list[dict[str, GroupView]] = [{} for _ in range(num_layers)]
        for (layer, group), (a_off, rows, fan_in, bs) in self.entries.items():
            a = buf[a_off: a_off + rows * fan_in].view(rows, fan_in)
            out[layer][group] = (a, [(col, row, buf[b_off: b_off + r * o].view(r, o))
                                     for _, col, row, b_off, o, r in bs])
        return out

    def kernel_meta(self, base_offset: int, num_layers: int) -> np.ndarray:
        """[layers, groups, 3 slots, META_FIELDS] int64 for the CPU kernel, offsets absolute in
        the pool's flat tensor; rank 0 marks a module the adapter does not target."""
        meta = np.zeros((num_layers, len(GROUPS), 3, META_FIELDS), dtype=np.int64)
        for (layer, group), (a_off, _, fan_in, bs) in self.entries.items():
            g = GROUP_INDEX[group]
            for j, col, row, b_off, o, r in bs:
                meta[layer, g, j] = (base_offset + a_off + row * fan_in, r, base_offset + b_off, o, col)
        return meta


@dataclass(eq=False)
class ResidentAdapter:
    name: str
    path: Path
    digest: str
    ranks: dict[str, int]          # module -> max rank over layers
    modules: tuple[str, ...]
    num_params: int
    pages: list[int]
    layout: Layout
    views: list[dict[str, GroupView]] | None  # None when pages are scattered
    kernel_meta: np.ndarray | None  # CPU kernel offsets; None when scattered
    refcount: int = 0
    hits: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def contiguous(self) -> bool:
        return self.views is not None

    def info(self) -> dict:
        return {"name": self.name, "path": str(self.path), "digest": self.digest,
                "ranks": self.ranks, "modules": list(self.modules), "params": self.num_params,
                "pages": len(self.pages), "contiguous": self.contiguous, "refcount": self.refcount}


class AdapterResidency:
    def __init__(self, pool: PagePool, base: BaseShapes):
        self.pool = pool
        self.base = base
        self.adapters: dict[str, ResidentAdapter] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    def get(self, name: str) -> ResidentAdapter:
        try:
            return self.adapters[name]
        except KeyError:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded") from None

    def load(self, name: str, path: str | Path) -> ResidentAdapter:
        """Parse, validate and copy an adapter into pool pages. A refused adapter changes
        nothing; loading a name again with the same content is a no-op, with new content it
        replaces the old one (only while no request uses it)."""
        check_name(name)
        adapter = load_adapter(path, self.base, dtype=self.pool.tensor.dtype)
        old = self.adapters.get(name)
        if old is not None:
            if old.digest == adapter.digest:
                return old
            if old.refcount:
                raise AdapterInUseError(f"adapter {name!r} is used by {old.refcount} request(s); "
                                        "it cannot be replaced now")
        layout = Layout.of(adapter, self.base)
        n = -(-layout.numel // self.pool.page_elems)
        if not self.pool.can_allocate(n):
            raise PoolExhaustedError(f"adapter {name!r} needs {n} pages, the pool has "
                                     f"{self.pool.num_free} free of {self.pool.num_pages}")
        if old is not None:
            self.unload(name)
        pages = self.pool.allocate(n, self.pool.owner_id(name))
        contiguous = pages == list(range(pages[0], pages[0] + n))
        if contiguous:
            buf = self.pool.tensor[pages[0]:pages[0] + n].view(-1)
            layout.fill(buf, adapter)
        else:
            buf = self.pool.tensor.new_empty(n * self.pool.page_elems)
            layout.fill(buf, adapter)
            self.pool.tensor[pages] = buf.view(n, -1)
        ranks: dict[str, int] = {}
        for (_, m), w in adapter.weights.items():
            ranks[m] = max(ranks.get(m, 0), w.rank)
        resident = ResidentAdapter(
            name=name, path=Path(path), digest=adapter.digest, ranks=ranks,
            modules=tuple(sorted(ranks)), num_params=adapter.num_params, pages=pages, layout=layout,
            views=layout.views(buf, self.base.num_layers) if contiguous else None,
            kernel_meta=layout.kernel_meta(pages[0] * self.pool.page_elems, self.base.num_layers)
            if contiguous else None)
        self.adapters[name] = resident
        return resident

    def unload(self, name: str) -> None:
        resident = self.get(name)
        if resident.refcount:
            raise AdapterInUseError(f"adapter {name!r} is used by {resident.refcount} request(s); "
                                    "unload it when they finish")
        del self.adapters[name]
        self.pool.free(resident.pages)

    def acquire(self, name: str) -> ResidentAdapter:
        resident = self.get(name)
        resident.refcount += 1
        return resident

    def release(self, name: str) -> None:
        resident = self.adapters[name]
        assert resident.refcount > 0, f"adapter {name!r} released more often than acquired"
        resident.refcount -= 1

    def step_views(self, resident: ResidentAdapter) -> list[dict[str, GroupView]]:
        """The views for this step: the cached zero-copy ones, or a gather of scattered pages."""
        if resident.views is not None:
            return resident.views
        buf = self.pool.tensor[resident.pages].view(-1)
        return resident.layout.views(buf, self.base.num_layers)

    def check_integrity(self) -> None:
        for name, r in self.adapters.items():
            owned = self.pool.pages_of(self.pool.owner_id(name)).tolist()
            assert sorted(r.pages) == owned, f"adapter {name!r}: pages disagree with the pool"
            assert r.refcount >= 0

    def stats(self) -> dict:
        return {name: r.info() for name, r in self.adapters.items()}
