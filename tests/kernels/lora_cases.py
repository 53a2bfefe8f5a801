"""Random LoRA cases for the kernel tests: adapters laid out by the engine's own `Layout`, their
pages shuffled across a pool, their row tables built for those pages, with the expected output
computed from the dense matrices, independently of any layout or row table."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lorafleet.kernels.reference import SEG_FIELDS, lora_entry, scale_bits
from lorafleet.adapters.adapter import BaseShapes, LoraAdapter, LoraWeights
from lorafleet.adapters.batch import GROUP_INDEX, GROUPS, MODULE_SLOTS, group_shapes
from lorafleet.adapters.layout import Layout, pieces

GROUP_OF_SLOTS = {3: "qkv", 2: "gate_up", 1: "o"}  # the group a case's module count stands for


@dataclass
class LoraCase:
    x: torch.Tensor         # [T, in]
    base: torch.Tensor      # [T, N] the output before the op
    expected: torch.Tensor  # [T, N] base + every segment's delta, from the dense matrices
    w: torch.Tensor         # the flat pool
    seg: torch.Tensor       # [S, SEG_FIELDS]
    entry: int
    slots: int
    covered: torch.Tensor   # [T] bool: rows in some segment
    page_elems: int
    out_align: int          # `group_shapes`' alignment of the case's group: divides its widths and columns

    def args(self, out: torch.Tensor):
        return (self.x, out, self.w, self.seg, self.entry, self.slots)


def _base(fan_in: int, outs: list[int], layers: int) -> BaseShapes:
    """A base whose group for len(outs) slots has these outputs (the other modules: small)."""
    group = GROUPS[GROUP_OF_SLOTS[len(outs)]]
    features = {m: (16, 16) for modules in GROUPS.values() for m in modules}
    features.update({m: (fan_in, o) for m, o in zip(group, outs)})
    return BaseShapes(layers, features)


def lora_case(seed: int, fan_in: int, outs: list[int], ranks: list[list[int]], rows: list[int],
              page_elems: int = 1024, dtype: torch.dtype = torch.float32, gaps: bool = True,
              pad_cols: int = 0, device: str = "cpu", layers: int = 2, layer: int = 1,
              scale: float = 0.5, mixes: list[list[tuple[int, float]]] | None = None,
              posts: list[str | None] | None = None, held: torch.dtype | None = None) -> LoraCase:
    """Segment s has rows[s] rows (0: empty) and its own adapter with module ranks ranks[s] (0:
    module not targeted) in layer `layer` of `layers`. Pool elements no adapter uses are NaN, so
    a stray read shows. With `pad_cols`, x and the output are row-strided views into wider tensors.
    With `mixes`, adapter i has ranks[i] and the rows are mixes instead: mix s has rows[s] rows
    and the adapters (index, scale) of mixes[s] (the request's scales, besides each adapter's own
    `scale`), one segment each. `posts[i]`: adapter i's modules get an epilogue, "bias" (a
    lora_B bias: + scale * bias) or "dora" (the raw magnitude m as g, c = 0: m * (out + delta)),
    read on lone segments only. `held`: the adapters' dtype in the pool (`PagePool.adapter_dtype`:
    16-bit under float32 x), else `dtype`; `page_elems` counts its elements."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    group = GROUP_OF_SLOTS[len(outs)]
    base = _base(fan_in, outs, layers)
    cols = np.concatenate([[0], np.cumsum(outs)[:-1]]).tolist()
    wd = held or dtype
    itemsize = torch.empty(0, dtype=wd).element_size()
    layouts, buffers, dense, segs, row = [], [], [], [], 0
    for seg_ranks, n in zip(ranks, rows if mixes is None else [0] * len(ranks)):
        if gaps and mixes is None:
            row += rng.randint(0, 2)  # rows in no segment: must stay untouched
        weights, mods = {}, []
        post = posts[len(layouts)] if posts is not None else None
        for j, r in enumerate(seg_ranks):
            a = torch.randn(r, fan_in, generator=g) / fan_in ** 0.5
            b = torch.randn(outs[j], r, generator=g)
            vec = (torch.rand(outs[j], generator=g) + 0.5).to(wd).float()
            if r:
                weights[(layer, GROUPS[group][j])] = LoraWeights(
                    a.to(wd).float(), b.to(wd).float(), scale, magnitude=vec if post == "dora" else None,
                    bias=vec if post == "bias" else None)
                gc = ((vec.double(), 0.0) if post == "dora" else (1.0, (scale * vec).to(wd).double())
                      if post == "bias" else None)
                mods.append((cols[j], a.to(wd).double(), (scale * b.to(wd).double()).t(), gc))
        adapter = LoraAdapter(Path("."), f"case{len(layouts)}", {}, weights)
        layout = Layout.of(adapter, base, page_elems)
        buf = torch.zeros(layout.numel)
        layout.fill(buf, adapter)
        layouts.append(layout)
        buffers.append(buf.to(wd))
        dense.append(mods)
        segs.append([(row, row + n, len(layouts) - 1, 1.0)])
        row += n
    if mixes is not None:
        segs = []
        for mix, n in zip(mixes, rows):
            if gaps:
                row += rng.randint(0, 2)
            segs.append([(row, row + n, i, s) for i, s in mix])
            row += n
    total = row + 2
    # the pool: each adapter's logical pages spread over shuffled pool pages
    need = [-(-lay.paged_numel(itemsize) // page_elems) for lay in layouts]
    num_pages = sum(need) + 3
    perm = list(range(num_pages))
    rng.shuffle(perm)
    w = torch.full((num_pages, page_elems), float("nan"), dtype=wd)
    tables, at = [], 0
    for layout, buf, k in zip(layouts, buffers, need):
        pages = perm[at:at + k]
        at += k
        start, words, table = layout.row_table(pages, itemsize)
        flat = w.view(-1)
        for o, src in ((0, buf), (start, torch.from_numpy(words).view(wd))):
            for to, lo, n in pieces(pages, page_elems, o, src.numel()):
                flat[to:to + n] = src[lo:lo + n]
        tables.append(table)
    x_wide = torch.randn(total, fan_in + pad_cols, generator=g)
    base_wide = torch.randn(total, sum(outs) + 2 * pad_cols, generator=g)
    x, out0 = x_wide[:, pad_cols:], base_wide[:, pad_cols:pad_cols + sum(outs)]
    expected = out0.to(dtype).double()
    covered = torch.zeros(total, dtype=torch.bool)
    xd = x.to(dtype).double()
    for mix in segs:
        for start, end, i, s in mix:
            covered[start:end] = True
            for col, a, bt, gc in dense[i]:
                o = expected[start:end, col:col + bt.shape[1]]
                o += s * (xd[start:end] @ a.t()) @ bt
                if gc is not None and len(mix) == 1:  # an epilogue: on lone segments only
                    o.copy_(gc[0] * o + gc[1])
    seg = torch.tensor([(start, end, tables[i], scale_bits(s), len(mix) if j == 0 else -j)
                        for mix in segs for j, (start, end, i, s) in enumerate(mix)],
                       dtype=torch.long).reshape(-1, SEG_FIELDS)

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    return LoraCase(put(x_wide)[:, pad_cols:], put(base_wide)[:, pad_cols:pad_cols + sum(outs)], put(expected),
                    w.view(-1).to(device), put(seg), lora_entry(layer, GROUP_INDEX[group], len(GROUPS), MODULE_SLOTS),
                    len(outs), covered.to(device), page_elems, group_shapes(base.features)[group][1])
