"""The GPU LoRA kernels: many adapters of mixed ranks in one op per projection group, each rank
row read as contiguous vectors straight from the pool's pages through its adapter's row table.

Semantics (identical to `reference.lora`): for every segment s, row i in [seg[s, 0], seg[s, 1])
and module slot m < slots whose rank r > 0 in the row table at seg[s, 2]:
    out[i, col : col + n_out] += (x[i] @ A_m(s)^T) @ Bt_m(s)
accumulated in fp32 and rounded once to out's dtype. Rows in no segment are untouched: a request
without an adapter pays nothing. A program finds its segment's table (one int64 load), the
slot's fields (r, n_out, col, rows: one 32-byte load) and the pointers of the rank rows it reads
(one vector load); every weight is then read as a whole row, `ROW_ALIGN`-aligned and contiguous
(`tl.multiple_of`), so the compiler issues 16-byte loads: no per-element page arithmetic, no
page-table load per element (the layout guarantees that no row crosses a page).

Given `max_rows`, `max_rank` and `max_n_out` the grids depend on nothing else (no `.item()`, no
host sync), so the op can be captured in a CUDA graph; `engine/graphs.py` sizes those bounds to
the step (segment and rank buckets). Loops run to each slot's true rank: a rank-8 adapter beside
a rank-256 one reads 8 rows, and programs past a segment's end or a slot's rank return at once.

Two designs behind the one contract, chosen by `Config.design` (`CONFIG`, the engine's):
  "split"  shrink: grid (S * slots, row blocks, rank blocks * splits); each program reduces
           `k_split` of the `in` columns for up to BLOCK_R rank rows into its own partial
           t[split, row, slot, k] (fp32); expand: grid (S * slots, row blocks, column blocks),
           each program sums the partials of its rows (a fixed order: the same bits every run),
           times Bt's rows over its columns, into out. Two launches, no zeroing, no atomics.
  "fused"  one launch, grid (S * slots, row blocks, column blocks): each program computes its
           rows' shrink over all of `in`, FUSED_RANK_BLOCK rank rows at a time, and multiplies it
           into its columns of Bt at once; every column block recomputes the shrink (A re-read
           from L2), in exchange for half the launches and no scratch. For row blocks of 16 (a
           decode step's segments); longer segments take the split kernels.
`kernels/gpu_micro.py` times both, each configuration of the candidates in `CANDIDATES`,
against the device's copy bandwidth and a vectorized read of the same bytes; `CONFIG` is what
it measured fastest (until a GPU run says otherwise: "split", the form of the previous kernels).
Prefill uses the same kernels with row blocks of up to 64 rows (a segment-GEMM over the rows).

Precision: fp32 inputs use `tl.dot(..., input_precision="ieee")` (no TF32); fp16/bf16 inputs
multiply in their own dtype with fp32 accumulation in the shrink (products of two halves are
exact in fp32); the expand multiplies the fp32 shrink by Bt upcast to fp32, as the reference
does. Under the Triton interpreter (TRITON_INTERPRET=1) `tl.dot` on bf16 operands is wrong (it
multiplies the raw uint16 bit patterns), so bf16 operands are upcast to fp32 there too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lorafleet.kernels.reference import ROW_ALIGN, TABLE_FIELDS, as_int64


@dataclass(frozen=True)
class Config:
    design: str = "split"   # "split" (shrink + expand) or "fused" (one launch, for row blocks of 16)
    k_split: int = 256      # "split": `in` columns one shrink program reduces (a multiple of block_k)
    block_k: int = 64       # `in` columns per shrink iteration
    block_n: int = 128      # output columns per expand (or fused) program, at row blocks of 16
    warps: int = 4

    def __post_init__(self):
        if self.design not in ("split", "fused") or self.k_split % self.block_k:
            raise ValueError(f"invalid LoRA kernel config {self}")


CONFIG = Config()
# What `gpu_micro.py` measures against each other (the first is CONFIG). Each compiles for sm_90
# without spilling a register (tests/kernels/test_triton_compile.py), at the blocks `lora` picks.
CANDIDATES = (CONFIG, Config(k_split=512), Config(k_split=1024), Config(block_n=64), Config(warps=8),
              Config("fused"), Config("fused", block_n=64), Config("fused", block_n=256, warps=8))
PREFILL_BLOCK_N = 64   # output columns per expand program at row blocks over 16 (more spill registers)
PREFILL_RANK_BLOCK = 32  # rank rows per expand iteration at row blocks over 16 (more spill registers)
FUSED_RANK_BLOCK = 16  # rank rows per iteration of the fused kernel (more spill registers)


_ALIGN = tl.constexpr(ROW_ALIGN)


def _block(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


@triton.jit
def _slot(seg_ptr, wi_ptr, ENTRY, M, BLOCK_M: tl.constexpr):
    """This program's segment's rows [row0, end) (axis 1 picks the row block), its slot m (axis 0
    is s * M + m), where its row table's index is, and the offset in it of the slot's fields
    (r, n_out, col, a_rows, b_rows)."""
    pid = tl.program_id(0)
    s = pid // M
    m = pid % M
    row0 = tl.load(seg_ptr + 3 * s) + tl.program_id(1) * BLOCK_M
    end = tl.load(seg_ptr + 3 * s + 1)
    return m, row0, end, seg_ptr + 3 * s + 2, ENTRY + m * 5


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
def _row_ptrs(wi_ptr, at, ks, kmask):
    """Element offsets of rank rows `ks` from the pointer list at int64 index `at`."""
    return tl.multiple_of(tl.load(wi_ptr + at + ks, mask=kmask, other=0), _ALIGN)


@triton.jit
def _shrink_kernel(x_ptr, w_ptr, wi_ptr, t_ptr, seg_ptr, ENTRY, M, IN, stride_x, T, RMAX, RANK_BLOCKS,
                   UPCAST: tl.constexpr, K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    m, row0, end, table, f = _slot(seg_ptr, wi_ptr, ENTRY, M, BLOCK_M)
    if row0 >= end:
        return
    fields = wi_ptr + tl.load(table) + f
    r = tl.minimum(tl.load(fields), RMAX)  # a max_rank below the true rank: wrong, never out of bounds
    pid = tl.program_id(2)
    k0 = (pid % RANK_BLOCKS) * BLOCK_R
    split = pid // RANK_BLOCKS
    if k0 >= r:
        return
    ks = k0 + tl.arange(0, BLOCK_R)
    kmask = ks < r
    aptr = _row_ptrs(wi_ptr, tl.load(fields + 3), ks, kmask)  # A's rows
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < end
    c_lo = split * K_SPLIT
    acc = _shrink_tile(x_ptr, w_ptr, aptr, rows, rmask, kmask, c_lo, tl.minimum(c_lo + K_SPLIT, IN), IN, stride_x,
                       UPCAST, BLOCK_M, BLOCK_K, BLOCK_R)
    tptr = t_ptr + ((split * T + rows[:, None].to(tl.int64)) * M + m) * RMAX + ks[None, :]
    tl.store(tptr, acc, mask=rmask[:, None] & kmask[None, :])


@triton.jit
def _add_out(out_ptr, acc, rows, rmask, col, ns, nmask, stride_out):
    optr = out_ptr + rows[:, None].to(tl.int64) * stride_out + col + ns[None, :]
    omask = rmask[:, None] & nmask[None, :]
    cur = tl.load(optr, mask=omask, other=0.0).to(tl.float32)
    tl.store(optr, (cur + acc).to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _out_tile(seg_ptr, wi_ptr, ENTRY, M, RMAX, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """An expand (or fused) program's slot m, its fields' address, its rank, whether it has work
    (rows of its segment, rank > 0, columns below n_out: an empty segment's table is not read),
    and its output tile: the column offset, its rows and columns, their masks, and `bmask`, the
    columns of Bt it reads: up to n_out rounded up to ROW_ALIGN (the padding is inside the row's
    aligned stride, in its page), a mask constant over each aligned vector, so the compiler
    issues 16-byte loads; the columns past n_out are never stored."""
    m, row0, end, table, f = _slot(seg_ptr, wi_ptr, ENTRY, M, BLOCK_M)
    fields = wi_ptr + tl.load(table, mask=row0 < end, other=0) + f
    r = tl.minimum(tl.load(fields, mask=row0 < end, other=0), RMAX)
    n_out = tl.load(fields + 1, mask=r > 0, other=0)
    n0 = tl.program_id(2) * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_M)
    ns = n0 + tl.arange(0, BLOCK_N)
    bmask = ns < (n_out + _ALIGN - 1) // _ALIGN * _ALIGN
    live = (row0 < end) & (n0 < n_out)
    return m, fields, r, live, tl.load(fields + 2, mask=live, other=0), rows, rows < end, ns, ns < n_out, bmask


@triton.jit
def _times_bt(acc, t, w_ptr, wi_ptr, b_rows, ks, kmask, ns, bmask):
    """acc + t @ Bt[ks, ns] (fp32), Bt's rows through their pointers."""
    bptr = _row_ptrs(wi_ptr, b_rows, ks, kmask)
    bt = tl.load(w_ptr + bptr[:, None] + ns[None, :], mask=kmask[:, None] & bmask[None, :], other=0.0)
    return acc + tl.dot(t, bt.to(tl.float32), input_precision="ieee")


@triton.jit
def _expand_kernel(t_ptr, w_ptr, wi_ptr, out_ptr, seg_ptr, ENTRY, M, SPLITS, stride_out, T, RMAX,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    m, fields, r, live, col, rows, rmask, ns, nmask, bmask = _out_tile(seg_ptr, wi_ptr, ENTRY, M, RMAX, BLOCK_M,
                                                                       BLOCK_N)
    if not live:
        return
    b_rows = tl.load(fields + 4)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, r, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < r
        tmask = rmask[:, None] & kmask[None, :]
        tptr = t_ptr + (rows[:, None].to(tl.int64) * M + m) * RMAX + ks[None, :]
        tt = tl.load(tptr, mask=tmask, other=0.0)
        for split in range(1, SPLITS):  # the shrink's partials, in a fixed order
            tt += tl.load(tptr + split * T * M * RMAX, mask=tmask, other=0.0)
        acc = _times_bt(acc, tt, w_ptr, wi_ptr, b_rows, ks, kmask, ns, bmask)
    _add_out(out_ptr, acc, rows, rmask, col, ns, nmask, stride_out)


@triton.jit
def _fused_kernel(x_ptr, w_ptr, wi_ptr, out_ptr, seg_ptr, ENTRY, M, IN, stride_x, stride_out, RMAX,
                  UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    m, fields, r, live, col, rows, rmask, ns, nmask, bmask = _out_tile(seg_ptr, wi_ptr, ENTRY, M, RMAX, BLOCK_M,
                                                                       BLOCK_N)
    if not live:
        return
    a_rows = tl.load(fields + 3)
    b_rows = tl.load(fields + 4)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, r, BLOCK_R):
        ks = k0 + tl.arange(0, BLOCK_R)
        kmask = ks < r
        t = _shrink_tile(x_ptr, w_ptr, _row_ptrs(wi_ptr, a_rows, ks, kmask), rows, rmask, kmask, 0, IN, IN, stride_x,
                         UPCAST, BLOCK_M, BLOCK_K, BLOCK_R)
        acc = _times_bt(acc, t, w_ptr, wi_ptr, b_rows, ks, kmask, ns, bmask)
    _add_out(out_ptr, acc, rows, rmask, col, ns, nmask, stride_out)


def _interpreted() -> bool:
    """Whether this module's kernels run under the interpreter: triton decides when a kernel is
    decorated, i.e. when this module is first imported (TRITON_INTERPRET=1 must be set by then)."""
    return type(_shrink_kernel).__name__ == "InterpretedFunction"


def _upcast(dtype: torch.dtype) -> bool:
    """Whether dot operands of this dtype are upcast to fp32 (ieee) rather than multiplied as is."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _interpreted())


def _max_rank(w: torch.Tensor, seg: torch.Tensor, entry: int, slots: int) -> int:
    """The largest rank the segments' tables hold for these slots (a host sync)."""
    wi = as_int64(w)
    live = seg[seg[:, 1] > seg[:, 0]]
    if not len(live):
        return 0
    idx = live[:, 2:3] + entry + TABLE_FIELDS * torch.arange(slots, device=seg.device)
    return int(wi[idx].max())


def lora(x: torch.Tensor, out: torch.Tensor, w: torch.Tensor, seg: torch.Tensor, entry: int, slots: int,
         max_rows: int | None = None, max_rank: int | None = None, max_n_out: int | None = None,
         config: Config | None = None) -> None:
    """out[i, col:col+n_out] += (x[i] @ A_m(s)^T) @ Bt_m(s) for every segment row and module slot
    (see the module docstring). x: [T, in], out: [T, N] (row-strided views allowed, unit column
    stride), w: the flat pool [pages * page_elems], all one dtype (fp32, bf16, fp16); seg [S, 3]
    int64 on x's device; entry, slots: the group's fields in the row tables.

    max_rows (the longest segment), max_rank (the largest r) and max_n_out (the widest slot's
    output: N when None) are read from the data when None (a host sync); passed explicitly (any
    upper bounds), the launch depends only on them and the op is CUDA-graph capturable. Bounds
    below the data's give wrong results (rows past max_rows and ranks past max_rank are skipped),
    never out-of-bounds accesses."""
    cfg = config or CONFIG
    if not (x.dtype == out.dtype == w.dtype):
        raise TypeError(f"lora: x, out and w must share a dtype (got {x.dtype}, {out.dtype}, {w.dtype})")
    if x.stride(1) != 1 or out.stride(1) != 1 or not w.is_contiguous():
        raise ValueError("lora: x and out need unit column stride, w must be contiguous")
    S = seg.shape[0]
    T, IN = x.shape
    if S == 0 or slots == 0 or T == 0:
        return
    seg = seg.contiguous()
    if max_rows is None:
        max_rows = int((seg[:, 1] - seg[:, 0]).max())
    if max_rank is None:
        max_rank = _max_rank(w, seg, entry, slots)
    if max_rows <= 0 or max_rank <= 0:
        return
    wi = as_int64(w)
    n_out = max_n_out or out.shape[1]
    block_m = _block(max_rows, 16, 64 if x.element_size() < 4 else 32)  # fp32 tiles: twice the registers
    block_r = _block(max_rank, 16, 64)
    block_k = _block(IN, 16, cfg.block_k)
    block_n = _block(n_out, 16, cfg.block_n if block_m == 16 else min(cfg.block_n, PREFILL_BLOCK_N))
    row_blocks = triton.cdiv(max_rows, block_m)
    col_blocks = triton.cdiv(n_out, block_n)
    upcast = _upcast(x.dtype)
    if cfg.design == "fused" and block_m == 16:  # longer segments (prefill): the split kernels
        _fused_kernel[(S * slots, row_blocks, col_blocks)](
            x, w, wi, out, seg, entry, slots, IN, x.stride(0), out.stride(0), max_rank,
            UPCAST=upcast, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=FUSED_RANK_BLOCK, BLOCK_N=block_n,
            num_warps=cfg.warps)
        return
    rank_blocks = triton.cdiv(max_rank, block_r)
    rmax = rank_blocks * block_r
    k_split = max(block_k, cfg.k_split)
    splits = triton.cdiv(IN, k_split)
    t = torch.empty(splits, T, slots, rmax, dtype=torch.float32, device=x.device)
    _shrink_kernel[(S * slots, row_blocks, rank_blocks * splits)](
        x, w, wi, t, seg, entry, slots, IN, x.stride(0), T, rmax, rank_blocks,
        UPCAST=upcast, K_SPLIT=k_split, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r, num_warps=cfg.warps)
    _expand_kernel[(S * slots, row_blocks, col_blocks)](
        t, w, wi, out, seg, entry, slots, splits, out.stride(0), T, rmax,
        BLOCK_M=block_m, BLOCK_K=block_r if block_m == 16 else min(block_r, PREFILL_RANK_BLOCK), BLOCK_N=block_n,
        num_warps=cfg.warps)
