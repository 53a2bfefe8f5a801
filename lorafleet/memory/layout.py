"""How an adapter is laid out as one flat buffer, in host memory and in pool pages.

Per layer and projection group (see `lora/batch.py`): the A matrices of the group's targeted
modules back to back, then each module's Bt = (scale * B)^T, [r, out] (the expand reads rows of
Bt: long contiguous loops). Offsets are logical (from the buffer's start): in the pool the
buffer is cut into pages that may lie anywhere, and every kernel finds element o in page
o // page_elems of the adapter's page table (the contract in `kernels/reference.py`). So the
host copy is one flat buffer (one copy per page moves it in) and the kernels' metadata is fixed
for the adapter's life, wherever its pages are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lorafleet.kernels.reference import META_FIELDS
from lorafleet.lora.adapter import BaseShapes, LoraAdapter
from lorafleet.lora.batch import GROUP_INDEX, GROUPS, MODULE_SLOTS


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
                torch.mul(w.b.t(), w.scale, out=buf[b_off: b_off + out * r].view(r, out))

    def kernel_meta(self, num_layers: int) -> np.ndarray:
        """[layers, groups, slots, META_FIELDS] int64: (a_off, r, b_off, n_out, col) per module
        slot, offsets logical in the adapter's buffer; rank 0 marks a module it does not target."""
        meta = np.zeros((num_layers, len(GROUPS), MODULE_SLOTS, META_FIELDS), dtype=np.int64)
        for (layer, group), (a_off, _, fan_in, bs) in self.entries.items():
            g = GROUP_INDEX[group]
            for j, col, row, b_off, o, r in bs:
                meta[layer, g, j] = (a_off + row * fan_in, r, b_off, o, col)
        return meta
