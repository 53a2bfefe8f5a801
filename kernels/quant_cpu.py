"""The CPU matmul on quantized weights: y = x @ dequantize(q, scales)^T (+ b) for the
few rows of a decode step, reading the codes once, dequantized in registers, never as a
full-precision copy; and a quantized embedding's rows.

The layout is `lorafleet.model.quant`'s canonical one, read as it is (no packing): codes int8
[N, K] (w = d * q) or uint8 [N, K / 2] (int4, w = d * (q - 8); in each run of 32 elements along
K, byte i holds element i low and element i + 16 high), scales float16 [N, K / G], G a multiple
of 32 dividing K (K: one scale per output channel).

How (`cpu/quant.cpp`, namespace `qt`), on `linear_cpu`'s plan:
- the N output rows in blocks of NB weight rows over torch's threads (`at::parallel_for`); a
  block's rows stream once from memory, side by side, against a tile of TB x rows held in
  NB x TB vector accumulators; the rows left after full tiles of 8 take a tile of their own
  height (a compile-time count);
- each run of 32 codes is dequantized in registers into fp32 vectors (32 / VW of them) once per
  tile, then multiplied into the accumulators by fp32 FMAs: T FMAs per weight, against the
  dequantization's few instructions a run. With AVX-512, int4 goes by a 16-entry table
  d * (c - 8) in one register and VPERMPS (its index's low 4 bits: no masking of the low nibble),
  int8 by sign-extension, conversion and the scale's multiply; with AVX2 both by
  conversion and an FMA (int4's -8 folded into it);
- one scale a row (G = K: int8 as lorafleet quantizes) is applied to the sums, not to each run;
- the next block's codes are prefetched as the first tile of a block runs (`lin`'s reason);
- x rows too wide for L1 beside the code stream go by chunks of K (`lin::run`'s reason);
- bf16 x is widened to fp32 once per call; accumulation is fp32, the result rounded once to x's
  dtype.
2-8 rows of fp32 x, 2-16 of bf16 x (its `max_rows()`), where the build and the CPU have
AMX-BF16 (and Linux grants the tile state, `arch_prctl(ARCH_REQ_XCOMP_PERM)`): C^T = W x^T on the
tiles, so each weight is dequantized once per call whatever the row count (the FMA tiles
dequantize once per tile of x rows and spend T FMAs a weight). x^T in VNNI pairs is the B tile,
prepared once per call: bf16 x as it is; fp32 x as bf16(x) and beside it bf16(x - bf16(x)) (16
bits of its 24: relative 2^-17), hence at most 8 fp32 rows. Two designs, by scheme:
- fp32 x in groups G < K (int4, GGUF's Q8_0), from 5 rows (below, the FMA tiles are faster):
  the A tile is 16 weight rows x one run of their codes in bf16 without the scale (code - 8,
  code: small integers, exact in bf16: no weight is rounded). int4 unpacks in 3 instructions a
  run: the 16 bytes loaded into each 128-bit lane, each lane's words shifted by 0/4/8/12 bits,
  one `VPERMW` on a 16-entry table of bf16 values; the run's elements come out in another order
  along K, which the B tile's pairs follow. C sums a group's runs (up to 8 a chunk), is stored
  and multiplied by the group's scales (fp32, one per row, broadcast over the columns) into 16
  zmm accumulators that live across all of K; bias and output are written once. A block's
  chunks go through a pipeline (tile ops of chunk c, the codes of c + 1, C of c - 1 stored, that
  of c - 2 scaled), so no load comes right after the store it reads.
- int8 per channel with fp32 x, and every scheme with bf16 x: each row's runs are dequantized, a
  few runs at a time, with their scale (int8 per channel without it: bf16 holds its codes
  exactly, the scale is applied to the sums) into bf16 (VCVTNE2PS2BF16, d * code rounded once,
  `reference.dequantize`'s bf16 weights), in a double buffer the A tiles load from, two blocks of
  16 rows a task, C (fp32) over all of K.
Each thread of `at::parallel_for` loads its tile configuration and releases the tiles after its
range. The tolerances below hold on both.
Past `max_rows()` (prefill): blocks of weight rows dequantized into a buffer of about 1 MB in
x's dtype (`reference.dequantize`'s values bit for bit) and torch's GEMM on each (the bias in it,
`addmm`): the extra memory is bounded, whatever the weight.

Semantics: `reference.linear(x, q, bias, scales)` (dequantize, then F.linear), the sums in
another order: within 1e-5 relative (of the output's scale) in fp32, bf16's rounding in bf16
(on the AMX tiles too: bf16 x and bf16 weights are exact in them).
`rows`: `reference.rows` bit for bit. Built with the other CPU kernels, as one extension
(`cpu_module`); LORAFLEET_KERNELS=torch chooses the reference.
"""

from __future__ import annotations

import torch

from lorafleet.kernels.cpu_module import load  # the CPU kernels' one extension

FUNCTIONS = ["quant_rows", "quant_max_rows"]  # and `linear_cpu`'s `linear`, which takes the scales


def max_rows(dtype: torch.dtype = torch.float32) -> int:
    """Rows up to which `linear` runs the kernel; torch's GEMM on blocks of dequantized rows beyond."""
    return load().quant_max_rows(dtype == torch.bfloat16)


def linear(x: torch.Tensor, q: torch.Tensor, bias: torch.Tensor | None, scales: torch.Tensor) -> torch.Tensor:
    """`reference.linear(x, q, bias, scales)` for x [T, K] float32 or bfloat16 (the result in x's
    dtype), q the codes and `scales` their scales (the module doc's layout)."""
    return load().linear(x, q, bias, scales)


def rows(q: torch.Tensor, ids: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`reference.rows(q, ids, scales, dtype)`: a quantized embedding's rows, dequantized in `dtype`."""
    return load().quant_rows(q, ids, scales, dtype == torch.bfloat16)

