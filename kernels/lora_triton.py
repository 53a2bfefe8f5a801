"""The GPU LoRA kernel: shrink + expand for many adapters of mixed ranks in one op per projection
group, reading adapter weights straight from the pool's scattered pages.

Semantics (identical to `reference.lora_paged`): for every segment s, row i in [seg[s, 0],
seg[s, 1]) and module slot m with r > 0:
    out[i, col : col + n_out] += (x[i] @ A_m(s)^T) @ Bt_m(s)
accumulated in fp32 and rounded once to out's dtype. Rows in no segment are untouched: a request
without an adapter pays nothing. Weights are read through the contract at the end of
`reference.py`: element o of segment s's adapter buffer is w[tables[s, o // E] * E + o % E];
A_m is [r, in] row-major at logical a_off, Bt_m is [r, n_out] row-major at logical b_off; meta
[S, M, 5] holds (a_off, r, b_off, n_out, col), r == 0 meaning the adapter lacks module m.

Why it exists: on a GPU, one segment-at-a-time torch loop costs a dozen launches per adapter per
layer, and padding every adapter to the largest rank (or copying weights into a contiguous
stack) wastes the memory bandwidth the op is bound by. Here two launches (and the zeroing of
the shrink's scratch when it splits, below) serve every adapter of the batch, whatever its rank
(1..256, not only powers of two), and every weight element is read once per row block from
wherever its page lies. Given `max_rows` and `max_rank`, the launch
grid depends on nothing but them (no `.item()`, no host sync), so the op can be captured in a
CUDA graph; the kernels skip programs past a segment's end or past an adapter's rank.

Two kernels:
  shrink  grid (S*M, cdiv(max_rows, BLOCK_M), cdiv(max_rank, BLOCK_R) * cdiv(in, K_SPLIT)):
          t[i, m, k] = x[i] . A_m[k] for k < r, fp32, into a scratch t [T, M, RMAX]; each program
          reduces K_SPLIT of the `in` columns and adds its partial sums into t atomically (t
          starts at zero) when `in` takes more than one such slice
  expand  grid (S*M, cdiv(max_rows, BLOCK_M), cdiv(N, BLOCK_N)):
          out[i, col + n] = round(out[i, col + n] + sum_{k<r} t[i, m, k] * Bt_m[k, n])

Why split the shrink: at decode a segment has one row (or the 16 of a captured step), so a
program per (segment, module, rank block) that walked all of `in` (2048-8192 columns, 32-128
dependent page-table gathers in a row) left most of the GPU idle. Slices of K_SPLIT columns
make `in` / K_SPLIT times as many programs, each a few iterations long: on an H200, 64 one-row
rank-16 segments 106.5 -> 58.2 us, and a captured step's down projection 737 -> 66 us (README,
"Kernels"). The price: the partial sums meet in t in whatever order the programs finish, so
fp32 results may differ in the last bits from run to run (as split-K GEMMs do); the tests'
tolerances hold for any order.

Module slots: M is the group's own number of modules (qkv 3, gate_up 2, o and down 1): the engine
passes a view of those slots out of its [S, 3, 5] metadata (segments a stride apart, read in
place), so no program is launched for a slot no adapter can fill. Warps: 8 per program when the
rank block is 64 (max_rank >= 64, as in every captured decode step, whose bound is 256), 4 below.
Measured on an H200 in one run (bf16, the 1b shapes, graph-replayed; README "Kernels"): a
captured step's shapes with one r16 adapter on 64 rows, per group qkv 67.8 -> 56.6 us, o 64.7
-> 34.0, gate_up 130.0 -> 123.6, down 91.5 -> 46.3; with 64 adapters r8-64 qkv 403 -> 292, o
240 -> 155, gate_up 1,237 -> 1,110, down 400 -> 253; but 64 one-row r16 segments at max_rank 16
58.0 us with 4 warps, 83.4 with 8 (hence the rule); 1 or 2 warps were 2-7x slower everywhere.
Tried and measured slower (0.2-0.7x on every shape, so not kept): programs that each walk
several segments, rank blocks and column blocks in loops (a grid of 16 segment programs, not
one per segment), to launch fewer programs that find no work: idle programs cost less than
what those nested loops serialise (our reading; not profiled).

Logical offsets (inside one adapter's buffer, before the page table) are int32 when the widest
page table's span fits (`WIDE` otherwise): the `// E` and `% E` of every element's address are
then 32-bit divisions, where a GPU emulates 64-bit ones in many more instructions. Pool indices
(page * E + offset) are always int64.

Precision: fp32 inputs use `tl.dot(..., input_precision="ieee")` (no TF32); fp16/bf16 inputs
multiply in their own dtype with fp32 accumulation in the shrink (products of two halves are
exact in fp32); the expand multiplies the fp32 t by Bt upcast to fp32, as the reference does.
Under the Triton interpreter (TRITON_INTERPRET=1) `tl.dot` on bf16 operands is wrong (it
multiplies the raw uint16 bit patterns), so bf16 operands are upcast to fp32 there too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafleet.kernels.reference import META_FIELDS


K_SPLIT = 256  # `in` columns one shrink program reduces (a multiple of its BLOCK_K, 64 at most)
INT32_SPAN = 2 ** 31  # logical offsets below this are computed in int32


def _block(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


@triton.jit
def _page_addr(tables_row, o, E, mask):
    """Pool element index of logical offsets `o` (int64) through one segment's page table."""
    page = tl.load(tables_row + o // E, mask=mask, other=0)
    return page * E + o % E


@triton.jit
def _program(seg_ptr, meta_ptr, tables_ptr, stride_ms, M, maxp, BLOCK_M: tl.constexpr):
    """This program's segment s, module slot m, first row, the segment's end, its metadata row
    and its page table (axis 0 of the grid is s * M + m, axis 1 the block of rows)."""
    pid = tl.program_id(0)
    s = pid // M
    m = pid % M
    row0 = tl.load(seg_ptr + 2 * s) + tl.program_id(1) * BLOCK_M
    return s, m, row0, tl.load(seg_ptr + 2 * s + 1), meta_ptr + s * stride_ms + m * 5, tables_ptr + s * maxp


@triton.jit
def _shrink_kernel(x_ptr, w_ptr, t_ptr, seg_ptr, meta_ptr, tables_ptr,
                   E, IN, stride_x, stride_ms, maxp, M, RMAX, RANK_BLOCKS,
                   UPCAST: tl.constexpr, WIDE: tl.constexpr, ATOMIC: tl.constexpr, K_SPLIT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    s, m, row0, end, mrow, tables_row = _program(seg_ptr, meta_ptr, tables_ptr, stride_ms, M, maxp, BLOCK_M)
    a_off = tl.load(mrow)
    r = tl.minimum(tl.load(mrow + 1), RMAX)  # a max_rank below the true rank: wrong, never out of bounds
    pid = tl.program_id(2)
    k0 = (pid % RANK_BLOCKS) * BLOCK_R
    c_lo = (pid // RANK_BLOCKS) * K_SPLIT
    if (row0 >= end) | (k0 >= r):
        return
    if not WIDE:
        a_off = a_off.to(tl.int32)
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < end
    ks = k0 + tl.arange(0, BLOCK_R)
    kmask = ks < r
    k_rows = ks[None, :].to(tl.int64) * IN if WIDE else ks[None, :] * IN
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for c0 in range(c_lo, tl.minimum(c_lo + K_SPLIT, IN), BLOCK_K):
        cols = c0 + tl.arange(0, BLOCK_K)
        cmask = cols < IN
        xt = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :],
                     mask=rmask[:, None] & cmask[None, :], other=0.0)
        # A_m^T tile [BLOCK_K, BLOCK_R]: element (c, k) is A_m[k, c] at logical a_off + k*IN + c
        amask = cmask[:, None] & kmask[None, :]
        o = a_off + k_rows + cols[:, None]
        at = tl.load(w_ptr + _page_addr(tables_row, o, E, amask), mask=amask, other=0.0)
        if UPCAST:
            acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xt, at)
    tptr = t_ptr + (rows[:, None].to(tl.int64) * M + m) * RMAX + ks[None, :]
    tmask = rmask[:, None] & kmask[None, :]
    if ATOMIC:
        tl.atomic_add(tptr, acc, mask=tmask)
    else:
        tl.store(tptr, acc, mask=tmask)


