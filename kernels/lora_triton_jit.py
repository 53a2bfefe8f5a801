"""The GPU LoRA op's Triton kernels: the "split" design's shrink and expand, the "fused" design's
one kernel, and the device helpers they share. What they compute, the two designs and why their
loops are shaped as they are: `lora_triton.py`, which launches them."""

from __future__ import annotations

import triton
import triton.language as tl

from lorafleet.kernels.reference import ROW_ALIGN, SEG_FIELDS, TABLE_FIELDS

MIX_HEAD = 4  # "split": a mix's list (per lead and slot) is its rank, n_out, col, a pad, then its Bt rows

_ALIGN = tl.constexpr(ROW_ALIGN)
_SEG = tl.constexpr(SEG_FIELDS)
_FIELDS = tl.constexpr(TABLE_FIELDS)
_HEAD = tl.constexpr(MIX_HEAD)


@triton.jit
def _slot(seg_ptr, ENTRY, M, BLOCK_M: tl.constexpr):
    """This program's segment s and slot m (axis 0 is s * M + m), its rows [row0, end) (axis 1
    picks the row block) and the offset in a row table of the slot's fields (r, n_out, col,
    a_rows, b_rows, g_row, c_row)."""
    pid = tl.program_id(0)
    s = pid // M
    m = pid % M
    row0 = tl.load(seg_ptr + _SEG * s) + tl.program_id(1) * BLOCK_M
    end = tl.load(seg_ptr + _SEG * s + 1)
    return s, m, row0, end, ENTRY + m * _FIELDS


@triton.jit
def _fields(seg_ptr, wi_ptr, p, f):
    """The address of segment p's slot fields: offset f in the row table at seg[p, 2]."""
    return wi_ptr + tl.load(seg_ptr + _SEG * p + 2) + f


@triton.jit
def _scale(seg_ptr, p):
    """Segment p's scale: the fp32 whose bits its int64 field holds."""
    return tl.load(seg_ptr + _SEG * p + 3).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _shrink_tile(x_ptr, w_ptr, aptr, rows, rmask, kmask, c_lo, c_hi, IN, stride_x,
                 UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """t[i, k] = x[rows[i], c_lo:c_hi] . A_row_k[c_lo:c_hi] (fp32), A's rows at element offsets aptr."""
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for c0 in range(c_lo, c_hi, BLOCK_K):
        cols = c0 + tl.arange(0, BLOCK_K)
        cmask = cols < IN
        xt = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :],
                     mask=rmask[:, None] & cmask[None, :], other=0.0)
        # A^T tile [BLOCK_K, BLOCK_R]: rank row k's elements c0.. are contiguous from aptr[k]
        at = tl.load(w_ptr + aptr[None, :] + cols[:, None], mask=cmask[:, None] & kmask[None, :], other=0.0)
        if UPCAST:
            acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xt, at)
    return acc


@triton.jit
def _row_ptrs(list_ptr, at, kmask):
    """Element offsets of rank rows whose pointers are at indices `at` (a vector) of list_ptr."""
    return tl.multiple_of(tl.load(list_ptr + at, mask=kmask, other=0), _ALIGN)


