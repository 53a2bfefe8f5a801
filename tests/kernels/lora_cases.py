"""Random page-addressed LoRA cases for the kernel tests: adapters written into a pool through
shuffled page tables (tensors straddle page boundaries), with the expected output computed
from the dense matrices, independently of any page addressing."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from lorafleet.kernels.reference import META_FIELDS


@dataclass
class LoraCase:
    x: torch.Tensor        # [T, in]
    base: torch.Tensor     # [T, N] the output before the op
    expected: torch.Tensor  # [T, N] base + every segment's delta, from the dense matrices
    w: torch.Tensor        # the flat pool
    page_elems: int
    seg: torch.Tensor      # [S, 2]
    meta: torch.Tensor     # [S, 3, 5]
    tables: torch.Tensor   # [S, maxp]
    covered: torch.Tensor  # [T] bool: rows in some segment

    def args(self, out: torch.Tensor):
        return (self.x, out, self.w, self.page_elems, self.seg, self.meta, self.tables)


def lora_case(seed: int, fan_in: int, outs: list[int], ranks: list[list[int]], rows: list[int],
              page_elems: int = 100, dtype: torch.dtype = torch.float32, gaps: bool = True,
              pad_cols: int = 0, device: str = "cpu") -> LoraCase:
    """Segment s has rows[s] rows (0: empty) and module ranks ranks[s] (0: module not targeted).
    Pool elements no adapter uses are NaN, so a stray read shows. With `pad_cols`, x and the
    output are row-strided views into wider tensors."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    cols = np.concatenate([[0], np.cumsum(outs)[:-1]]).tolist()
    buffers, metas, segs, dense, row = [], [], [], [], 0
    for seg_ranks, n in zip(ranks, rows):
        if gaps:
            row += rng.randint(0, 2)  # rows in no segment: must stay untouched
        parts, meta, off, mods = [], np.zeros((3, META_FIELDS), dtype=np.int64), 0, []
        a_all = [torch.randn(r, fan_in, generator=g) / fan_in ** 0.5 for r in seg_ranks]
        for j, r in enumerate(seg_ranks):   # A matrices back to back, then each Bt, as Layout does
            parts.append(a_all[j].reshape(-1))
        a_offs = np.concatenate([[0], np.cumsum([r * fan_in for r in seg_ranks])]).tolist()
        off = a_offs[-1]
        for j, r in enumerate(seg_ranks):
            if r == 0:
                continue
            bt = torch.randn(r, outs[j], generator=g)
            meta[j] = (a_offs[j], r, off, outs[j], cols[j])
            parts.append(bt.reshape(-1))
            off += bt.numel()
            mods.append((cols[j], a_all[j], bt))
        buffers.append(torch.cat(parts) if parts else torch.zeros(0))
        metas.append(meta)
        segs.append((row, row + n))
        dense.append((row, row + n, mods))
        row += n
    total = row + 2
    # the pool: each adapter's logical pages spread over shuffled pool pages
    need = [max(1, -(-len(b) // page_elems)) for b in buffers]
    num_pages = sum(need) + 3
    perm = list(range(num_pages))
    rng.shuffle(perm)
    w = torch.full((num_pages * page_elems,), float("nan"))
    tables, at = [], 0
    for b, k in zip(buffers, need):
        pages = perm[at:at + k]
        at += k
        for j, p in enumerate(pages):
            piece = b[j * page_elems:(j + 1) * page_elems]
            w[p * page_elems:p * page_elems + len(piece)] = piece
        tables.append(pages)
    width = max([len(t) for t in tables], default=1)
    tables_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long).reshape(-1, width)
    x_wide = torch.randn(total, fan_in + pad_cols, generator=g)
    base_wide = torch.randn(total, sum(outs) + 2 * pad_cols, generator=g)
    x, base = x_wide[:, pad_cols:], base_wide[:, pad_cols:pad_cols + sum(outs)]
    expected = base.clone().double()
    covered = torch.zeros(total, dtype=torch.bool)
    xd = x.to(dtype).double()
    for start, end, mods in dense:
        covered[start:end] = True
        for col, a, bt in mods:
            a, bt = a.to(dtype).double(), bt.to(dtype).double()
            expected[start:end, col:col + bt.shape[1]] += (xd[start:end] @ a.t()) @ bt
    meta_t = torch.from_numpy(np.stack(metas)) if metas else torch.zeros(0, 3, META_FIELDS, dtype=torch.long)
    seg_t = torch.tensor(segs, dtype=torch.long).reshape(-1, 2)
    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    return LoraCase(put(x_wide)[:, pad_cols:], put(base_wide)[:, pad_cols:pad_cols + sum(outs)], put(expected),
                    put(w), page_elems, put(seg_t), put(meta_t), put(tables_t), covered.to(device))
