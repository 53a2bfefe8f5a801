"""How an adapter is laid out as one flat buffer, in host memory and in pool pages.

Per layer and projection group (see `lora/batch.py`): the A matrices of the group's targeted
modules back to back (so the group's shrink is one matmul over one [sum r, in] view), then each
module's Bt = (scale * B)^T, [r, out] (the expand reads rows of Bt: long contiguous loops). The
same layout serves the torch path (views), the CPU kernel (element offsets) and the host cache
(one copy into pages moves the whole adapter).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lorafleet.kernels.lora_cpu import META_FIELDS
from lorafleet.lora.adapter import BaseShapes, LoraAdapter
from lorafleet.lora.batch import GROUP_INDEX, GROUPS

# views[layer][group] = (A stacked [sum r, in], [(output column, row offset in A, Bt [r, out])])
GroupView = tuple[torch.Tensor, list[tuple[int, int, torch.Tensor]]]


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
