"""The GPU LoRA kernels: many adapters of mixed ranks in one op per projection group, each rank
row read as contiguous vectors straight from the pool's pages through its adapter's row table.

Semantics (identical to `reference.lora`): `seg` [S, SEG_FIELDS] holds (start, end, table,
scale, mix) per segment; a mix (a request on several adapters) is a run of segments over the same
rows, `mix` n >= 1 on its first (its lead; a plain segment is a mix of one), -j on its j-th
follower. For every mix, row i in [start, end) and module slot m < slots:
    out[i, col : col + n_out] += sum over the mix's segments s whose rank r > 0 in the row table
                                 at seg[s, 2] of scale(s) * (x[i] @ A_m(s)^T) @ Bt_m(s)
accumulated in fp32 and rounded once to out's dtype; on a lone segment (mix 1) a slot with an
*epilogue* (its field g_row >= 0: DoRA's magnitude over the row norms, PEFT's lora_bias) gives
out = g * (out + delta) + c instead, g and c the rows of n_out at g_row and c_row, in fp32,
rounded once. Rows in no segment are untouched: a request without an adapter pays nothing. A
program finds its segment's table (one int64 load), the slot's fields (r, n_out, col, a_rows,
b_rows; g_row and c_row once its tile is summed: scalar loads) and the pointers of the rank rows
it reads (one vector load); every weight (and epilogue row) is then read as a whole row,
`ROW_ALIGN`-aligned and contiguous (`tl.multiple_of`), so the compiler issues 16-byte loads: no
per-element page arithmetic, no page-table load per element (the layout guarantees that no row
crosses a page). out's tile is read and written likewise, in vectors of `OUT_ALIGN` elements (up
to 16 bytes): the caller's `out_align` divides every slot's n_out and col, and the kernels round
both down to it (a no-op on true values) so that the compiler can see it, since a hint on a
loaded scalar (`tl.multiple_of`) did not reach the masks and addresses.

Given `max_rows`, `max_rank` and `max_n_out` the grids depend on nothing else (no `.item()`, no
host sync), so the op can be captured in a CUDA graph; `engine/graphs.py` sizes those bounds to
the step (segment and rank buckets). Loops run to each slot's true rank: a rank-8 adapter beside
a rank-256 one reads 8 rows, and programs past a segment's end or a slot's rank return at once.

A mix is one adapter whose rank rows are its members' side by side, each member's scaled (the
scale multiplies the fp32 shrink, as the reference does), so `max_rank` bounds the largest sum of
a mix's ranks for one slot. Its lead's programs do its work, summing its deltas in fp32 into one
tile that joins out once; a follower's programs return at once, and no program waits on another.
A mix's epilogues are never read: only a lone segment's programs (their own lead) load the
slot's g_row and c_row, from its table, as they add their tile to out.

Two designs behind the one contract, chosen by `Config.design` (`CONFIG`, the engine's):
  "split"  shrink: grid (S * slots, row blocks, rank blocks * splits); each program reduces
           `k_split` of the `in` columns for up to BLOCK_R rank rows of its mix (rank row k:
           the member whose rows hold k, its pointers and scale found by a loop over the
           members) into its own partial t[split, row, slot, k] (fp32, scaled), and lists for
           the expand, per lead and slot, the mix's rank, n_out, col and Bt row pointers
           (`MIX_HEAD`); expand: grid (S * slots, row blocks, column blocks), each program
           sums the partials of its rows (a fixed order: the same bits every run), times the
           listed Bt rows over its columns, into out: no loop over the members (any other loop
           beside its rank loop made ptxas spill registers). Two launches, no zeroing, no
           atomics.
  "fused"  one launch, grid (S * slots, row blocks, column blocks): each program computes its
           rows' shrink over all of `in`, FUSED_RANK_BLOCK rank rows of one member at a time
           (one loop over the blocks of the members in turn), scales it and multiplies it into
           its columns of that member's Bt at once; every column block recomputes the shrink (A
           re-read from L2), in exchange for half the launches and no scratch. For row blocks
           of 16 (a decode step's segments); longer segments take the split kernels.
The kernels themselves are `lora_triton_jit.py`'s; this module launches them.
`lorafleet/bench/gpu_micro.py` times both, each configuration of the candidates in `CANDIDATES`,
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

import math
from dataclasses import dataclass

import torch
import triton

from lorafleet.kernels.lora_triton_jit import MIX_HEAD, expand_kernel, fused_kernel, shrink_kernel
from lorafleet.kernels.triton_utils import block, upcast as upcast_dtype
from lorafleet.kernels.reference import SEG_FIELDS, TABLE_FIELDS, as_int64


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


def _max_rank(w: torch.Tensor, seg: torch.Tensor, entry: int, slots: int) -> int:
    """The largest sum of ranks one mix's tables hold for one of these slots (a host sync)."""
    wi = as_int64(w)
    live = torch.nonzero(seg[:, 1] > seg[:, 0]).flatten()
    if not len(live):
        return 0
    ranks = wi[seg[live, 2:3] + entry + TABLE_FIELDS * torch.arange(slots, device=seg.device)]  # [L, slots]
    lead = live + seg[live, 4].clamp(max=0)  # a follower's mix is -j: its lead is j segments up
    sums = torch.zeros(seg.shape[0], slots, dtype=ranks.dtype, device=seg.device).index_add_(0, lead, ranks)
    return int(sums.max())


