"""Torch references for every kernel: the CPU path where no compiled kernel serves, and the
oracle the compiled CPU kernels (`*_cpu.py`) are tested against. Each function states its exact
semantics; shapes are in the comments.

Paged KV layout (one layer's view of the unified pool): kv[page, 0|1, slot, kv_head, dim], K at
0 and V at 1; a sequence's token at position p lives in page block_table[p // block] at slot
p % block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    """A sequence contributing `num_tokens` (> 1) query rows, starting at flat row `row` and at
    position `start_pos`; its keys span positions [0, start_pos + num_tokens)."""

    row: int
    num_tokens: int
    start_pos: int
    block_table: torch.Tensor  # [blocks] long
    mask: torch.Tensor | None = None  # [n, start_pos + n] bool, True = attend; None when start_pos == 0

    def __post_init__(self):
        """The causal mask over cached + new keys, built once per step (not once per layer)."""
        if self.start_pos and self.mask is None:
            ctx, dev = self.start_pos + self.num_tokens, self.block_table.device
            qpos = torch.arange(self.start_pos, ctx, device=dev).unsqueeze(1)
            self.mask = torch.arange(ctx, device=dev).unsqueeze(0) <= qpos


@dataclass
class AttentionMetadata:
    """Built once per step by the runner, shared by every layer.

    Rows [0, num_decode) are single-token queries (decode, or a one-token chunk), attending to
    `decode_context_lens[i]` keys through `decode_block_tables[i]`; the remaining rows belong to
    the `prefills`, in order.
    """

    slot_pages: torch.Tensor            # [T] long: page receiving each token's K/V
    slot_offsets: torch.Tensor          # [T] long: slot inside that page
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [Bd, maxb] long (padding: any valid page)
    decode_mask: torch.Tensor | None = None          # [Bd, 1, 1, maxb*block] bool, True = attend
    decode_context_lens: torch.Tensor | None = None  # [Bd] long
    decode_kernel: bool = False                      # use the CPU paged-decode kernel
    prefills: list[PrefillSeq] = field(default_factory=list)


def write_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """kv[slot_pages[t], 0, slot_offsets[t]] = k[t]; same for v at 1.  kv: [P, 2, B, KVH, D]."""
    idx = (meta.slot_pages, meta.slot_offsets)
    kv[:, 0].index_put_(idx, k)
    kv[:, 1].index_put_(idx, v)


def gather_kv(kv: torch.Tensor, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """block_tables [N, nb] -> keys, values [N, KVH, nb*B, D] in position order."""
    n, nb = block_tables.shape
    _, _, block, kvh, d = kv.shape
    pages = kv[block_tables]                               # [N, nb, 2, B, KVH, D]
    k = pages[:, :, 0].reshape(n, nb * block, kvh, d).transpose(1, 2)
    v = pages[:, :, 1].reshape(n, nb * block, kvh, d).transpose(1, 2)
    return k, v


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of every query row over its own sequence's keys, with this step's K/V
    first written into the pages.  q: [T, H, D]; k, v: [T, KVH, D]; kv: [P, 2, B, KVH, D].
    Returns [T, H*D]."""
    write_kv(kv, k, v, meta)
    t, h, d = q.shape
    out = q.new_empty(t, h, d)
    nd = meta.num_decode
    if nd and meta.decode_kernel:  # reads the pages in place (kernels/paged_attention_cpu.py)
        from lorafleet.kernels.paged_attention_cpu import paged_decode
        out[:nd] = paged_decode(q[:nd], kv, meta.decode_block_tables, meta.decode_context_lens, scale)
    elif nd:
        keys, values = gather_kv(kv, meta.decode_block_tables)       # [Bd, KVH, S, D]
        o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), keys, values,
                                           attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
        out[:nd] = o.squeeze(2)                                      # [Bd, H, D]
    for seq in meta.prefills:
        rows = slice(seq.row, seq.row + seq.num_tokens)
        qs = q[rows].transpose(0, 1).unsqueeze(0)                    # [1, H, n, D]
        if seq.start_pos == 0:  # nothing cached before: attend to this step's own keys
            ks = k[rows].transpose(0, 1).unsqueeze(0)
            vs = v[rows].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            ctx = seq.start_pos + seq.num_tokens
            ks, vs = gather_kv(kv, seq.block_table.unsqueeze(0))
            ks, vs = ks[:, :, :ctx], vs[:, :, :ctx]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seq.mask, scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out.view(t, h * d)


# -- LoRA ------------------------------------------------------------------------------------

@dataclass
class LoraSegment:
    """Rows [start, end) of the flat batch use one adapter. For one projection group (modules
    sharing an input, e.g. q/k/v), `a` stacks the A matrices of the modules the adapter targets,
    [sum r_m, in]; `bs[j]` = (output column of module m, row offset of r_m in `a`, Bt_m), where
    Bt_m = (scale * B_m)^T, [r_m, out_m]."""

    start: int
    end: int
    a: torch.Tensor
    bs: list[tuple[int, int, torch.Tensor]]


def lora_shrink_expand(x: torch.Tensor, out: torch.Tensor, segments: list[LoraSegment]) -> None:
    """Semantics: for every segment s, every row i in it, every module m that s targets:
        out[i, col_m : col_m + out_m] += (A_m(s) @ x[i]) @ Bt_m(s)
    x: [T, in]; out: [T, sum out_m], the group's fused projection output, updated in place.
    Rows in no segment are untouched: a request without an adapter pays nothing.
    The shrink of all modules of a group is one matmul (`a` stacks them); each expand is one
    matmul accumulated into its output columns."""
    for seg in segments:
        t = x[seg.start:seg.end] @ seg.a.t()                          # [n, sum r_m]
        for col, off, bt in seg.bs:
            r, n_out = bt.shape
            o = out[seg.start:seg.end, col:col + n_out]
            o.addmm_(t[:, off:off + r], bt)                           # [n, out_m] += [n, r] @ [r, out_m]
