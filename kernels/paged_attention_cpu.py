"""The CPU decode attention kernel: one query token per sequence attends to its keys read
straight from the KV pages of the unified pool, with no gathered copy of the context.

Semantics (identical to `reference.paged_decode`): for sequence b and
query head h (kv head h // (H / KVH)), over positions t < lens[b] with
K_t = kv[tables[b, t // block], 0, t % block], V_t likewise at 1:
    out[b, h] = softmax_t(scale * q[b, h] . K_t) @ V_t

Why it exists: the torch path gathers every sequence's context into a padded tensor per layer
per step, which on long contexts costs more than the attention itself (a large share of the
step time in the mixed-lengths profile). Compiled on first use like the LoRA kernel; falls back
to the reference when it cannot be built (an error instead with LORAFLEET_REQUIRE_CPU_KERNELS=1).
LORAFLEET_KERNELS=torch chooses the reference.

Tasks are (sequence, group of kv heads): every kv head of a sequence in one task once the batch
has two sequences per thread, fewer heads per task below that, so that a batch of one still
spreads over the threads. A page holds each token's kv heads side by side ([block, KVH, D]), so
a task over all of them reads whole rows, one stream per page; the first version's tasks were
(sequence, kv head), each reading 256 of every 1,024 bytes of a row (`tiny`'s 4 kv heads of 64),
slower for batches of several sequences. Most of a decode call is waiting for its pages (the
same rows merely summed, without the attention, take most of its time). So the next page's rows
are asked for a few at a time while this page's are computed (`prefetch_rows4`): faster than
asking for the whole next page at once, in fp32 and bf16, and in whole `tiny` decode steps.

The softmax runs on whole vectors (a head's scores padded to them, the padding masked out of the
sum), where each score past the last whole vector took a scalar exp; the values pass keeps
blocks of four of each head's output vectors in registers across a page's rows, where four rows
at a time went through memory (each output vector a chain of loads and stores). Faster with the
caches warm and in whole `tiny` decode steps; with the caches flushed the pages' latency hides
the difference (asking for the next page's rows further ahead, or for a page's V rows during its
K rows, did not move it). Tried: one pass per page (its scores, an online softmax, its values,
the page's V rows asked for during its K rows); within the noise, not kept.

q is read where the qkv projection left it: rows strided, each row's heads side by side (the
decode driver copied it before, a copy and an allocation a layer; whole steps did not change
measurably without it).

float32 and bfloat16 (q, the pool and the output in one dtype): scores, softmax and the output
sums in fp32, each output element rounded once. Before, a bf16 pool went to the torch reference,
which gathers the context and ran several times slower than this kernel.
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
