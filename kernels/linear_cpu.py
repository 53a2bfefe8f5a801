"""The CPU decode matmul: y = x @ W^T (+ b) for the few rows of a decode step, each weight byte read from
memory once per call whatever the row count (at 1-8 rows the matmul is memory-bound, and torch's fp32 GEMM
reads weights there far below the memory bandwidth).

W is [N, K] row-major (torch's layout), or fp32 packed into panels in its own storage (`panels_cpu.pack`,
AMD's layout), which `linear` sends to `pn::linear_packed` at every row count.

Decisions, each with its reason (the tiles', prefetches' and K chunks' in `cpu/linear.cpp`):
- N in blocks of NB weight rows over `at::parallel_for`: `torch.set_num_threads` governs it as every op.
- A block's NB rows stream side by side against TB x rows in NB x TB accumulators, shaped per instruction
  set (`cpu/vector.h`'s `vw`) so that none spills to the stack; the next TB rows reuse them from L1.
- bf16 halves the bytes: `VDPBF16PS` where the CPU has AVX512-BF16, else widened in registers; fp32 sums.
- On AMD the [N, K] tiles are FMA-bound at 8 fp32 rows: fp32 weights are packed into panels there.
- Past `max_rows()` rows (prefill: weights reused, compute-bound) [N, K] weights go to torch's GEMM:
  at::linear, but oneDNN's in fp32 on an AMD CPU (`gemm`: faster there than MKL, equal within 1e-6 relative).

Semantics: `F.linear`'s (`reference.linear`), fp32 accumulation in another order: within 1e-5 relative in
fp32, bf16 rounded once. Built in the CPU kernels' one extension (`cpu_module`); LORAFLEET_KERNELS=torch
chooses the reference.
"""

from __future__ import annotations

import torch

from lorafleet.kernels.cpu_module import load  # the CPU kernels' one extension


FUNCTIONS = ["linear", "max_rows"]


def max_rows(dtype: torch.dtype = torch.float32) -> int:
    """Rows up to which `linear` runs the kernel on x of `dtype` and w [N, K], torch's GEMM beyond: 24 with
    AVX-512 (64 in fp32 in `avx512-panels`), 64 with AVX2, bf16 12 in `amx` (why: the C++ `max_rows`)."""
    return load().max_rows(dtype == torch.bfloat16)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           scales: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` for x [T, K] and w [N, K] of one dtype (float32 or bfloat16) or packed by
    `panels_cpu.pack`, the C++ `linear` choosing the path; with `scales` (and `offsets`, a GGUF file's
    affine types), w is a quantized weight's codes (`quant_cpu.linear`: `Kernels.linear` is one entry for both)."""
    return load().linear(x, w, bias, scales, offsets)
