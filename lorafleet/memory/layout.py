"""How an adapter is laid out as one flat buffer, in host memory and in pool pages.

Per layer and projection group (see `lora/batch.py`): the A matrices of the group's targeted
modules back to back, then each module's Bt = (scale * B)^T, [r, out] (the expand reads rows of
Bt: long contiguous loops). Offsets are logical (from the buffer's start): in the pool the
buffer is cut into pages that may lie anywhere, and every kernel finds element o in page
o // page_elems of the adapter's page table (the contract in `kernels/reference.py`). So the
host copy is one flat buffer (one copy per page moves it in) and the kernels' metadata is fixed
for the adapter's life, wherever its pages are.

The store keeps each adapter's buffer laid out once, at pull (`save` / `read_saved`: the file
`LAYOUT_FILE` beside the PEFT files, a safetensors file of one float32 tensor, the layout's
entries and the adapter's ranks in its metadata). Loading a stored adapter is then a memory map
and one copy into pages: no tensor is parsed, checked, hashed, scaled or transposed again. The
buffer is float32 whatever the pool's dtype (the copy into a bf16 or fp16 pool rounds once, as a
checked load does: `memory.host_cache`); a file of another `LAYOUT_VERSION` is not read (the
adapter then loads as any folder does).
"""

from __future__ import annotations

import json
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lorafleet.kernels.reference import META_FIELDS
from lorafleet.lora.adapter import BaseShapes, LoraAdapter
from lorafleet.lora.batch import GROUP_INDEX, GROUPS, MODULE_SLOTS

LAYOUT_FILE = "lorafleet-layout.safetensors"
LAYOUT_VERSION = "1"  # bump when the buffer's arrangement or this file's form changes


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

    def targets(self) -> set[tuple[int, str]]:
        """The (layer, module) pairs the adapter has weights for."""
        return {(layer, GROUPS[group][j]) for (layer, group), (*_, bs) in self.entries.items() for j, *_ in bs}

    def kernel_meta(self, num_layers: int) -> np.ndarray:
        """[layers, groups, slots, META_FIELDS] int64: (a_off, r, b_off, n_out, col) per module
        slot, offsets logical in the adapter's buffer; rank 0 marks a module it does not target."""
        meta = np.zeros((num_layers, len(GROUPS), MODULE_SLOTS, META_FIELDS), dtype=np.int64)
        for (layer, group), (a_off, _, fan_in, bs) in self.entries.items():
            g = GROUP_INDEX[group]
            for j, col, row, b_off, o, r in bs:
                meta[layer, g, j] = (a_off + row * fan_in, r, b_off, o, col)
        return meta


def save(path: Path, adapter: LoraAdapter, base: BaseShapes) -> None:
    """Write `adapter` (validated: `load_adapter`) laid out, float32, as the file `path`."""
    layout = Layout.of(adapter, base)
    buf = torch.empty(layout.numel, dtype=torch.float32)
    layout.fill(buf, adapter)
    entries = [[layer, group, *head, bs] for (layer, group), (*head, bs) in layout.entries.items()]
    meta = {"format": "lorafleet-layout", "version": LAYOUT_VERSION, "digest": adapter.digest,
            "entries": json.dumps(entries, separators=(",", ":")), "ranks": json.dumps(adapter.ranks, sort_keys=True)}
    header = json.dumps({"__metadata__": meta, "layout": {"dtype": "F32", "shape": [layout.numel],
                                                          "data_offsets": [0, 4 * layout.numel]}},
                        sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # safetensors' alignment of the data
    # Written here rather than by safetensors' save_file, whose header order varies from call to
    # call: the same adapter must give the same bytes (one blob, one snapshot in the store).
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        buf.numpy().tofile(f)


def read_saved(path: Path, digest: str) -> tuple[Layout, torch.Tensor, dict[str, int]] | None:
    """The layout, the float32 buffer (a read-only view of the memory-mapped file: nothing is
    read until it is copied) and the ranks saved at `path` for the adapter of `digest`; None
    when there is no such file, or it was written by another layout version or for other
    weights. The file is the store's (written by `save` at pull, read-only since): trusted."""
    try:
        mapped = np.memmap(path, mode="r")
    except (FileNotFoundError, ValueError):  # ValueError: an empty file
        return None
    (n,) = struct.unpack("<Q", mapped[:8].tobytes())
    header = json.loads(mapped[8:8 + n].tobytes())
    meta = header.get("__metadata__", {})
    if meta.get("version") != LAYOUT_VERSION or meta.get("digest") != digest:
        return None
    start, end = header["layout"]["data_offsets"]
    with warnings.catch_warnings():  # read-only memory: the buffer is only copied from
        warnings.simplefilter("ignore", UserWarning)
        buf = torch.from_numpy(mapped[8 + n + start: 8 + n + end]).view(torch.float32)
    entries = {(layer, group): (a_off, rows, fan_in, [tuple(b) for b in bs])
               for layer, group, a_off, rows, fan_in, bs in json.loads(meta["entries"])}
    return Layout(entries, buf.numel()), buf, json.loads(meta["ranks"])
