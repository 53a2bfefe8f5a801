"""Torch references for every kernel: the path where no compiled kernel serves, and the oracle
the C++ CPU kernels (`*_cpu.py`) and the Triton kernels (`*_triton.py`) are tested against. Each function states its exact
semantics; shapes are in the comments.

Paged KV layout (one layer's view of the unified pool): kv[page, 0|1, slot, kv_head, dim], K at
0 and V at 1; a sequence's token at position p lives in page block_table[p // block] at slot
p % block.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [T, H], computed in fp32 whatever the dtype (as the reference
    implementation does), rounded to the dtype before the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The residual add, in place (x += delta, [T, H]), then `rms_norm(x)`."""
    x.add_(delta)
    return rms_norm(x, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D] (rotate-half layout, as Hugging Face checkpoints use)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    """Rotary embedding of q [T, H, D] and k [T, KH, D] in place, row t at positions[t], from the
    tables cos/sin [max positions, D]."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q.copy_(apply_rope(q, c, s))
    k.copy_(apply_rope(k, c, s))


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation: gu [T, 2I] -> silu(gu[:, :I]) * gu[:, I:] [T, I]."""
    inter = gu.shape[1] // 2
    return F.silu(gu[:, :inter]) * gu[:, inter:]


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V] float32 -> (each row's first index of its largest value [S] int64, whether
    every value of the row is finite [S] bool; a non-finite row's index is meaningless)."""
    return torch.argmax(logits, dim=-1), torch.isfinite(logits).all(-1)


def rows(w: torch.Tensor, ids: torch.Tensor, scales: torch.Tensor | None = None,
         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The embedding's rows for token ids [T]: w [V, H] -> [T, H]; a quantized embedding (codes w,
    `scales`: `lorafleet.model.quant`'s layout) gives its rows dequantized, in `dtype`."""
    if scales is not None:
        return dequantize(w, scales, dtype, rows=ids)
    return w[ids]


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           scales: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """A base projection: x [T, K] @ w[N, K]^T (+ bias [N]) -> [T, N], torch's GEMM. Quantized
    (`scales` given, w the codes: `lorafleet.model.quant`'s layout; `offsets` too for a GGUF
    file's affine types): the weight dequantized in x's dtype (`dequantize`), then the same GEMM."""
    if scales is not None:
        w = dequantize(w, scales, x.dtype, offsets=offsets)
    return F.linear(x, w, bias)


def codes(q: torch.Tensor) -> torch.Tensor:
    """A quantized weight's codes as signed integers, int8 [N, K]: int8 codes as they are; int4
    (uint8 [N, K / 2], in each run of 32 elements byte i holding element i in its low nibble and
    i + 16 in its high one) unpacked, 8 taken off."""
    if q.dtype == torch.int8:
        return q
    n = q.shape[0]
    b = q.view(n, -1, 16)
    lo, hi = (b & 15).to(torch.int8) - 8, (b >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], 2).view(n, -1)


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
               rows: slice | torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """A quantized weight's full-precision values [N, K] (or those of its `rows`) in `dtype`: each
    code times its group's scale (scales [N, K / G], one per G elements), plus its group's offset
    where there are `offsets` (float32 [N, K / G]), in fp32, rounded once. The oracle every
    quantized kernel is tested against."""
    if rows is not None:
        q, scales = q[rows], scales[rows]
        offsets = None if offsets is None else offsets[rows]
    c = codes(q).float()
    n, k = c.shape
    g = k // scales.shape[1]
    v = c.view(n, -1, g) * scales.float()[..., None]
    if offsets is not None:
        v = v + offsets[..., None]
    return v.view(n, k).to(dtype)


@dataclass
class PrefillSeq:
    """A sequence contributing `num_tokens` (> 1) query rows, starting at flat row `row` and at
    position `start_pos`; its keys span positions [0, start_pos + num_tokens)."""

    row: int
    num_tokens: int
    start_pos: int
    block_table: torch.Tensor  # [blocks] long
    _mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def mask(self) -> torch.Tensor:
        """[n, start_pos + n] bool, True = attend: the causal mask over cached + new keys, built
        on first use and kept for the step (once per step, not once per layer; never on the
        Triton path, which masks inside its kernel). Only for start_pos > 0."""
        if self._mask is None:
            ctx, dev = self.start_pos + self.num_tokens, self.block_table.device
            qpos = torch.arange(self.start_pos, ctx, device=dev).unsqueeze(1)
            self._mask = torch.arange(ctx, device=dev).unsqueeze(0) <= qpos
        return self._mask


class Layer(NamedTuple):
    """One decoder layer's tensors, the schema every forward reads (None where the family has
    none: biases, q/k norms). The C++ driver's field indices are generated from this table at
    build (`cpu_module.schema`): a field added here reaches it without a second copy."""
    in_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_b: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_b: torch.Tensor | None
    down: torch.Tensor
    down_b: torch.Tensor | None
    qkv_s: torch.Tensor | None = None      # a quantized projection's scales (its codes in the field above)
    o_s: torch.Tensor | None = None
    gate_up_s: torch.Tensor | None = None
    down_s: torch.Tensor | None = None
    qkv_o: torch.Tensor | None = None      # a GGUF file's affine types: each group's offset (else None)
    o_o: torch.Tensor | None = None
    gate_up_o: torch.Tensor | None = None
    down_o: torch.Tensor | None = None


# The projection groups LoRA applies to, in row-table order, each with its modules (a row table's
# slots); the C++ driver's slot counts are generated from it (`cpu_module.schema`).
GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class DecodeWeights(NamedTuple):
    """What a decode step's one-call forward (`Kernels.decode_forward`) reads of the model: its
    tensors and numbers, never the model itself. `layers`: every `Layer`'s fields, flattened."""
    embed: torch.Tensor
    embed_s: torch.Tensor | None
    layers: list
    norm: torch.Tensor
    lm_head: torch.Tensor
    lm_head_s: torch.Tensor | None
    lm_head_o: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    scale: float
    eps: float
    heads: int
    kv_heads: int
    head_dim: int


@dataclass
class AttentionMetadata:
    """Built once per step by the runner, shared by every layer.

    Rows [0, num_decode) are single-token queries (decode, or a one-token chunk), attending to
    `decode_context_lens[i]` keys through `decode_block_tables[i]`; the remaining rows belong to
    the `prefills`, in order, described twice: as `PrefillSeq`s (the per-sequence torch path) and
    as tensors (`prefill_*`, the one-launch Triton path).
    """

    slot_pages: torch.Tensor            # [T] long: page receiving each token's K/V
    slot_offsets: torch.Tensor          # [T] long: slot inside that page
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [Bd, maxb] long (padding: any valid page)
    decode_context_lens: torch.Tensor | None = None  # [Bd] long
    prefills: list[PrefillSeq] = field(default_factory=list)
    prefill_starts: torch.Tensor | None = None       # [Sp] long: first flat row of each prefill
    prefill_lens: torch.Tensor | None = None         # [Sp] long: its query rows
    prefill_positions: torch.Tensor | None = None    # [Sp] long: position of its first row
    prefill_block_tables: torch.Tensor | None = None  # [Sp, maxb] long (padding: any valid page)
    max_prefill_len: int = 0


def write_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_pages: torch.Tensor,
             slot_offsets: torch.Tensor) -> None:
    """kv[slot_pages[t], 0, slot_offsets[t]] = k[t]; same for v at 1.  kv: [P, 2, B, KVH, D]."""
    idx = (slot_pages, slot_offsets)
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


