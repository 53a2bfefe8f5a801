"""Per-step LoRA metadata: which flat-batch rows use which resident adapter, as contiguous
segments (the runner orders rows by adapter so each adapter of the step is one segment per
phase), handed to the kernels' LoRA op for every projection group.

Projection groups share an input:
  qkv -> (q_proj, k_proj, v_proj), o -> (o_proj,), gate_up -> (gate_proj, up_proj), down -> (down_proj,)

One path for every segment, decode or prefill: the op reads each adapter's weights from the
pool's pages through the segment's page table (`kernels/reference.py` states the contract).
Built once per step, for every layer and group at once: `meta` [L, G, S, slots, 5] (each
adapter's metadata is fixed for its life, stacked here), `seg` [S, 2], `tables` [S, maxp].
"""

from __future__ import annotations

import numpy as np
import torch

GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
GROUP_INDEX = {g: i for i, g in enumerate(GROUPS)}
MODULE_SLOTS = max(len(m) for m in GROUPS.values())  # module slots per group in the metadata


class LoraBatch:
    def __init__(self, kernels, pool_tensor: torch.Tensor):
        """`kernels`: the model's `kernels.backend.Kernels`; `pool_tensor` [pages, page_elems]."""
        self.kernels = kernels
        self.weights = pool_tensor.view(-1)
        self.page_elems = pool_tensor.shape[1]
        self._rows: list[tuple[int, int, np.ndarray, np.ndarray]] = []
        self.meta: torch.Tensor | None = None     # [L, G, S, slots, 5] int64
        self.seg: torch.Tensor | None = None      # [S, 2] int64
        self.tables: torch.Tensor | None = None   # [S, maxp] int64
        self.max_rows = self.max_rank = 0
        self.host: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # (meta, seg, tables) in numpy

    @classmethod
    def fixed(cls, kernels, pool_tensor: torch.Tensor, seg: torch.Tensor, meta: torch.Tensor, tables: torch.Tensor,
              max_rows: int, max_rank: int) -> LoraBatch:
        """A batch over fixed buffers with static bounds (a captured decode step: `engine/graphs.py`)."""
        batch = cls(kernels, pool_tensor)
        batch.seg, batch.meta, batch.tables, batch.max_rows, batch.max_rank = seg, meta, tables, max_rows, max_rank
        return batch

    def add_rows(self, start: int, end: int, meta: np.ndarray, pages: np.ndarray) -> None:
        """Rows [start, end) use one adapter: its metadata [L, G, slots, 5] and its pages."""
        self._rows.append((start, end, meta, pages))

    def finish(self) -> LoraBatch:
        """The step's tensors, once, for every layer and group."""
        dev = self.weights.device
        metas = np.stack([m for _, _, m, _ in self._rows], axis=2)          # [L, G, S, slots, 5]
        width = max(len(p) for *_, p in self._rows)
        tables = np.zeros((len(self._rows), width), dtype=np.int64)
        for i, (*_, pages) in enumerate(self._rows):
            tables[i, :len(pages)] = pages
        seg = np.array([(s, e) for s, e, _, _ in self._rows], dtype=np.int64)
        self.max_rows = int((seg[:, 1] - seg[:, 0]).max())
        self.max_rank = int(metas[..., 1].max())
        self.host = (metas, seg, tables)
        self.meta = torch.from_numpy(np.ascontiguousarray(metas)).to(dev)
        self.seg = torch.from_numpy(seg).to(dev)
        self.tables = torch.from_numpy(tables).to(dev)
        return self

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += each row's adapter delta for `group` of `layer` (rows in no segment untouched)."""
        # the group's own module slots (a view): a GPU kernel launches programs per slot
        meta = self.meta[layer, GROUP_INDEX[group], :, :len(GROUPS[group])]
        self.kernels.lora(x, out, self.weights, self.page_elems, self.seg, meta, self.tables, self.max_rows,
                          self.max_rank)
