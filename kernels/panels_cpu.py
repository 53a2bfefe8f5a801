"""fp32 weights packed into panels for the CPU decode matmul, and the reads of a packed weight: the matmul
(`linear_packed`, where `linear_cpu.linear` sends packed weights at every row count), an embedding's rows
(`rows`) and the packing (`pack`).

Layout: W [N, K] becomes [N / PW, K, PW] in its own storage (PW = `panel_width()`, two vectors). An x element
is broadcast against a panel's PW outputs at k, so sums are PW lanes wide: no horizontal sums, 2 + rows loads
per 2 x rows FMAs, where `linear_cpu`'s [N, K] tiles on AMD are FMA-bound.

Decisions, each with its reason (the passes' and prefetches' in `cpu/panels.cpp`):
- Packed only in AMD's layout (the `avx2` and `avx512-panels` variants, auto's on AMD CPUs), fp32 only: on
  Intel the [N, K] tiles are faster; bf16 and an N that PW does not divide stay [N, K].
- The model packs its projections and LM head once, at load, in place; a tied head's embedding is read by
  rows out of the panels (`rows`): slower than index_select, far less than the head's matmul gains.
- One row goes by itself over all of K (`panel_row`), so that eight loads of the stream are in flight.
- Each thread takes a contiguous range of panels, with no software prefetch with AVX-512: one sequential
  stream a thread is what AMD's hardware prefetcher follows best.
- Past `max_rows()` the panels stay the kernel's (close to oneDNN's GEMM on [N, K]): no copy to [N, K].

Semantics: `F.linear`'s (`reference.linear`) in fp32, sums in another order: within 1e-5 relative. Built in
the CPU kernels' one extension (`cpu_module`, namespace `pn`, before `linear_cpu`'s `lin`, which calls it).
"""

from __future__ import annotations

import torch

from lorafleet.kernels.cpu_module import load  # the CPU kernels' one extension

FUNCTIONS = ["panel_width", "rows"]


def rows(w: torch.Tensor, ids: torch.Tensor, scales: torch.Tensor | None = None,
         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`w[ids]` for w [N, K] or packed by `pack` (an embedding that is also the LM head): [T, K];
    a quantized embedding (codes w and `scales`) dequantized in `dtype` (`quant_cpu.rows`)."""
    if scales is not None:
        from lorafleet.kernels import quant_cpu

        return quant_cpu.rows(w, ids, scales, dtype)
    return load().rows(w, ids)


def pack(w: torch.Tensor) -> torch.Tensor:
    """A base weight [N, K] laid out for `linear_cpu.linear` as panels [N / PW, K, PW] (PW: the build's
    `panel_width`) in its own storage: no memory added, and the tensor given must not be read as [N, K]
    again. Returned as is where it stays [N, K]: not float32, N not a multiple of PW, or a variant without
    panels (`avx512`, `amx`)."""
    pw = load().panel_width()
    if not pw or w.dtype != torch.float32 or w.dim() != 2 or w.shape[0] % pw or not w.is_contiguous():
        return w
    n, k = w.shape
    panels = w.view(n // pw, pw, k).transpose(1, 2).contiguous()
    flat = w.view(-1)
    flat.copy_(panels.view(-1))
    return flat.view(n // pw, k, pw)