def paged_decode(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Semantics: for sequence b and query head h (kv head h // (H / KVH)), over positions
    t < lens[b] with K_t = kv[tables[b, t // block], 0, t % block] and V_t likewise at 1:
        out[b, h] = softmax_t(scale * q[b, h] . K_t) @ V_t
    q: [B, H, D]; tables: [B, maxb] long; lens: [B] long (>= 1). Returns [B, H, D]. (A padded
    gather of every context and a mask: the simple form the kernels are checked against.)"""
    keys, values = gather_kv(kv, tables)                            # [B, KVH, S, D]
    mask = (torch.arange(keys.shape[2], device=q.device) < lens[:, None])[:, None, None, :]
    # a page's slots past a sequence's end hold whatever the page held before (another
    # sequence's KV, an adapter's weights or row table, whose int64 fields may read as NaN):
    # zeroed, since a masked score still multiplies its value (0 * NaN is NaN)
    valid = mask.transpose(2, 3)                                    # [B, 1, S, 1]
    keys, values = keys.masked_fill(~valid, 0), values.masked_fill(~valid, 0)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale,
                                       enable_gqa=True)
    return o.squeeze(2)


def paged_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                  meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """Semantics: for each prefill sequence, causal attention of its query rows (positions
    start_pos ..) over its keys at positions [0, start_pos + n), the cached ones read from its
    pages; written into `out` [T, H, D] at its rows. One SDPA call per sequence."""
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


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of every query row over its own sequence's keys, with this step's K/V
    first written into the pages.  q: [T, H, D]; k, v: [T, KVH, D]; kv: [P, 2, B, KVH, D].
    Returns [T, H*D]. (The three reference ops in sequence; `kernels.backend.Kernels.attention`
    composes each backend's own.)"""
    write_kv(kv, k, v, meta.slot_pages, meta.slot_offsets)
    t, h, d = q.shape
    out = q.new_empty(t, h, d)
    nd = meta.num_decode
    if nd:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None  # set with decode rows
        out[:nd] = paged_decode(q[:nd], kv, meta.decode_block_tables, meta.decode_context_lens, scale)
    paged_prefill(q, k, v, kv, meta, scale, out)
    return out.view(t, h * d)


# -- LoRA through row tables ----------------------------------------------------------------------
# The contract every LoRA kernel keeps (torch reference below, C++ in `lora_cpu.py`, Triton in
# `lora_triton.py`):
#   w       the pool as one flat tensor [pages * E] (fp32, bf16 or fp16), also read as int64 (its
#           bytes, `as_int64(w)`): the adapters' row tables live in their own pages
#   x       [T, in] the group's input; out [T, N] the group's fused projection output (in place)
#   seg     [S, SEG_FIELDS] int64 (start, end, table, scale, mix): rows [start, end) of the flat
#           batch (end >= start, may be empty) use the adapter whose row table starts at int64
#           index `table` of w, its delta multiplied by `scale` (the bits of an fp32: `scale_bits`;
#           1.0 for a request on one adapter). A *mix* (a request on several adapters) is a run of
#           consecutive segments over the same rows: `mix` is n >= 1 on the first of a run of n
#           (1: a segment alone) and -j on its j-th follower (j = 1 .. n-1). The deltas of a
#           mix's segments are summed in fp32 and join `out` once (one rounding), as one adapter
#           whose rank rows are the members' side by side, each member's scaled: the "cat"
#           combination of PEFT's `add_weighted_adapter`, without building it.
#   entry   the int64 offset, inside a row table, of the group's first module slot in this layer;
#           `slots` module slots (the group's own) follow, TABLE_FIELDS apart
# A row table (built when the adapter's pages are assigned: `adapters/layout.py`) holds per (layer,
# group, slot) the fields (r, n_out, col, a_rows, b_rows, g_row, c_row): r == 0 when the adapter
# lacks that module; a_rows and b_rows are the int64 indices of r row pointers each, pool element
# offsets: A's row k ([in]) starts at a_rows' pointer k, Bt = (scale * B)^T's row k ([n_out]) at
# b_rows'. g_row and c_row, -1 for a plain module, are the pool element offsets of two rows of
# n_out, the module's *epilogue* (DoRA's magnitude over the row norms and the base bias it keeps;
# PEFT's lora_bias): on a lone segment (mix 1) the module's output becomes
#     out[i, col : col + n_out] = g * (out[i, ...] + delta) + c
# in fp32, rounded once. In a mix of several it is never read (the engine mixes no such adapter,
# nor gives one a scale other than 1).
# Every row lies inside one page and starts at a multiple of ROW_ALIGN elements, so a kernel reads
# whole rows as contiguous vectors, wherever the adapter's pages are, with no per-element page
# arithmetic.
TABLE_FIELDS = 7
ROW_ALIGN = 16
SEG_FIELDS = 5  # (start, end, table, scale, mix): see the contract above


def scale_bits(scale: float) -> int:
    """A segment's `scale` field: the bit pattern of `scale` as an fp32 (what every kernel reads)."""
    return struct.unpack("<I", struct.pack("<f", scale))[0]


def seg_scale(bits: int) -> float:
    """The fp32 a segment's `scale` field holds."""
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def as_int64(w: torch.Tensor) -> torch.Tensor:
    """The flat pool's bytes as int64 (a view: the row tables are read through it)."""
    return w.view(torch.int64)


def lora_entry(layer: int, group: int, groups: int, slots: int) -> int:
    """`entry` for module slot 0 of `group` in `layer`: tables are [layers, groups, slots, fields]."""
    return ((layer * groups + group) * slots) * TABLE_FIELDS


def lora(x: torch.Tensor, out: torch.Tensor, w: torch.Tensor, seg: torch.Tensor, entry: int, slots: int) -> None:
    """Semantics: for every mix (a run of segments, `mix` n >= 1 then its n-1 followers), row i in
    [start, end) and module slot m < slots:
        out[i, col : col + n_out] += sum over the mix's segments s whose field r > 0 in the table
                                     at seg[s, 2] of scale(s) * (x[i] @ A_m(s)^T) @ Bt_m(s)
    accumulated in fp32 and rounded once to out's dtype; a lone segment's slot with an epilogue
    (g_row >= 0) gives g * (out + delta) + c instead. Rows in no segment are untouched: a request
    without an adapter pays nothing."""
    wi = as_int64(w)
    fin = x.shape[1]
    rows = seg.tolist()
    for s, (start, end, _, _, n) in enumerate(rows):
        if n < 1 or end <= start:  # a follower (its lead sums it), or an empty run
            continue
        xs = x[start:end].float()
        for m in range(slots):
            delta = post = None
            for _, _, table, bits, _ in rows[s:s + n]:
                fields = wi[table + entry + m * TABLE_FIELDS:][:TABLE_FIELDS].tolist()
                r, n_out, c, a_rows, b_rows, g_row, c_row = fields
                if r == 0:
                    continue
                col = c  # the same for every member that has the module (one base)
                if n == 1 and g_row >= 0:
                    post = (g_row, c_row, n_out)
                a = w[wi[a_rows:a_rows + r, None] + torch.arange(fin, device=w.device)].float()       # [r, in]
                bt = w[wi[b_rows:b_rows + r, None] + torch.arange(n_out, device=w.device)].float()    # [r, n_out]
                d = ((xs @ a.t()) * seg_scale(bits)) @ bt
                delta = d if delta is None else delta + d
            if delta is not None:
                o = out[start:end, col:col + delta.shape[1]]
                y = o.float() + delta
                if post is not None:  # the epilogue of a lone segment
                    g_row, c_row, n_out = post
                    y = w[g_row:g_row + n_out].float() * y + w[c_row:c_row + n_out].float()
                o.copy_(y.to(out.dtype))
