"""fp32 weights packed into panels for the CPU decode matmul (`linear_cpu`), and the reads of a
packed weight: the matmul on its panels (`linear_packed`, which `linear_cpu`'s `linear` sends
packed weights to), an embedding's rows out of them (`rows`) and the packing itself (`pack`).

Why panels: a weight laid out [N, K] is read by `linear_cpu`'s tiles, several weight rows side
by side against several x rows, each output a horizontal sum at the end. On an AMD EPYC with
AVX-512 those tiles ran at 42-53% of the core's FMA peak even on cached weights (GCC folds each x
load into its FMAs as memory operands, and every tile ends in horizontal sums); on AVX2 they
were compute-bound at 8 rows. A panel holds PW outputs' weights k by k, so an x element is
broadcast against them and the sums are PW lanes wide: no horizontal sums, and 2 + rows loads
per 2 x rows FMAs.

Packed panels (`pack`, `Kernels.pack`: the model packs its projections and LM head once, at
load, in place; fp32 only, in builds for AVX2 and, with AVX-512, on AMD CPUs (on the Intel one
they did not pay, below); an N that the panel width does not divide and bf16 stay [N, K]; a tied
LM head is packed too, its embedding then read by rows out of the panels, `rows`: on `smol`'s
tied 49,152 x 576 head, 4 us for 8 tokens against 3 by index_select, 0.46 ms for 512 against
0.02, where the head itself at 8 rows took 3.27 ms against 6.13 on the (3, 8) tiles (medians of
15 alternated calls): `smol`'s decode step at batch 8 19.8 / 18.5 -> 15.4 / 17.0 ms, two
processes of each alternated, read rates flipping between them).
With AVX2: W as [N / 16, K, 16], each panel one contiguous stream with the next one prefetched
a line per k, each x element broadcast against the panel's two vectors into 12 accumulators of
6 rows x 16 outputs (8 loads per 12 FMAs against (1, 8)'s 9 per 8, no horizontal sums), rows in
passes of 6 and the rest (2-4 rows: one pass of 4) over chunks of 128 of K, one row by itself
over all of K, four k at a time (`panel_row`). First measured as a throwaway prototype (AMD
EPYC, AVX2, 2 threads, 2026-12-02, the host in a slow phase; `tiny`'s 33 weights from memory,
best of 7, both on huge pages): 0.84-0.88x the (1, 8) tile's time at 8 rows, 0.80-0.93x at 4, 0.88-0.99x at 1; on
cached weights 85-100 against 64-93 GFLOP/s at 8 rows; passes of 4 + 4 rows (8 accumulators) or
no prefetch: 0.94-1.04x. As built, against the same weights unpacked, alternated in one process
(the host slower still: `tiny`'s batch-1 step 7.5-10.6 ms): the matmuls alone (medians of 6-8
rounds) `tiny` 0.91x the time at 1 row, 0.97x at 4, 0.94x at 8, `smol` 0.96x, 0.81x, 0.94x;
whole decode steps, two engines alternated, `tiny` 0.91x at batch 1 and 0.93x at 8 (every one
of 10 rounds below 1), `smol` 0.99x and 1.01x (6 rounds), a prefill of 4 x 256 tokens 0.82x
and 0.84x; greedy tokens identical. With AVX-512 (panels of 32 outputs, two 16-lane vectors;
an Intel Sapphire Rapids VM, 2 threads, `smol`'s weights, alternated in one process), as built
for AVX2: 1.0x the [N, K] tiles' time at 1 row, 0.92x at 4, 1.30x at 8; with passes of 8 and
12 rows: 0.90-0.95x at 8 rows but 1.06-1.17x at 1 (`tiny` too): not enabled there. On an AMD
EPYC with AVX-512 (Zen 4's cores, 2 threads, 2026-12-04; `tiny`'s 33 weights from memory, medians
of 12 alternated passes in one process, against the same weights [N, K] on their tiles): passes
of up to 8 rows (16 accumulators) 1.0-1.15x the time at 1 row (before `panel_row`: with it
0.67-1.23x, median 0.85, ten processes), 0.64-0.87x at 2, 0.57-0.78x at 4,
0.54-0.73x at 8, 0.70-0.75x at 12-24; a software prefetch of the next panel (as with AVX2) or
512-8,192 floats ahead in the same one cost 1.10-1.28x at 2-8 rows, so none; passes of 12 rows
no better than 8. Whole decode steps (`bench decode-bound`, two processes of each, alternated):
`tiny` at batch 8 6.21-6.25 -> 3.64-3.71 ms, `smol` 26.2-26.3 -> 18.5-18.8, at 32 16.7-17.9 ->
11.9-12.2 and 72-77 -> 58-62, batch 1 as before within the host's two read rates. Past
`max_rows()` the panels stay the kernel's (blocks of 64 rows): `tiny`'s 33 weights at 64 rows
0.80x oneDNN's time on them laid out [N, K], 0.90x at 128, 0.96x at 256, 0.99x at 512 (102-106 G
multiply-adds a second on 2 threads, oneDNN 101-104); the build for AVX2 on the same host, 6-row
passes, 0.74x, 0.99x, 1.06x and 1.08x (against that, the copy to [N, K] per call it made before
took 0.75x, 1.29x, 1.12x and 1.07x).
Not kept, on the same host (2026-12-05, `tiny`'s weights, alternated in one process, each round
set against the read rate measured in it): a software prefetch 4-16 KB ahead in the same panel
(prefetcht0, t1 or nta) took 0.95-0.99x the time at 4-8 rows in the host's ~37 GB/s phase but
0.97-1.09x in its ~67 GB/s one; threads taking panels from a shared counter instead of a
contiguous range each (so that the one that finishes first takes more) made whole decode steps
1.12-1.21x slower taking one or two panels at a time, 1.0-1.07x taking four or eight: each
thread's one sequential stream is what the hardware prefetcher follows best.

Semantics: those of `F.linear` (the reference in `reference.linear`) in fp32, the sums in another
order: equal to it within 1e-5 relative. Built with the other CPU kernels, as one extension
(`cpu_module`, namespace `pn`, before `linear_cpu`'s `lin`, which calls it).
"""

from __future__ import annotations

import torch

from lorafleet.kernels.cpu_module import load  # the CPU kernels' one extension

FUNCTIONS = ["panel_width", "rows"]


def rows(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`w[ids]` for w [N, K] or packed by `pack` (an embedding that is also the LM head): [T, K]."""
    return load().rows(w, ids)


def pack(w: torch.Tensor) -> torch.Tensor:
    """A base weight [N, K] laid out for `linear_cpu.linear` as panels [N / PW, K, PW] (PW: the build's
    `panel_width`), in its own storage: the values move, no memory is added, and the tensor given
    must not be read as [N, K] again. Returned as is where it stays [N, K]: not float32, N not a
    multiple of PW, or a build without panels (AVX-512 on an Intel CPU: they did not pay there)."""
    pw = load().panel_width()
    if not pw or w.dtype != torch.float32 or w.dim() != 2 or w.shape[0] % pw or not w.is_contiguous():
        return w
    n, k = w.shape
    panels = w.view(n // pw, pw, k).transpose(1, 2).contiguous()
    flat = w.view(-1)
    flat.copy_(panels.view(-1))
    return flat.view(n // pw, k, pw)