def lora(x: torch.Tensor, out: torch.Tensor, w: torch.Tensor, seg: torch.Tensor, entry: int, slots: int,
         max_rows: int | None = None, max_rank: int | None = None, max_n_out: int | None = None,
         out_align: int = 1, config: Config | None = None) -> None:
    """out[i, col:col+n_out] += the sum over a mix's segments s of scale(s) * (x[i] @ A_m(s)^T) @
    Bt_m(s), for every row of every mix (a plain segment: a mix of one) and module slot; a lone
    segment's slot with an epilogue gives g * (out + delta) + c instead (see the module
    docstring). x: [T, in], out: [T, N] (row-strided views allowed, unit column stride), w: the
    flat pool [pages * page_elems] (fp32, bf16, fp16): x's dtype, or 16-bit under fp32 x (`--lora-dtype`,
    widened to fp32 as it is read); seg [S, SEG_FIELDS] int64
    (start, end, table, scale, mix) on x's device; entry, slots: the group's fields in the row
    tables.

    max_rows (the longest segment), max_rank (the largest sum of a mix's ranks for one slot: its
    members' rank rows side by side) and max_n_out (the widest slot's output: N when None) are
    read from the data when None (a host sync); passed explicitly (any upper bounds), the launch
    depends only on them and the op is CUDA-graph capturable. Bounds below the data's give wrong
    results (rows past max_rows and a mix's rank rows past max_rank are skipped), never
    out-of-bounds accesses. `out_align` must divide every slot's n_out and col (`batch.group_shapes`
    computes it from the base): out's tile is then read and written in vectors of up to 16 bytes;
    one that does not divide them gives wrong columns."""
    cfg = config or CONFIG
    if x.dtype != out.dtype or not (w.dtype == x.dtype or (x.dtype == torch.float32 and w.element_size() == 2)):
        raise TypeError(f"lora: x and out share a dtype, and w is theirs or 16-bit under float32 x (got {x.dtype}, "
                        f"{out.dtype}, {w.dtype})")
    if x.stride(1) != 1 or out.stride(1) != 1 or not w.is_contiguous():
        raise ValueError("lora: x and out need unit column stride, w must be contiguous")
    if seg.dim() != 2 or seg.shape[1] != SEG_FIELDS or seg.dtype != torch.int64:
        raise ValueError(f"lora: seg must be [S, {SEG_FIELDS}] int64 (got {tuple(seg.shape)} {seg.dtype})")
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
    block_m = block(max_rows, 16, 64 if x.element_size() < 4 else 32)  # fp32 tiles: twice the registers
    block_r = block(max_rank, 16, 64)
    block_k = block(IN, 16, cfg.block_k)
    block_n = block(n_out, 16, cfg.block_n if block_m == 16 else min(cfg.block_n, PREFILL_BLOCK_N))
    row_blocks = triton.cdiv(max_rows, block_m)
    col_blocks = triton.cdiv(n_out, block_n)
    upcast = upcast_dtype(x.dtype, shrink_kernel)
    out_vec = math.gcd(out_align, 16 // x.element_size())  # elements: 16 bytes at most, a divisor of out_align
    if cfg.design == "fused" and block_m == 16:  # longer segments (prefill): the split kernels
        fused_kernel[(S * slots, row_blocks, col_blocks)](
            x, w, wi, out, seg, entry, slots, IN, x.stride(0), out.stride(0), max_rank,
            UPCAST=upcast, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=FUSED_RANK_BLOCK, BLOCK_N=block_n,
            OUT_ALIGN=out_vec, num_warps=cfg.warps)
        return
    rank_blocks = triton.cdiv(max_rank, block_r)
    rmax = rank_blocks * block_r
    k_split = max(block_k, cfg.k_split)
    splits = triton.cdiv(IN, k_split)
    t = torch.empty(splits, T, slots, rmax, dtype=torch.float32, device=x.device)
    mixes = torch.empty(S, slots, MIX_HEAD + rmax, dtype=torch.int64, device=x.device)  # the shrink's lists
    shrink_kernel[(S * slots, row_blocks, rank_blocks * splits)](
        x, w, wi, t, mixes, seg, entry, slots, IN, x.stride(0), T, rmax, rank_blocks,
        UPCAST=upcast, K_SPLIT=k_split, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r, num_warps=cfg.warps)
    expand_kernel[(S * slots, row_blocks, col_blocks)](
        t, mixes, w, wi, out, seg, entry, slots, splits, out.stride(0), T, rmax,
        BLOCK_M=block_m, BLOCK_K=block_r if block_m == 16 else min(block_r, PREFILL_RANK_BLOCK), BLOCK_N=block_n,
        OUT_ALIGN=out_vec, num_warps=cfg.warps)