@triton.jit
def shrink_kernel(x_ptr, w_ptr, wi_ptr, t_ptr, mix_ptr, seg_ptr, ENTRY, M, IN, stride_x, T, RMAX, RANK_BLOCKS,
                   UPCAST: tl.constexpr, K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    s, m, row0, end, f = _slot(seg_ptr, ENTRY, M, BLOCK_M)
    n = tl.load(seg_ptr + _SEG * s + 4)
    if (row0 >= end) | (n < 1):  # a follower's rank rows are its lead's programs'
        return
    pid = tl.program_id(2)
    k0 = (pid % RANK_BLOCKS) * BLOCK_R
    split = pid // RANK_BLOCKS
    # the mix as one adapter, its members' rank rows side by side, shrunk by its lead's programs:
    # each block of t starts aligned (a follower's programs storing at its offset in the mix made
    # the stores scalar: far more registers). Rank row k's A and Bt pointers and scale are those
    # of the member whose rows hold k.
    ks = k0 + tl.arange(0, BLOCK_R)
    a_at = tl.zeros([BLOCK_R], tl.int64)
    b_at = tl.zeros([BLOCK_R], tl.int64)
    scale = tl.zeros([BLOCK_R], tl.float32)
    off = tl.zeros([], tl.int64)
    n_out = tl.zeros([], tl.int64)
    col = tl.zeros([], tl.int64)
    for p in range(s, s + n):
        fields = _fields(seg_ptr, wi_ptr, p, f)
        rank = tl.load(fields)
        mine = (ks >= off) & (ks < off + rank)
        a_at = tl.where(mine, tl.load(fields + 3, mask=rank > 0, other=0) - off + ks, a_at)
        b_at = tl.where(mine, tl.load(fields + 4, mask=rank > 0, other=0) - off + ks, b_at)
        scale = tl.where(mine, _scale(seg_ptr, p), scale)
        off += rank
        n_out = tl.maximum(n_out, tl.load(fields + 1, mask=rank > 0, other=0))  # a member without the
        col = tl.maximum(col, tl.load(fields + 2, mask=rank > 0, other=0))      # slot has zeros there
    r = tl.minimum(off, RMAX)  # a max_rank below the true rank: wrong, never out of bounds
    head = mix_ptr + (s * M + m) * (_HEAD + RMAX)
    first = tl.program_id(1) == 0
    if first & (pid == 0):  # the expand's: the mix's rank, n_out, col
        tl.store(head, r)
        tl.store(head + 1, n_out)
        tl.store(head + 2, col)
    if k0 >= r:
        return
    kmask = ks < r
    if first & (split == 0):  # the expand's: the mix's Bt row pointers
        tl.store(head + _HEAD + ks, tl.load(wi_ptr + b_at, mask=kmask), mask=kmask)
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < end
    c_lo = split * K_SPLIT
    acc = _shrink_tile(x_ptr, w_ptr, _row_ptrs(wi_ptr, a_at, kmask), rows, rmask, kmask, c_lo,
                       tl.minimum(c_lo + K_SPLIT, IN), IN, stride_x, UPCAST, BLOCK_M, BLOCK_K, BLOCK_R)
    acc *= scale[None, :]  # the scale on the shrink, as the reference: r products per row, not n_out
    tptr = t_ptr + ((split * T + rows[:, None].to(tl.int64)) * M + m) * RMAX + ks[None, :]
    tl.store(tptr, acc, mask=rmask[:, None] & kmask[None, :])


@triton.jit
def _post(seg_ptr, wi_ptr, s, f):
    """The epilogue's rows (g_row, c_row) of segment s's slot at f if s is a lone segment (mix 1),
    else (-1, -1): a mix's members' epilogues are never read. Loaded once the tile is summed, so
    no register holds them across the rank loop."""
    lone = tl.load(seg_ptr + _SEG * s + 4) == 1
    fields = wi_ptr + tl.load(seg_ptr + _SEG * s + 2) + f
    return tl.load(fields + 5, mask=lone, other=-1), tl.load(fields + 6, mask=lone, other=-1)


@triton.jit
def _add_out(out_ptr, acc, rows, rmask, col, ns, nmask, stride_out, w_ptr, g_row, c_row, bmask,
             OUT_ALIGN: tl.constexpr):
    """out[rows, col + ns] = g * (out + acc) + c in fp32, one rounding to out's dtype: with an
    epilogue (g_row >= 0) g and c over the tile's columns, read as Bt's rows are (up to n_out
    rounded up to ROW_ALIGN), else g = 1 and c = 0 (loads masked off), i.e. out + acc. col is
    rounded down to OUT_ALIGN, which divides it: the compiler then knows out's rows are read and
    written in aligned vectors (a `tl.multiple_of` on the loaded scalar did not reach them)."""
    optr = out_ptr + rows[:, None].to(tl.int64) * stride_out + col // OUT_ALIGN * OUT_ALIGN + ns[None, :]
    omask = rmask[:, None] & nmask[None, :]
    y = tl.load(optr, mask=omask, other=0.0).to(tl.float32) + acc
    # masked loads rather than a branch on g_row: the branch made ptxas spill in the prefill expand
    post = g_row >= 0
    pmask = tl.where(post, bmask, False)  # not bmask & post: the interpreter makes that an int64 mask
    g = tl.load(w_ptr + tl.multiple_of(tl.where(post, g_row, 0), _ALIGN) + ns, mask=pmask, other=1.0)
    c = tl.load(w_ptr + tl.multiple_of(tl.where(post, c_row, 0), _ALIGN) + ns, mask=pmask, other=0.0)
    y = g.to(tl.float32)[None, :] * y + c.to(tl.float32)[None, :]
    tl.store(optr, y.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _out_tile(row0, end, n_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, OUT_ALIGN: tl.constexpr):
    """An expand (or fused) program's output tile: whether it has columns (below n_out), its
    rows and columns, their masks, and `bmask`, the columns of Bt it reads: up to n_out rounded
    up to ROW_ALIGN (the padding is inside the row's aligned stride, in its page), a mask
    constant over each aligned vector, so the compiler issues 16-byte loads; the columns past
    n_out are never stored. n_out is rounded down to OUT_ALIGN, which divides it, for the same
    reason in out's mask (`_add_out`)."""
    n0 = tl.program_id(2) * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_M)
    ns = n0 + tl.arange(0, BLOCK_N)
    bmask = ns < (n_out + _ALIGN - 1) // _ALIGN * _ALIGN
    return n0 < n_out, rows, rows < end, ns, ns < n_out // OUT_ALIGN * OUT_ALIGN, bmask


@triton.jit
def _times_bt(acc, t, w_ptr, list_ptr, b_at, kmask, ns, bmask):
    """acc + t @ Bt[ks, ns] (fp32), Bt's rows through their pointers at indices b_at of list_ptr."""
    bptr = _row_ptrs(list_ptr, b_at, kmask)
    bt = tl.load(w_ptr + bptr[:, None] + ns[None, :], mask=kmask[:, None] & bmask[None, :], other=0.0)
    return acc + tl.dot(t, bt.to(tl.float32), input_precision="ieee")


@triton.jit
def expand_kernel(t_ptr, mix_ptr, w_ptr, wi_ptr, out_ptr, seg_ptr, ENTRY, M, SPLITS, stride_out, T, RMAX,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, OUT_ALIGN: tl.constexpr):
    # a mix as one adapter: the shrink listed its rank, n_out, col and its members' Bt rows side
    # by side for its lead. No loop over the members here: any loop besides the rank loop made
    # ptxas spill registers. A lone segment's epilogue rows come from its own table (`_post`):
    # it is its own lead, so the shrink's list needs no room for them
    s, m, row0, end, f = _slot(seg_ptr, ENTRY, M, BLOCK_M)
    lead = (row0 < end) & (tl.load(seg_ptr + _SEG * s + 4) >= 1)  # a follower's work is its lead's
    head = mix_ptr + (s * M + m) * (_HEAD + RMAX)
    r = tl.load(head, mask=lead, other=0)
    live, rows, rmask, ns, nmask, bmask = _out_tile(row0, end, tl.load(head + 1, mask=lead, other=0), BLOCK_M,
                                                    BLOCK_N, OUT_ALIGN)
    if not live:
        return
    col = tl.load(head + 2)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, r, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < r
        tmask = rmask[:, None] & kmask[None, :]
        tptr = t_ptr + (rows[:, None].to(tl.int64) * M + m) * RMAX + ks[None, :]
        tt = tl.load(tptr, mask=tmask, other=0.0)
        for split in range(1, SPLITS):  # the shrink's partials, in a fixed order
            tt += tl.load(tptr + split * T * M * RMAX, mask=tmask, other=0.0)
        acc = _times_bt(acc, tt, w_ptr, head + _HEAD, ks, kmask, ns, bmask)
    g_row, c_row = _post(seg_ptr, wi_ptr, s, f)
    _add_out(out_ptr, acc, rows, rmask, col, ns, nmask, stride_out, w_ptr, g_row, c_row, bmask, OUT_ALIGN)


@triton.jit
def _member(seg_ptr, wi_ptr, p, f, off, RMAX, live):
    """Segment p's fields for the slot at f (none read unless `live`): its rank, its rank rows
    within max_rank (RMAX - off: the rows of the mix's members before it come first), the int64
    indices of its A's and Bt's row pointers and its scale."""
    fields = wi_ptr + tl.load(seg_ptr + _SEG * p + 2, mask=live, other=0) + f
    rank = tl.load(fields, mask=live, other=0)
    r = tl.minimum(rank, RMAX - off)
    a_rows = tl.load(fields + 3, mask=live & (r > 0), other=0)
    b_rows = tl.load(fields + 4, mask=live & (r > 0), other=0)
    scale = tl.load(seg_ptr + _SEG * p + 3, mask=live, other=0).to(tl.int32).to(tl.float32, bitcast=True)
    return rank, r, a_rows, b_rows, scale


@triton.jit
def fused_kernel(x_ptr, w_ptr, wi_ptr, out_ptr, seg_ptr, ENTRY, M, IN, stride_x, stride_out, RMAX,
                  UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_N: tl.constexpr, OUT_ALIGN: tl.constexpr):
    s, _, row0, end, f = _slot(seg_ptr, ENTRY, M, BLOCK_M)
    n = tl.load(seg_ptr + _SEG * s + 4, mask=row0 < end, other=0)  # a follower's work is its lead's
    # the mix's n_out and col (from its members with the slot: one without it has zeros there)
    # and its steps: the blocks of BLOCK_R rank rows of each member, one at least each
    steps = tl.zeros([], tl.int64)
    off = tl.zeros([], tl.int64)
    n_out = tl.zeros([], tl.int64)
    col = tl.zeros([], tl.int64)
    for p in range(s, s + n):
        fields = _fields(seg_ptr, wi_ptr, p, f)
        rank = tl.load(fields)
        steps += tl.maximum(tl.cdiv(tl.minimum(rank, RMAX - off), BLOCK_R), 1)
        off += rank
        n_out = tl.maximum(n_out, tl.load(fields + 1, mask=rank > 0, other=0))
        col = tl.maximum(col, tl.load(fields + 2, mask=rank > 0, other=0))
    live, rows, rmask, ns, nmask, bmask = _out_tile(row0, end, n_out, BLOCK_M, BLOCK_N, OUT_ALIGN)
    if not live:
        return
    # one loop over the mix's blocks, member after member, its state advanced at each step: a
    # loop over the members around a rank loop spilled registers (ptxas)
    p = s + tl.zeros([], tl.int64)
    k0 = tl.zeros([], tl.int64)
    off = tl.zeros([], tl.int64)
    rank, r, a_rows, b_rows, scale = _member(seg_ptr, wi_ptr, p, f, off, RMAX, True)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(steps):
        if r > 0:  # a member without the slot (or past max_rank) takes a step of no work
            ks = k0 + tl.arange(0, BLOCK_R)
            kmask = ks < r
            t = _shrink_tile(x_ptr, w_ptr, _row_ptrs(wi_ptr, a_rows + ks, kmask), rows, rmask, kmask, 0, IN, IN,
                             stride_x, UPCAST, BLOCK_M, BLOCK_K, BLOCK_R)
            acc = _times_bt(acc, t * scale, w_ptr, wi_ptr, b_rows + ks, kmask, ns, bmask)
        k0 += BLOCK_R
        nxt = k0 >= r  # on to the next member's first block
        off = tl.where(nxt, off + rank, off)
        p = tl.where(nxt, p + 1, p)
        k0 = tl.where(nxt, 0, k0)
        rank2, r2, a2, b2, scale2 = _member(seg_ptr, wi_ptr, p, f, off, RMAX, nxt & (p < s + n))
        rank = tl.where(nxt, rank2, rank)
        r = tl.where(nxt, r2, r)
        a_rows = tl.where(nxt, a2, a_rows)
        b_rows = tl.where(nxt, b2, b_rows)
        scale = tl.where(nxt, scale2, scale)
    g_row, c_row = _post(seg_ptr, wi_ptr, s, f)
    _add_out(out_ptr, acc, rows, rmask, col, ns, nmask, stride_out, w_ptr, g_row, c_row, bmask, OUT_ALIGN)
