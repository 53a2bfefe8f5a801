"""The CPU decode attention kernel: one query token per sequence attends to its keys read straight from the
KV pages of the unified pool (the torch reference's gathered copy of the context costs more than the
attention itself on long contexts).

Semantics (`reference.paged_decode`'s): for sequence b and query head h (kv head h // (H / KVH)), over
positions t < lens[b] with K_t = kv[tables[b, t // block], 0, t % block], V_t likewise at 1:
    out[b, h] = softmax_t(scale * q[b, h] . K_t) @ V_t
float32 or bfloat16 (q, the pool and the output in one dtype): scores, softmax and output sums in fp32, each
output element rounded once. q is read in place, rows strided as a view of the qkv projection's may be.

Decisions, each with its reason (the loops' in `cpu/paged_attention.cpp`):
- Tasks are (sequence, group of kv heads): a page holds a token's kv heads side by side ([block, KVH, D]), so
  a task over all of them streams whole rows; fewer heads a task only below two sequences per thread, so that
  a batch of one still spreads over the threads.
- The next page's rows are asked for a few at a time while this page's are computed (`prefetch_rows4`): a
  call mostly waits for its scattered pages, and spread requests beat a whole page asked for at once.
Compiled on first use in the CPU kernels' one extension (`cpu_module`), the reference serving where it cannot
be (an error with LORAFLEET_REQUIRE_CPU_KERNELS=1). LORAFLEET_KERNELS=torch chooses the reference.
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
