"""The CPU matmul on quantized weights (issue 51): y = x @ dequantize(q, scales)^T (+ b) for the
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
dequantize once per tile of x rows and spend T FMAs a weight). Two blocks of 16 weight rows a
task; each row's runs are dequantized, a few runs at a time, with their scale (int8 per channel
without it: bf16 holds its codes exactly, the scale is applied to the sums) into bf16
(VCVTNE2PS2BF16, d * code rounded once), in a double buffer the A tiles load from (natural
[N, K] order, no repacking); with fp32 x also the remainder w - bf16(w) in bf16, a second A tile
(hi + lo: 16 bits, which hold an fp16 scale times an int4 code exactly). x^T in VNNI pairs is
the B tile, prepared once per call: bf16 x as it is; fp32 x as bf16(x) and beside it
bf16(x - bf16(x)) (16 bits of its 24: relative 2^-17), hence at most 8 fp32 rows. C (16 x
columns, fp32) accumulates over all of K (TDPBF16PS). Each thread of `at::parallel_for` loads
its tile configuration and releases the tiles after its range. The tolerances below hold on it.
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

FUNCTIONS = ["quant_rows", "quant_max_rows", "quant_tune"]  # and `linear_cpu`'s `linear`, which takes the scales


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


def tune(name: str, value: int = -1) -> int:
    """The micro-benchmark's knobs (`xchunk`: bytes of x a chunk of K, 0 never; `prefetch`: 0/1;
    `max_rows`: rows up to which the kernel runs, 0 the default; in a build with AMX-BF16 also
    `amx`: 0/1, `xsplit`: x's hi + lo columns 0/1, `segruns`: runs of a row dequantized at a time):
    sets one (value >= 0) and returns its previous value, or reads it (value -1)."""
    return load().quant_tune(name, value)
