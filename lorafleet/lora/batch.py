"""Per-step LoRA metadata: which flat-batch rows use which resident adapter, as contiguous
segments (the runner orders rows by adapter so each adapter of the step is one segment per
phase), handed to the kernels' LoRA op for every projection group.

Projection groups share an input:
  qkv -> (q_proj, k_proj, v_proj), o -> (o_proj,), gate_up -> (gate_proj, up_proj), down -> (down_proj,)

One path for every segment, decode or prefill: the op reads each adapter's weights from the
pool's pages through the adapter's row table, which lives in its own pages (`kernels/reference.py`
states the contract, `memory/layout.py` builds it). So a step's metadata is small: per segment
its first row, its end, where its adapter's row table starts, its scale and its place in a mix,
`seg` [S, SEG_FIELDS], built once on the host and copied once (by `to_device`, or into a captured
step's buffer by `engine/graphs.py`).

A request on several adapters (a mix) is one segment per adapter over the same rows, each with
its scale; the op sums their deltas in fp32 and adds them once. Its rank bound (`max_rank`) is
the sum of its members' ranks: the op treats it as one adapter of their rank rows side by side.
"""

from __future__ import annotations

import numpy as np
import torch

from lorafleet.kernels.reference import SEG_FIELDS, lora_entry, scale_bits

GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
GROUP_INDEX = {g: i for i, g in enumerate(GROUPS)}
MODULE_SLOTS = max(len(m) for m in GROUPS.values())  # module slots per group in a row table


def group_widths(features: dict[str, tuple[int, int]]) -> dict[str, int]:
    """Each group's widest module output (a bound of the LoRA op's grid), from the base's
    (in, out) features per module."""
    return {g: max(features[m][1] for m in modules) for g, modules in GROUPS.items()}


class LoraBatch:
    def __init__(self, kernels, pool_tensor: torch.Tensor, widths: dict[str, int]):
        """`kernels`: the model's `kernels.backend.Kernels`; `pool_tensor` [pages, page_elems];
        `widths`: `group_widths` of the base."""
        self.kernels = kernels
        self.weights = pool_tensor.view(-1)
        self.widths = widths
        self.host = np.zeros((0, SEG_FIELDS), dtype=np.int64)  # [S, 5] (start, end, row table, scale, mix)
        self.seg: torch.Tensor | None = None           # the same on the pool's device, once copied
        self.max_rows = self.max_rank = 0
        self._rows: list[tuple[int, int, int, int, int]] = []
        self._split: dict[int, np.ndarray] = {}

    @classmethod
    def fixed(cls, kernels, pool_tensor: torch.Tensor, widths: dict[str, int], seg: torch.Tensor, max_rows: int,
              max_rank: int) -> LoraBatch:
        """A batch over a fixed buffer with static bounds (a captured decode step: `engine/graphs.py`)."""
        batch = cls(kernels, pool_tensor, widths)
        batch.seg, batch.max_rows, batch.max_rank = seg, max_rows, max_rank
        return batch

    def add_rows(self, start: int, end: int, tables: list[tuple[int, float]], max_rank: int) -> None:
        """Rows [start, end) use the adapters whose row tables start at these int64 indices of the
        pool, each delta times its scale ((table, 1.0): one adapter; several: a mix, summed);
        `max_rank`: the sum of their largest ranks."""
        n = len(tables)
        for j, (table, scale) in enumerate(tables):
            self._rows.append((start, end, table, scale_bits(scale), n if j == 0 else -j))
        self.max_rank = max(self.max_rank, max_rank)

    def finish(self) -> LoraBatch:
        """The step's segments, on the host."""
        self.host = np.array(self._rows, dtype=np.int64).reshape(-1, SEG_FIELDS)
        self.max_rows = int((self.host[:, 1] - self.host[:, 0]).max(initial=0))
        return self

    def split(self, rows: int) -> np.ndarray:
        """The segments cut into runs of at most `rows` rows: [S', SEG_FIELDS] (a captured step's
        grid has one row block of `rows` per segment). A mix is cut as one: each run of its rows
        is a mix again (its lead, then its followers), so the runs of a mix stay together."""
        if rows not in self._split:
            self._split[rows] = self._cut(rows)
        return self._split[rows]

    def _cut(self, rows: int) -> np.ndarray:
        """Array operations, no loop per segment (a captured step runs this every step): mix g of
        n[g] segments and p[g] runs gives n[g] * p[g] rows, run q's members j in order."""
        h = self.host
        lead = np.flatnonzero(h[:, 4] >= 1)
        n, lo, hi = h[lead, 4], h[lead, 0], h[lead, 1]
        count = n * (-(-(hi - lo) // rows))                       # an empty mix: no run
        g = np.repeat(np.arange(len(lead)), count)
        local = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
        q, j = local // n[g], local % n[g]
        out = h[lead[g] + j]                                     # a copy (fancy indexing)
        out[:, 0] = lo[g] + q * rows
        out[:, 1] = np.minimum(out[:, 0] + rows, hi[g])
        return out

    def to_device(self) -> LoraBatch:
        """`seg` for the kernels: one copy of [S, SEG_FIELDS] to the pool's device (none on the CPU)."""
        self.seg = torch.from_numpy(self.host).to(self.weights.device, non_blocking=True)
        return self

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += each row's adapter delta for `group` of `layer` (rows in no segment untouched)."""
        entry = lora_entry(layer, GROUP_INDEX[group], len(GROUPS), MODULE_SLOTS)
        self.kernels.lora(x, out, self.weights, self.seg, entry, len(GROUPS[group]), self.max_rows, self.max_rank,
                          self.widths[group])
