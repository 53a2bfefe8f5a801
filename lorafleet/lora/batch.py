"""Per-step LoRA metadata: which flat-batch rows use which resident adapter, as contiguous
segments (the runner orders rows by adapter so each adapter of the step is one segment per
phase), handed to the shrink/expand op for every projection group.

Projection groups share an input, so their shrinks fuse into one matmul:
  qkv -> (q_proj, k_proj, v_proj), o -> (o_proj,), gate_up -> (gate_proj, up_proj), down -> (down_proj,)

Two paths, chosen per segment once per step: short segments (decode rows) of contiguous fp32
adapters on the CPU go to the fused CPU kernel (`kernels/lora_cpu.py`: one call per layer and
group for all of them); longer segments (prefill chunks), where a BLAS matmul is efficient, go to
the torch reference.
"""

from __future__ import annotations

import numpy as np
import torch

from lorafleet.kernels import lora_cpu
from lorafleet.kernels.reference import LoraSegment, lora_shrink_expand

GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
GROUP_INDEX = {g: i for i, g in enumerate(GROUPS)}
KERNEL_MAX_ROWS = 4  # longer segments amortise BLAS matmuls better than per-row kernels


def kernel_weights(pool_tensor: torch.Tensor) -> torch.Tensor | None:
    """The flat pool the CPU kernel reads, or None when the kernel cannot serve this pool."""
    if pool_tensor.device.type != "cpu" or pool_tensor.dtype != torch.float32 or lora_cpu.load() is None:
        return None
    return pool_tensor.view(-1)


class LoraBatch:
    def __init__(self, weights: torch.Tensor | None = None):
        """`weights`: the flat pool for the CPU kernel (see `kernel_weights`), or None."""
        self.weights = weights
        self.rows: list[tuple[int, int, list]] = []          # torch path: (start, end, views)
        self._kernel_rows: list[tuple[int, int, np.ndarray]] = []
        self.meta: torch.Tensor | None = None                # [L, G, S, 3, F] int64
        self.seg: torch.Tensor | None = None                 # [S, 2] int64

    def add_rows(self, start: int, end: int, views, kernel_meta: np.ndarray | None = None) -> None:
        """Rows [start, end) use one adapter: its per-(layer, group) views (residency's
        `step_views`) and, when it is contiguous, its CPU-kernel offsets."""
        if self.weights is not None and kernel_meta is not None and end - start <= KERNEL_MAX_ROWS:
            self._kernel_rows.append((start, end, kernel_meta))
        else:
            self.rows.append((start, end, views))

    def finish(self) -> LoraBatch:
        """Build the kernel's step tensors once, for every layer and group."""
        if self._kernel_rows:
            metas = np.stack([m for _, _, m in self._kernel_rows], axis=2)   # [L, G, S, 3, F]
            self.meta = torch.from_numpy(np.ascontiguousarray(metas))
            self.seg = torch.tensor([(s, e) for s, e, _ in self._kernel_rows], dtype=torch.long)
        return self

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.seg is not None:
            lora_cpu.lora_segments(x, out, self.weights, self.meta[layer, GROUP_INDEX[group]], self.seg)
        segs = [LoraSegment(start, end, *view) for start, end, views in self.rows
                if (view := views[layer].get(group)) is not None]
        if segs:
            lora_shrink_expand(x, out, segs)
