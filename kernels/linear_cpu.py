"""The CPU decode matmul: y = x @ W^T (+ b) for the few rows of a decode step, reading every
weight once at close to the machine's memory bandwidth.

Why it exists: a decode step at small batch is a matrix-vector problem, and torch's fp32 GEMM
reads a weight at 1-8 rows far below the machine's memory bandwidth: most of a decode step went
to `aten::mm` on the base weights while the memory bus idled. Here W keeps its torch layout
([N, K] row-major, the checkpoint's), or, in fp32 on AVX2 and on AMD CPUs with AVX-512, is
packed once at load into panels in its own storage (`panels_cpu.pack`: no copy kept, no extra
memory), and:
- the N output rows are cut into blocks of NB weight rows, spread over torch's threads
  (`at::parallel_for`, so `torch.set_num_threads` governs it like every other op);
- a block's NB rows are streamed once from memory, side by side, against a tile of TB x rows
  held in NB x TB vector accumulators (`cpu/vector.h`'s `vw`), then the next TB x rows reuse
  the same NB rows from L1; so each weight byte comes from memory once per call whatever the
  number of rows;
- tile shapes follow the rows and the vector registers (`vw`: 32 of 16 lanes with AVX-512, 16
  of 8 with AVX2), each the fastest of the shapes measured, every accumulator in a register (a
  tile that spilled them to the stack ran slower than torch). With AVX-512 (NB, TB) = (6, 4)
  up to 4 rows, (3, 8) beyond (24 accumulators: (4, 8)'s 32 left no register for its weight
  vectors), but one row on an AMD CPU goes one weight row at a time with no software prefetch,
  one sequential stream, which its prefetcher follows best (`dispatch`). With AVX2 (8, 1) for
  one fp32 row, (1, 4) up to 4, (1, 8) up to 8 and (2, 4) beyond ((1, 4) replaced (6, 4) once
  the weights sat on huge pages); but 2-8 x rows of more than 40 KB, more than L1 keeps beside
  the weight stream, go by chunks of K, a chunk of x in L1 against a group of weight rows
  (`run_kchunks`);
- the weight vectors are read once per tile; the rows left after the full tiles take the
  smallest tile of halved height that holds them, the count of real rows a compile-time
  constant of the tile like its shape (as a runtime count it ran slower);
- while the first tile of a block runs, the next block's rows are prefetched, so memory keeps
  streaming while the FMAs run (slower without it); but not for one fp32 row on AVX2, where the
  hardware prefetcher alone kept memory busier;
- with AVX-512, a tile's x rows of more than 32 KB (6-8 rows of a 1,536-wide input) go by
  chunks of K of at most 16 KB, every block of a thread over one chunk before the next (`run`:
  faster, in the matmuls and in whole decode steps);
- bf16 weights and activations: half the bytes of fp32 per step. Where the CPU has AVX512-BF16,
  `VDPBF16PS` multiplies bf16 pairs exactly and sums them into fp32 (no widening, which made
  the kernel compute-bound); elsewhere each weight vector is widened to fp32 in registers (a
  16-bit shift) and x is widened once per call, not once per weight row (per weight row, bf16
  on AVX2 was compute-bound and slower than fp32). Accumulation is fp32 either way, the result
  rounded once to bf16. Tried: AMX-BF16 tiles, weights packed in tile order; faster than
  `VDPBF16PS` standalone, not built in;
- what 8 fp32 rows leave above the memory bound is the FMAs: 8 multiply-adds per weight. On
  Intel with AVX-512 the (3, 8) tile's FMAs take most of the stream's time (`bench
  decode-bound`'s in-cache column; 256-bit tiles there were slower). On an AMD CPU with AVX-512
  the same tile runs well below the core's FMA peak even on cached weights: GCC folds each x
  load into its three FMAs as memory operands (25 loads per 24 FMAs), and each tile ends in 24
  horizontal sums. Panels (`panels_cpu`) run there at that peak: fp32 weights are packed there.
Past `max_rows()` rows (prefill), a call on weights laid out [N, K] goes to torch's GEMM, which
is better there: the weights are reused across many rows and the problem is compute-bound.
Where that is was measured per instruction set (`max_rows`): 24 rows with AVX-512, 64 with
AVX2, 64 in fp32 on an AMD CPU with AVX-512 (where torch's GEMM, MKL, is slower than on Intel),
and in bf16 on a CPU with AMX, whose tiles torch's bf16 GEMM uses, from 13 rows on. In fp32 on
an AMD CPU that GEMM is oneDNN's (`gemm`: the op torch registers as mkldnn::_linear_pointwise,
on the weight as it is) instead of at::linear's MKL: faster there, on projections, LM heads and
whole prefills, equal to it within 1e-6 relative (Intel keeps at::linear). The kernel at 16-64
rows is about even with oneDNN: `max_rows` stays.

fp32 weights packed into panels (AMD's layout: the `avx2` and `avx512-panels` variants) are `panels_cpu`'s: `linear`
sends them there (`pn::linear_packed`), at every row count.

Semantics: those of `F.linear` (the reference in `reference.linear`), fp32 accumulation in a
different order: equal to it within 1e-5 relative in fp32. Built with the other CPU kernels,
as one extension (`cpu_module`); LORAFLEET_KERNELS=torch chooses the reference.
"""

from __future__ import annotations

import torch

from lorafleet.kernels.cpu_module import load  # the CPU kernels' one extension


FUNCTIONS = ["linear", "max_rows"]


def max_rows(dtype: torch.dtype = torch.float32) -> int:
    """Rows up to which `linear` runs the kernel on x of `dtype` and w [N, K], torch's GEMM beyond
    (prefill; weights packed by `panels_cpu.pack` stay on the kernel at every row count):
    24 where the build has AVX-512 (64 in fp32 in AMD's layout, `avx512-panels`), 64 with AVX2;
    bf16 12 in the `amx` variant, whose tiles torch's bf16 GEMM uses (why: the C++ `max_rows`)."""
    return load().max_rows(dtype == torch.bfloat16)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           scales: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` for x [T, K] and w [N, K] of one dtype (float32 or bfloat16), or w
    packed by `panels_cpu.pack`: the kernel on packed w at every row count, on w [N, K] up to
    `max_rows()` rows and torch's GEMM beyond (the C++ `linear` decides). With `scales`, w is a
    quantized weight's codes: `quant_cpu.linear` (`Kernels.linear`'s one entry for both)."""
    return load().linear(x, w, bias, scales)
