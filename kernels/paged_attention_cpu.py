"""The CPU decode attention kernel: one query token per sequence attends to its keys read
straight from the KV pages of the unified pool, with no gathered copy of the context.

Semantics (identical to `reference.paged_decode`): for sequence b and
query head h (kv head h // (H / KVH)), over positions t < lens[b] with
K_t = kv[tables[b, t // block], 0, t % block], V_t likewise at 1:
    out[b, h] = softmax_t(scale * q[b, h] . K_t) @ V_t

Why it exists: the torch path gathers every sequence's context into a padded tensor per layer
per step, which on long contexts costs more than the attention itself (40% of the step time in
the mixed-lengths profile). Compiled on first use like the LoRA kernel; falls back to the
reference when it cannot be built (an error instead with LORAFLEET_REQUIRE_CPU_KERNELS=1).
LORAFLEET_KERNELS=torch chooses the reference.

Tasks are (sequence, group of kv heads): every kv head of a sequence in one task once the batch
has two sequences per thread, fewer heads per task below that, so that a batch of one still
spreads over the threads. A page holds each token's kv heads side by side ([block, KVH, D]), so
a task over all of them reads whole rows, one stream per page; the first version's tasks were
(sequence, kv head), each reading 256 of every 1,024 bytes of a row (`tiny`'s 4 kv heads of 64).
Measured on an AMD EPYC (AVX2, 2 threads), one layer's call with the caches flushed before it,
tiny's shapes, pages scattered over a 1 GiB pool, old and new alternated (best of 3): 8
sequences of 96 tokens 177 -> 148 us, 8 of 32 72 -> 62 us, 32 of 100 707 -> 580 us, one of 96
unchanged (38 us). The same rows merely summed, without the attention, took 123 us per kv head
and 82 us by whole rows: most of a decode call is waiting for its pages. So the next page's
rows are asked for a few at a time while this page's are computed (`prefetch_rows4`): one
layer's call after 14 MB of other reads (a layer's weights, as in a step), v8 (the whole next
page asked for at once) against v9, best of 4 alternated: fp32 8 sequences of 96 tokens 83 ->
72 us, 8 of 470 572 -> 483 us, one of 2,000 274 -> 224 us; bf16 8 of 470 432 -> 332 us. Whole
`tiny` decode steps, alternated: 8 sequences of 470 tokens 0.95x the time, of 64 0.985x.

The softmax runs on whole vectors (a head's scores padded to them, the padding masked out of the
sum), where each score past the last whole vector took a scalar exp; the values pass keeps
blocks of four of each head's output vectors in registers across a page's rows, where four rows
at a time went through memory (each output vector a chain of loads and stores). On the AMD EPYC
with AVX-512 (2026-12-05), one layer's call for 8 sequences of 76 tokens (`tiny`'s heads): one
thread, caches warm, 64-67 -> 54-57 us; caches flushed, 2 threads, 82-105 us either way (the
pages' latency: asking for the next page's rows further ahead, or for a page's V rows during
its K rows, did not move it). Whole `tiny` decode steps at batch 8 over contexts of 64-128
tokens, two processes alternated five times: 4.21-4.29 -> 4.14-4.25 ms, every round lower (in six
more rounds 4.10-4.24 -> 4.06-4.23, five lower); over contexts of 448-512 tokens, four rounds,
7.07-7.16 -> 6.74-7.14 ms. One pass per page instead (its scores, an online softmax, its values,
the page's V rows asked for during its K rows) ran within the noise of these two (4.06-4.38 ms
in the same six rounds): not kept.

q is read where the qkv projection left it: rows strided, each row's heads side by side (the
decode driver copied it before, a 16 KB copy and allocation a layer for 8 rows of `tiny`; whole
steps alternated with and without the copy differed within the noise, 0.99-1.01x).

float32 and bfloat16 (q, the pool and the output in one dtype): scores, softmax and the output
sums in fp32, each output element rounded once. Before, a bf16 pool went to the torch reference,
which gathers the context and ran at ~1/8 of this kernel's speed (8 sequences of 96 tokens, one
layer, caches flushed: 1,048 us against 133; bf16 decode steps on `tiny`, AMD EPYC: batch 1
7.0 -> 5.4 ms, batch 8 16.6 -> 8.4 ms, reference and kernel alternated in one process).
"""

from __future__ import annotations

import torch

from lorafleet.kernels.cpu_module import load  # the CPU kernels' one extension

FUNCTIONS = ["paged_decode"]


def paged_decode(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """q: [B, H, D] (its rows may be strided, as a view of the qkv projection's are); kv: [P, 2,
    block, KVH, D] (one layer's view of the pool), one dtype, float32 or bfloat16; tables: [B, maxb]
    long; lens: [B] long (>= 1). Returns [B, H, D] in q's dtype."""
    if q.stride(2) != 1 or q.stride(1) != q.size(2):  # the kernel reads each row's heads side by side
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    load().paged_decode(q, kv, tables, lens, scale, out)
    return out
