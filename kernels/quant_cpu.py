"""The CPU matmul on quantized weights, y = x @ dequantize(q, scales, offsets)^T (+ b), for the few rows of a decode
step, the codes read once and dequantized in registers (never a full-precision copy); and a quantized
embedding's rows. Layout: `lorafleet.model.quant`'s as it is, codes int8 [N, K] or uint8 [N, K / 2] (int4),
scales float16 [N, K / G], G a multiple of 32 dividing K (G = K: one scale per output channel), and a GGUF
file's affine types' offsets float32 [N, K / G] or none: w = d * c + o.

Decisions, each with its reason (the instructions' in `cpu/quant.cpp` and `cpu/quant_amx.h`, namespace `qt`):
- FMA tiles on `linear_cpu`'s plan, for its reasons: each run of 32 codes dequantized into fp32 vectors once
  per tile of x rows; one scale a row (G = K) applied to the sums, not to each run; bf16 x widened once a call.
  Offsets join each run's dequantized weights in the same FMA (free): no term added after the matmul.
- AMX-BF16 tiles for 2-8 fp32 x rows and 2-16 bf16 ones (`max_rows()`), where the build and CPU have them and
  Linux grants the tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`): C^T = W x^T dequantizes each weight once a
  call, not once per tile of x rows. fp32 x enters as bf16(x) beside bf16(x - bf16(x)) (relative 2^-17),
  hence at most 8 rows; fp32 x in groups G < K from 5 rows only (the FMA tiles win below), its codes unscaled
  (exact in bf16), the group's scales applied to C in fp32, the offsets' term as each group's sum of x times
  its offset beside them (the codes stay exact). Tile state is per thread: each `at::parallel_for` thread
  loads its configuration and releases the tiles after its range.
- Past `max_rows()` (prefill): blocks of weight rows dequantized into a buffer of about 1 MB in x's dtype
  (`reference.dequantize`'s values bit for bit, offsets included), torch's `addmm` on each: bounded extra memory.

Semantics: `reference.linear(x, q, bias, scales, offsets)` (dequantize, then F.linear), sums in another order:
within 1e-5 relative (of the output's scale; with offsets, of the sum of |x| times |d * c| + |o|: the tiles
round d * c + o once where the reference rounds the product, then the sum) in fp32, bf16's rounding in bf16
(on the AMX tiles too: bf16 x and weights are exact there); fp32 accumulation, the result in x's dtype.
`rows`: `reference.rows` bit for bit.
Built in the CPU kernels' one extension (`cpu_module`); LORAFLEET_KERNELS=torch chooses the reference.
"""

from __future__ import annotations

import torch

from lorafleet.kernels.cpu_module import load  # the CPU kernels' one extension

FUNCTIONS = ["quant_rows", "quant_max_rows"]  # and `linear_cpu`'s `linear`, which takes the scales


def max_rows(dtype: torch.dtype = torch.float32) -> int:
    """Rows up to which `linear` runs the kernel; torch's GEMM on blocks of dequantized rows beyond."""
    return load().quant_max_rows(dtype == torch.bfloat16)


def linear(x: torch.Tensor, q: torch.Tensor, bias: torch.Tensor | None, scales: torch.Tensor,
           offsets: torch.Tensor | None = None) -> torch.Tensor:
    """`reference.linear(x, q, bias, scales, offsets)` for x [T, K] float32 or bfloat16 (the result in
    x's dtype), q the codes, `scales` their scales and `offsets` their groups' offsets or None (the
    module doc's layout)."""
    return load().linear(x, q, bias, scales, offsets)


def rows(q: torch.Tensor, ids: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`reference.rows(q, ids, scales, dtype)`: a quantized embedding's rows, dequantized in `dtype`."""
    return load().quant_rows(q, ids, scales, dtype == torch.bfloat16)