@triton.jit
def _expand_kernel(t_ptr, w_ptr, out_ptr, seg_ptr, meta_ptr, tables_ptr,
                   E, stride_out, stride_ms, maxp, M, RMAX,
                   WIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    s, m, row0, end, mrow, tables_row = _program(seg_ptr, meta_ptr, tables_ptr, stride_ms, M, maxp, BLOCK_M)
    r = tl.minimum(tl.load(mrow + 1), RMAX)
    b_off = tl.load(mrow + 2)
    n_out = tl.load(mrow + 3)
    col = tl.load(mrow + 4)
    n0 = tl.program_id(2) * BLOCK_N
    if (row0 >= end) | (r == 0) | (n0 >= n_out):
        return
    if not WIDE:
        b_off = b_off.to(tl.int32)
        n_out = n_out.to(tl.int32)
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < end
    ns = n0 + tl.arange(0, BLOCK_N)
    nmask = ns < n_out
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, r, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < r
        tt = tl.load(t_ptr + (rows[:, None].to(tl.int64) * M + m) * RMAX + ks[None, :],
                     mask=rmask[:, None] & kmask[None, :], other=0.0)
        bmask = kmask[:, None] & nmask[None, :]
        o = b_off + (ks[:, None].to(tl.int64) if WIDE else ks[:, None]) * n_out + ns[None, :]
        bt = tl.load(w_ptr + _page_addr(tables_row, o, E, bmask), mask=bmask, other=0.0)
        acc += tl.dot(tt, bt.to(tl.float32), input_precision="ieee")
    optr = out_ptr + rows[:, None].to(tl.int64) * stride_out + col + ns[None, :]
    omask = rmask[:, None] & nmask[None, :]
    cur = tl.load(optr, mask=omask, other=0.0).to(tl.float32)
    tl.store(optr, (cur + acc).to(out_ptr.dtype.element_ty), mask=omask)


def _interpreted() -> bool:
    """Whether this module's kernels run under the interpreter: triton decides when a kernel is
    decorated, i.e. when this module is first imported (TRITON_INTERPRET=1 must be set by then)."""
    return type(_shrink_kernel).__name__ == "InterpretedFunction"


def _upcast(dtype: torch.dtype) -> bool:
    """Whether dot operands of this dtype are upcast to fp32 (ieee) rather than multiplied as is."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _interpreted())


def lora_paged(x: torch.Tensor, out: torch.Tensor, w: torch.Tensor, page_elems: int, seg: torch.Tensor,
               meta: torch.Tensor, tables: torch.Tensor, max_rows: int | None = None,
               max_rank: int | None = None) -> None:
    """out[i, col:col+n_out] += (x[i] @ A_m(s)^T) @ Bt_m(s) for every segment row and module slot
    (see the module docstring). x: [T, in], out: [T, N] (row-strided views allowed, unit column
    stride), w: the flat pool [pages * page_elems], all one dtype (fp32, bf16, fp16); seg [S, 2],
    meta [S, M, 5], tables [S, maxp] int64 on x's device.

    max_rows (the longest segment) and max_rank (the largest r in meta) are read from the data
    when None (a host sync); passed explicitly (any upper bounds), the launch depends only on
    them and the op is CUDA-graph capturable. Bounds below the data's give wrong results (rows
    past max_rows and ranks past max_rank are skipped), never out-of-bounds accesses."""
    if not (x.dtype == out.dtype == w.dtype):
        raise TypeError(f"lora_paged: x, out and w must share a dtype (got {x.dtype}, {out.dtype}, {w.dtype})")
    if x.stride(1) != 1 or out.stride(1) != 1 or not w.is_contiguous():
        raise ValueError("lora_paged: x and out need unit column stride, w must be contiguous")
    S = seg.shape[0]
    M = meta.shape[1] if meta.dim() == 3 else 0
    T, IN = x.shape
    if S == 0 or M == 0 or T == 0:
        return
    seg = seg.contiguous()
    if meta.stride(2) != 1 or meta.stride(1) != META_FIELDS:
        meta = meta.contiguous()  # segments may lie any stride apart (a view of a group's slots)
    tables = tables.contiguous()
    if max_rows is None:
        max_rows = int((seg[:, 1] - seg[:, 0]).max())
    if max_rank is None:
        max_rank = int(meta[:, :, 1].max())
    if max_rows <= 0 or max_rank <= 0:
        return
    block_m = _block(max_rows, 16, 64)
    block_r = _block(max_rank, 16, 64)
    block_k = _block(IN, 16, 64)
    rank_blocks = triton.cdiv(max_rank, block_r)
    rmax = rank_blocks * block_r
    k_split = max(block_k, K_SPLIT)
    splits = triton.cdiv(IN, k_split)
    t = (torch.zeros if splits > 1 else torch.empty)(T, M, rmax, dtype=torch.float32, device=x.device)
    maxp = tables.shape[1]
    # logical offsets stay below maxp * page_elems: int32 when that fits
    wide = maxp * page_elems >= INT32_SPAN
    row_blocks = triton.cdiv(max_rows, block_m)
    warps = 8 if block_r >= 64 else 4  # see "Warps" above
    _shrink_kernel[(S * M, row_blocks, rank_blocks * splits)](
        x, w, t, seg, meta, tables, page_elems, IN, x.stride(0), meta.stride(0), maxp, M, rmax, rank_blocks,
        UPCAST=_upcast(x.dtype), WIDE=wide, ATOMIC=splits > 1, K_SPLIT=k_split,
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r, num_warps=warps)
    N = out.shape[1]
    block_n = _block(N, 16, 128)
    _expand_kernel[(S * M, row_blocks, triton.cdiv(N, block_n))](
        t, w, out, seg, meta, tables, page_elems, out.stride(0), meta.stride(0), maxp, M, rmax,
        WIDE=wide, BLOCK_M=block_m, BLOCK_K=_block(max_rank, 16, 64), BLOCK_N=block_n, num_warps=warps)
