"""The CPU decode matmul: y = x @ W^T (+ b) for the few rows of a decode step, reading every
weight once at close to the machine's memory bandwidth (issue 18).

Why it exists: a decode step at small batch is a matrix-vector problem. torch's fp32 GEMM reads
a weight at 4-6 GB/s at 1-8 rows on a machine that streams ~20-28 GB/s, so two thirds of a
decode step went to `aten::mm` on the base weights while the memory bus idled. Here W keeps its
torch layout ([N, K] row-major, the checkpoint's), or, in fp32 on AVX2 and on AMD CPUs with
AVX-512, is packed once at load into panels in its own storage (`panels_cpu.pack`: no copy kept,
no extra memory), and:
- the N output rows are cut into blocks of NB weight rows, spread over torch's threads
  (`at::parallel_for`, so `torch.set_num_threads` governs it like every other op);
- a block's NB rows are streamed once from memory, side by side, against a tile of TB x rows
  held in NB x TB vector accumulators (`cpu/vector.h`'s `vw`), then the next TB x rows reuse
  the same NB rows from L1; so each weight byte comes from memory once per call whatever the
  number of rows;
- tile shapes follow the rows and the vector registers (`cpu/vector.h`'s `vw`: 32 of 16 lanes
  with AVX-512, 16 of 8 with AVX2): (NB, TB) = (6, 4) up to 4 rows, beyond that (3, 8) with
  AVX-512 (24 accumulators: (4, 8)'s 32 left no register for its weight vectors; on an Intel
  Sapphire Rapids VM, 2 threads, huge pages, alternated in one process, the step's matmuls at
  5-8 rows took 0.94-0.99x (4, 8)'s time on `tiny`'s and `smol`'s weights, and one weight on
  cached rows ran at 145 against 133 GFLOP/s; a prefetch two to eight blocks ahead, or into L2,
  took 1.02-1.13x; 8 rows as two passes of (6, 4), each prefetching half of the next block,
  1.09x; 9-24 rows take the same tiles, not measured apart), but one row on an AMD CPU goes
  one weight row at a time with no software prefetch, one sequential stream (on an AMD EPYC
  with AVX-512, `tiny`'s weights 0.72x the (6, 4) tile's time in fp32, 0.59x in bf16, `smol`'s
  0.68x; measured in `dispatch`); with AVX2 (8, 1) for one fp32 row, (1, 4) up to 4, (1, 8) up to 8 and (2, 4) beyond
  (each the best of 5-10 shapes measured on tiny's weights; (1, 4) replaced (6, 4) once the
  weights sat on huge pages: 0.86-0.92x the time at 2-4 fp32 rows, 0.77-0.93x in bf16); but 2-8
  x rows of more than 40 KB, more than L1 keeps beside the weight stream, go by chunks of K, a
  chunk of x in L1 against a group of weight rows (`run_kchunks`); the weight vectors are read
  once per tile; the rows left after the full tiles take the smallest tile of halved height that
  holds them, the count of real rows a compile-time constant of the tile like its shape (as a
  runtime count, 5-7 rows took 1.15-1.2x the time of 8). With (4, 8), AVX-512's tile then, on AVX2, 32
  accumulators of two registers each spilled to the stack: 8 rows ran at 2 GB/s, 32 ms for
  tiny's weights against 6 ms now and torch's 20 (AMD EPYC, 2 threads);
- while the first tile of a block runs, the next block's rows are prefetched, so memory keeps
  streaming while the FMAs run (without it, 8 rows took 1.5x as long); but not for one fp32
  row on AVX2, where the hardware prefetcher alone kept memory busier (23 GB/s against 21);
- with AVX-512, a tile's x rows of more than 32 KB (6-8 rows of a 1,536-wide input) go by
  chunks of K of at most 16 KB, every block of a thread over one chunk before the next (`run`:
  the matmuls of a `tiny` or `smol` step at 8 rows 0.93-0.96x the time, whole steps 0.93-0.97x);
- bf16 weights and activations: half the bytes of fp32 per step. Where the CPU has AVX512-BF16,
  `VDPBF16PS` multiplies bf16 pairs exactly and sums them into fp32 (no widening: with it, the
  kernel was compute-bound from 4 rows on); elsewhere each weight vector is widened to fp32 in
  registers (a 16-bit shift) and x is widened once per call, not once per weight row (on AVX2,
  tiny's weights at 8 rows: 18 -> 7.8 ms, as fast as fp32 there: compute-bound). Accumulation
  is fp32 either way, the result rounded once to bf16. (AMX-BF16 tiles, measured standalone on
  the Sapphire Rapids VM at 8 rows, weights packed in tile order: 13.8-14.9 GB/s against
  10.9-12.0 for `VDPBF16PS`; not built in);
- what 8 fp32 rows leave above the bound is the FMAs: 8 multiply-adds per weight, and on the
  Sapphire Rapids VM (1.4-1.75 G 512-bit FMAs a second a core) the (3, 8) tile on cached weights
  ran at 31.6 GB/s of weights (2 threads, standalone) against 19-21 from memory, so its FMAs take
  60-90% of the stream's time (`bench decode-bound`'s in-cache column); from memory it streamed
  at 0.82-0.89x the rate of one row, its access pattern without the FMAs at 0.97-0.98x; 256-bit
  tiles there, 0.79-0.91x the (3, 8) tile's rate. On an AMD EPYC with AVX-512 the same tile ran
  at 42-53% of the core's FMA peak even on cached weights: GCC folds each x load into its three
  FMAs as memory operands (25 loads per 24 FMAs; standalone, 41-42 G multiply-adds a second a
  thread against 58 for a register-only FMA loop), and each tile ends in 24 horizontal sums.
  Panels (`panels_cpu`) run there at that peak (58 G, standalone, cached): fp32 weights are packed
  there.
Past `max_rows()` rows (prefill), a call on weights laid out [N, K] goes to torch's GEMM, which
is better there: the weights are reused across many rows and the problem is compute-bound. Where that is (24 rows
with AVX-512, 64 with AVX2) was measured per instruction set, on one host of each, and for fp32
on an AMD CPU with AVX-512, where torch's GEMM (MKL) is slower than on Intel: 64 rows there (a
64-token prefill's matmuls 0.68x the time); in bf16 on a CPU with AMX, whose tiles torch's bf16
GEMM uses, from 13 rows on (`max_rows`). In fp32 on an AMD CPU that GEMM is oneDNN's (`gemm`:
the op torch registers as mkldnn::_linear_pointwise, on the weight as it is) instead of
at::linear's MKL: on the AMD EPYC with AVX-512 (2 threads, 2026-12-04; the only AMD host it was
measured on, Intel keeps at::linear) it took 0.74-0.94x MKL's time on `tiny`'s projections at
65-512 rows (0.60-0.74x on its LM head), equal to it within 1e-6 relative; a prefill of 8 x 64
tokens took 144-165 ms against 164-180 (over 8 adapters in turn 179-194 against 200-209). The
kernel at 16-64 rows, weights from memory, took 0.84-1.09x oneDNN's time: `max_rows` stays.

fp32 weights packed into panels (AVX2, and AVX-512 on AMD CPUs) are `panels_cpu`'s: `linear`
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
    24 where the build has AVX-512 (64 in fp32 on an AMD CPU), 64 with AVX2; bf16 12 where the
    CPU has AMX, whose tiles torch's bf16 GEMM uses (measured: see the C++ `max_rows`)."""
    return load().max_rows(dtype == torch.bfloat16)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` for x [T, K] and w [N, K] of one dtype (float32 or bfloat16), or w
    packed by `panels_cpu.pack`: the kernel on packed w at every row count, on w [N, K] up to
    `max_rows()` rows and torch's GEMM beyond (the C++ `linear` decides)."""
    return load().linear(x, w, bias)
