"""The CPU LoRA kernel: shrink + expand of every segment of a projection group in one call, reading adapter
weights straight from the pool's pages through each adapter's row table.

Semantics (`reference.lora`'s contract): for every segment s, row i in [seg[s, 0], seg[s, 1]) and module slot
m whose rank r > 0 in the row table at seg[s, 2]:
    out[i, col_m : col_m + n_out] += scale(s) * (x[i] @ A_m(s)^T) @ Bt_m(s)
A_m's row k ([in]) and Bt_m's row k ([n_out]) are each one contiguous run of the pool at its row pointer, so
an adapter's pages may lie anywhere (no gather). A mix's module is one task list over its members' rank rows,
each shrink result times its member's scale: it costs one adapter of their total rank. float32 or bfloat16
(x and out in one dtype; the pool's adapters in it too, or in bfloat16 or float16 under float32 x, widened in
registers: `--lora-dtype`): fp32 sums, each output element rounded once with the whole delta.

Decisions, each with its reason (the tiles' in `cpu/lora.cpp`):
- One call per (layer, group): at one token per adapter, torch's many small matmuls cost their dispatch.
- Tasks split rank rows (shrink) and output columns (expand), not x rows: one adapter at batch 1 spreads
  over every thread, and each weight is read once for all its segment's rows.
- A one-row segment (decode) reads Bt by whole rows, which stream (column tasks read pieces n_out apart):
  tasks of 16 rank rows add into fp32 partials, which a third pass sums into the output.

Compiled on first use in the CPU kernels' one extension (`cpu_module`), the torch reference serving (said
once) where it cannot be; LORAFLEET_KERNELS=torch chooses the reference; LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI)
makes an unloadable kernel an error (`KernelUnavailableError`, with the build error).
"""

from __future__ import annotations

import torch

from lorafleet.kernels.cpu_module import load  # the CPU kernels' one extension

FUNCTIONS = ["lora"]


def lora(x: torch.Tensor, out: torch.Tensor, w: torch.Tensor, seg: torch.Tensor, entry: int, slots: int) -> None:
    """x: [T, in]; out: [T, N] (updated in place), float32 or bfloat16; w: the pool, flat, in their
    dtype or 16-bit under float32 (fp32 sums, each output rounded once); seg [S, 5] int64 (`reference.py`'s contract);
    entry, slots: the group's fields in the row tables."""
    load().lora(x, out, w, seg, entry, slots)
