"""fp32 weights packed into panels for the CPU decode matmul (`linear_cpu`), and the reads of a
packed weight: the matmul on its panels (`linear_packed`, which `linear_cpu`'s `linear` sends
packed weights to), an embedding's rows out of them (`rows`) and the packing itself (`pack`).

Why panels: a weight laid out [N, K] is read by `linear_cpu`'s tiles, several weight rows side
by side against several x rows, each output a horizontal sum at the end. On an AMD CPU with
AVX-512 those tiles ran well below the core's FMA peak even on cached weights (GCC folds each x
load into its FMAs as memory operands, and every tile ends in horizontal sums); on AVX2 they
were compute-bound at 8 rows. A panel holds PW outputs' weights k by k, so an x element is
broadcast against them and the sums are PW lanes wide: no horizontal sums, and 2 + rows loads
per 2 x rows FMAs.

Packed panels (`pack`, `Kernels.pack`: the model packs its projections and LM head once, at
load, in place; fp32 only, in AMD's layout (the `avx2` and `avx512-panels` variants, auto's on AMD CPUs; on Intel they did
not pay, below); an N that the panel width does not divide and bf16 stay [N, K]; a tied LM head
is packed too, its embedding then read by rows out of the panels, `rows`: slower than
index_select, but far less than the head's matmul gains on panels).
With AVX2: W as [N / 16, K, 16], each panel one contiguous stream with the next one prefetched
a line per k, each x element broadcast against the panel's two vectors into 12 accumulators of
6 rows x 16 outputs (8 loads per 12 FMAs against (1, 8)'s 9 per 8, no horizontal sums), rows in
passes of 6 and the rest (2-4 rows: one pass of 4) over chunks of 128 of K, one row by itself
over all of K, four k at a time (`panel_row`). Faster than the [N, K] tiles at 1-8 rows, in
`tiny`'s decode steps and in prefills (`smol`'s decode steps about even); greedy tokens
identical. Tried: passes of 4 + 4 rows (8 accumulators), or no prefetch; slower, not kept.
With AVX-512 (panels of 32 outputs, two 16-lane vectors): on Intel, as built for AVX2, slower
than the [N, K] tiles at 8 rows, and with passes of 8 and 12 rows slower at 1 row: not enabled
there. On an AMD CPU: passes of up to 8 rows (16 accumulators), faster than the [N, K] tiles at
2-24 rows and, with `panel_row`, mostly at 1; no software prefetch (of the next panel, as with
AVX2, or further ahead in the same one: slower); passes of 12 rows no better than 8. Whole
decode steps faster at batch 8 and 32, batch 1 as before. Past `max_rows()` the panels stay the
kernel's (blocks of 64 rows): close to oneDNN's GEMM on the same weights laid out [N, K]
(faster at 64 rows), without the copy to [N, K] per call made before.
Tried on the AMD CPU with AVX-512, not kept: a software prefetch 4-16 KB ahead in the same panel
(faster only in the host's slow-memory phase, slower in its fast one); threads taking panels
from a shared counter instead of a contiguous range each (slower: each thread's one sequential
stream is what the hardware prefetcher follows best).

Semantics: those of `F.linear` (the reference in `reference.linear`) in fp32, the sums in another
order: equal to it within 1e-5 relative. Built with the other CPU kernels, as one extension
(`cpu_module`, namespace `pn`, before `linear_cpu`'s `lin`, which calls it).
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
    `panel_width`), in its own storage: the values move, no memory is added, and the tensor given
    must not be read as [N, K] again. Returned as is where it stays [N, K]: not float32, N not a
    multiple of PW, or a variant without panels (`avx512`, `amx`: on Intel CPUs they did not pay)."""
    pw = load().panel_width()
    if not pw or w.dtype != torch.float32 or w.dim() != 2 or w.shape[0] % pw or not w.is_contiguous():
        return w
    n, k = w.shape
    panels = w.view(n // pw, pw, k).transpose(1, 2).contiguous()
    flat = w.view(-1)
    flat.copy_(panels.view(-1))
    return flat.view(n // pw, k, pw)
