"""The CPU LoRA kernel: shrink + expand for every segment of a projection group in one call,
reading adapter weights straight from the pool's pages through each adapter's row table.

Semantics (identical to `reference.lora`, whose contract it keeps): for every segment s, row i in
[seg[s, 0], seg[s, 1]) and module slot m whose rank r > 0 in the row table at seg[s, 2]:
    out[i, col_m : col_m + n_out] += scale(s) * (x[i] @ A_m(s)^T) @ Bt_m(s)
the segments of a mix summed in fp32 and added once. A mix's module is one task list over its
members' rank rows side by side (their row pointers copied into one list on the host, each
shrink result times its member's scale), so it costs what one adapter of their total rank does;
a lone segment at scale 1 reads its pointer lists in the pool, as before mixes existed.
with A_m's row k ([in]) and Bt_m's row k ([n_out]) each one contiguous run of the pool that its
row pointer gives, so an adapter's pages may lie anywhere in the pool: no contiguous run, no
per-step gather.

Why it exists: with one token per adapter (decode over many adapters), the torch path issues
~11 tiny matmuls per adapter per layer, and the time goes to dispatch, not to reading weights.
This kernel makes it one call per (layer, group) in two or three parallel passes over the pool:
- shrink: tasks of 4 rank rows of one (segment, module); each A row is read from memory once
  for all the segment's rows (4 x rows per vector tile; 2 on AVX2), the products kept in fp32;
  for one x row on an AMD CPU with AVX-512, the 4 A rows one after another, not side by side
  (one sequential stream, which its prefetcher follows best, as in `linear_cpu`);
- expand: tasks of 64 output columns (128 on AVX2) of one (segment, module); the Bt block is
  read once for all the segment's rows (4 rows per tile; 1 on AVX2), summed over every rank
  row in registers, and each output element gets the whole delta at once (rounded once);
- but a segment of one row (decode) reads Bt by whole rows: tasks of 16 rank rows add each row,
  scaled by its shrink result, to an fp32 partial of every output column, and a third pass sums
  the partials into the output (rounded once). Column tasks read each Bt row in 512-byte pieces
  n_out apart; whole rows stream, and were faster. 16 rank rows a task: faster than 4 or 8,
  about even with 32, and it keeps a rank-64 module at 4 tasks for the threads.
The tiles are sized to the CPU's register file (`cpu/vector.h`'s `vw`): the AVX-512 shapes ran
out of registers on AVX2, several times slower than the AVX2 shapes.
So even one adapter at batch 1 spreads over every thread and decode reads each weight once, at
the memory bound. The first version's tasks were (segment, block of 4 rows): one adapter at
batch 1 ran on one thread, and 8 rows of one adapter read its weights twice (slower at every
batch measured).
float32 and bfloat16 (x, out and the pool in one dtype): sums in fp32, each output element
rounded once when the segment's whole delta joins it, as the reference does.
It is compiled on first use with the other CPU kernels, as one extension (`cpu_module`); where
that is impossible lorafleet falls back to the torch reference and says so once.
LORAFLEET_KERNELS=torch chooses the reference; LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI) makes a
kernel that cannot be loaded an error instead (`KernelUnavailableError`, with the build error).
"""

from __future__ import annotations

import torch

from lorafleet.kernels.cpu_module import load  # the CPU kernels' one extension

FUNCTIONS = ["lora"]


def lora(x: torch.Tensor, out: torch.Tensor, w: torch.Tensor, seg: torch.Tensor, entry: int, slots: int) -> None:
    """x: [T, in]; out: [T, N] (updated in place); w: the pool, flat; one dtype, float32 or
    bfloat16 (fp32 sums, each output rounded once); seg [S, 5] int64 (`reference.py`'s contract);
    entry, slots: the group's fields in the row tables."""
    load().lora(x, out, w, seg, entry, slots)
