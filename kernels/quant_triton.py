"""The GPU weight-only quantized projection: x [T, K] times a quantized weight's codes
(`lorafleet.model.quant`'s layout), dequantized in registers, never as a full-precision copy.

Semantics (identical to `reference.linear(x, q, bias, scales, offsets)`): y[t, n] = sum_k x[t, k] *
w[n, k] (+ bias[n]), w = d * q + o (int8: q int8 [N, K]) or d * (q - 8) + o (int4: q uint8 [N, K / 2],
in each run of 32 elements along K byte i holding element i in its low nibble and i + 16 in its high
one), d = scales[n, k // G] (float16 [N, K / G], G a multiple of 32 dividing K), o = offsets[n, k // G]
(float32 [N, K / G], a GGUF file's affine types) or 0. x bf16, fp16 or fp32; y in x's dtype; products
summed in fp32.

Design:
- **Group-aligned K steps.** A program walks its K range in steps of GK elements, GK the largest
  power of two up to `Config.group_k` dividing G (32 for fp32 dot tiles), so a step lies in one
  group: the step's partial sums are taken over the raw codes (exact in any dtype: |q| <= 127)
  and multiplied by the step's one scale per output row once ([BLOCK_N] loads and multiplies a step, not one a
  weight); an offset adds the step's sum of x times it, once a step likewise. `Config.tile_k // GK` steps (`tile_k_decode`, `tile_k_prefill` with dot tiles) are
  unrolled per loop iteration (`tl.static_range`), so each row has a wide run of codes in flight.
- **int4 without interleaving.** A step's bytes [.., GK / 2] are read as one contiguous run per
  row (16-byte loads); the low nibbles are the elements 32r + i of each run r, the high ones
  32r + 16 + i, so the step multiplies the low nibbles by x at those columns and the high ones by
  x 16 columns further: two products over half-width tiles, no shuffle of the codes.
- **Three forms, one kernel, chosen by T (static per launch):**
    gemv    T = 1: the code tile [BLOCK_N, GK] times x's row broadcast, summed along K
            (`tl.sum`), in fp32: no tensor-core padding of one row to 16;
    decode  T <= 16: `tl.dot` of x's 16-row tile and the dequantized code tile [GK, BLOCK_N]
            (codes are exact in bf16/fp16: the dot runs in x's dtype, fp32 accumulation);
    prefill T > 16: the same with 32- or 64-row tiles and wider column blocks.
  Each form splits K (`K_SPLIT`) when its row and column blocks alone give fewer programs than
  `Config.waves` per SM: partial sums [splits, T, N] in fp32, then `_sum_kernel` adds them in a
  fixed order (the same bits every run: no atomics), adds the bias and rounds once; a launch
  with enough programs writes y directly.
- **CUDA-graph capturable.** The grid, the blocks and the split depend only on the shapes and the
  device's SM count (read once, a host query): no `.item()`, no host sync; the partials'
  scratch is an ordinary allocation (a captured graph's pool holds it).

Precision: fp32 activations multiply in fp32 (`tl.dot(..., input_precision="ieee")`, no TF32).
Under the Triton interpreter (TRITON_INTERPRET=1) `tl.dot` on bf16 operands is wrong (it
multiplies the raw bit patterns, see `lora_triton.py`), so bf16 operands are upcast to fp32
there. The reference rounds the dequantized weight to x's dtype before its GEMM; this kernel
multiplies the exact codes and applies the fp32 scale after, so in bf16/fp16 it differs from the
reference by about one rounding of the weight (the tests' tolerance says how much).

`lorafleet/bench/gpu_micro.py` times it (int8 and int4) against bf16 `F.linear`, torchao's weight-only
kernels and the device's copy bandwidth on Llama-3-8B's projections; `CANDIDATES` are the
configurations it compares (the first is `CONFIG`, until a GPU run says otherwise).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lorafleet.kernels.triton_utils import upcast as upcast_dtype


@dataclass(frozen=True)
class Config:
    group_k: int = 128        # the largest K step under one scale (a power of two >= 32)
    tile_k: int = 256         # K elements a loop iteration reads per row at T = 1 (steps unrolled: tile_k // GK)
    tile_k_decode: int = 128  # the same at T <= 16 (the 16-row dot tiles hold registers)
    block_n_gemv: int = 64    # output rows per program at T = 1
    block_n_decode: int = 64  # output rows per program at T <= 16
    block_n_prefill: int = 128  # output rows per program at T > 16 (64 with fp32 activations)
    tile_k_prefill: int = 64  # the same at T > 16
    waves: int = 4            # programs per SM below which K is split
    warps: int = 4
    warps_prefill: int = 8
    stages: int = 3

    def __post_init__(self):
        for v in (self.group_k, self.tile_k, self.tile_k_decode, self.tile_k_prefill):
            if v < 32 or v & (v - 1):
                raise ValueError(f"invalid quantized matmul config {self}: group_k and tile_k are powers of two >= 32")


CONFIG = Config()
CANDIDATES = (CONFIG, Config(tile_k=512), Config(group_k=64, tile_k=128, tile_k_decode=64),
              Config(block_n_gemv=32, block_n_decode=32), Config(block_n_gemv=128, warps=8), Config(waves=8))
DECODE_ROWS = 16   # up to this many rows: the decode form (16-row dot tiles)
SUM_BLOCK = 256    # output columns per program of `_sum_kernel`


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """a [M, W] (x's dtype) @ b [W, N] (fp32 codes) in fp32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b, input_precision="ieee")
    return tl.dot(a, b.to(a.dtype))


@triton.jit
def _qmm_kernel(x_ptr, q_ptr, s_ptr, o_ptr, b_ptr, y_ptr, T, N, K, QK, SG, G, K_SPLIT, stride_x, stride_y,
                INT4: tl.constexpr, HAS_OFF: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                UPCAST: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GK: tl.constexpr, W: tl.constexpr, SUB: tl.constexpr):
    """Rows [pid0 * BLOCK_M, ..) of x times output rows [pid1 * BLOCK_N, ..) of the weight over K
    range [pid2 * K_SPLIT, ..): into y (PARTIAL: fp32 partials [splits, T, N]), else y[t, n] in
    y's dtype with the bias. QK: the codes' row length (K or K / 2), SG: the scales' and offsets' (K / G); W:
    the bytes of codes a row has in a K step of GK elements (GK / 2 or GK)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(2)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = ns < N
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    js = tl.arange(0, W)
    xk = js
    if INT4:
        xk = (js // 16) * 32 + js % 16   # the columns of x the low nibbles of a step's bytes multiply
    qrow = ns.to(tl.int64) * QK
    srow = ns.to(tl.int64) * SG
    if BLOCK_M == 1:
        xrow = x_ptr + pid_m.to(tl.int64) * stride_x
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, GK * SUB):
            for sub in tl.static_range(SUB):
                kk = k0 + sub * GK
                live = kk < k_hi   # a step past the range (the unrolled tail): nothing read
                lmask = ns < tl.where(live, N, 0)
                sc = tl.load(s_ptr + srow + kk // G, mask=lmask, other=0.0).to(tl.float32)
                c = tl.load(q_ptr + qrow[:, None] + (kk // (GK // W) + js)[None, :], mask=lmask[:, None], other=0)
                xmask = js < tl.where(live, W, 0)
                xl = tl.load(xrow + kk + xk, mask=xmask, other=0.0).to(tl.float32)
                if INT4:
                    xh = tl.load(xrow + kk + 16 + xk, mask=xmask, other=0.0).to(tl.float32)
                    lo = (c & 15).to(tl.float32) - 8.0
                    hi = (c >> 4).to(tl.float32) - 8.0
                    part = tl.sum(lo * xl[None, :] + hi * xh[None, :], axis=1)
                else:
                    part = tl.sum(c.to(tl.float32) * xl[None, :], axis=1)
                acc += part * sc
                if HAS_OFF:
                    xs = tl.sum(xl, axis=0)
                    if INT4:
                        xs += tl.sum(xh, axis=0)
                    acc += xs * tl.load(o_ptr + srow + kk // G, mask=lmask, other=0.0)
        if PARTIAL:
            tl.store(y_ptr + (pid_k * T + pid_m).to(tl.int64) * N + ns, acc, mask=nmask)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + ns, mask=nmask, other=0.0).to(tl.float32)
            tl.store(y_ptr + pid_m.to(tl.int64) * stride_y + ns, acc.to(y_ptr.dtype.element_ty), mask=nmask)
    else:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < T
        xrows = x_ptr + rows[:, None].to(tl.int64) * stride_x
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, GK * SUB):
            for sub in tl.static_range(SUB):
                kk = k0 + sub * GK
                live = kk < k_hi   # a step past the range (the unrolled tail): nothing read
                lmask = ns < tl.where(live, N, 0)
                sc = tl.load(s_ptr + srow + kk // G, mask=lmask, other=0.0).to(tl.float32)
                # the codes transposed, [W, BLOCK_N]: each output row's run contiguous along dim 0
                c = tl.load(q_ptr + qrow[None, :] + (kk // (GK // W) + js)[:, None], mask=lmask[None, :], other=0)
                xmask = (rows < tl.where(live, T, 0))[:, None]
                xl = tl.load(xrows + (kk + xk)[None, :], mask=xmask, other=0.0)
                if INT4:
                    xh = tl.load(xrows + (kk + 16 + xk)[None, :], mask=xmask, other=0.0)
                    part = _dot(xl, (c & 15).to(tl.float32) - 8.0, UPCAST) + \
                        _dot(xh, (c >> 4).to(tl.float32) - 8.0, UPCAST)
                else:
                    part = _dot(xl, c.to(tl.float32), UPCAST)
                acc += part * sc[None, :]
                if HAS_OFF:
                    xs = tl.sum(xl.to(tl.float32), axis=1)
                    if INT4:
                        xs += tl.sum(xh.to(tl.float32), axis=1)
                    acc += xs[:, None] * tl.load(o_ptr + srow + kk // G, mask=lmask, other=0.0)[None, :]
        omask = rmask[:, None] & nmask[None, :]
        if PARTIAL:
            tl.store(y_ptr + (pid_k * T + rows[:, None]).to(tl.int64) * N + ns[None, :], acc, mask=omask)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + ns, mask=nmask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + ns[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=omask)


@triton.jit
def _sum_kernel(p_ptr, b_ptr, y_ptr, T, N, SPLITS, stride_y, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y[t, n] = sum over splits of the partials (in split order) + bias[n], rounded once."""
    t = tl.program_id(0).to(tl.int64)
    ns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    nmask = ns < N
    acc = tl.load(p_ptr + t * N + ns, mask=nmask, other=0.0)
    for s in range(1, SPLITS):
        acc += tl.load(p_ptr + (s * T + t) * N + ns, mask=nmask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + ns, mask=nmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_y + ns, acc.to(y_ptr.dtype.element_ty), mask=nmask)


@functools.cache
def _sms(device: torch.device) -> int:
    """The device's SM count (a host query, cached; 4 off a GPU, where the interpreter runs)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class Launch:
    """What `linear` launches for a shape: blocks, the K step and unroll, the split, the warps."""
    block_m: int
    block_n: int
    gk: int
    sub: int
    k_split: int
    splits: int
    warps: int


def plan(t: int, n: int, k: int, group: int, fp32: bool, sms: int, cfg: Config = CONFIG) -> Launch:
    """The launch for x [t, k] times a weight [n, k] in groups of `group` (host arithmetic only)."""
    cap = 32 if fp32 and t > 1 else cfg.group_k  # fp32 dots are FMA loops: wider steps spill registers
    gk = next(p for p in (256, 128, 64, 32) if p <= cap and group % p == 0)
    sub = max(1, (cfg.tile_k if t == 1 else cfg.tile_k_decode if t <= DECODE_ROWS else cfg.tile_k_prefill) // gk)
    if t == 1:
        bm, bn = 1, cfg.block_n_gemv
    elif t <= DECODE_ROWS:
        bm, bn = 16, cfg.block_n_decode
    else:
        bm = 32 if t <= 32 or fp32 else 64
        bn = min(cfg.block_n_prefill, 64) if fp32 else cfg.block_n_prefill
    programs = triton.cdiv(t, bm) * triton.cdiv(n, bn)
    steps = k // gk
    splits = 1 if programs >= cfg.waves * sms else min(steps, triton.cdiv(cfg.waves * sms, programs))
    k_split = triton.cdiv(steps, splits) * gk
    return Launch(bm, bn, gk, sub, k_split, triton.cdiv(k, k_split), cfg.warps if t <= DECODE_ROWS else cfg.warps_prefill)


def linear(x: torch.Tensor, q: torch.Tensor, bias: torch.Tensor | None, scales: torch.Tensor,
           offsets: torch.Tensor | None = None, config: Config | None = None) -> torch.Tensor:
    """x [T, K] (bf16, fp16, fp32; rows may be strided) times the quantized weight (codes q int8
    [N, K] or uint8 [N, K / 2], scales [N, K / G], offsets float32 [N, K / G] or None), + bias [N]:
    [T, N] in x's dtype (see the module doc). Capturable in a CUDA graph."""
    cfg = config or CONFIG
    t, k = x.shape
    n = q.shape[0]
    int4 = q.dtype == torch.uint8
    bad_offsets = offsets is not None and (offsets.shape != scales.shape or offsets.dtype != torch.float32)
    if q.dtype not in (torch.int8, torch.uint8) or q.shape[1] * (2 if int4 else 1) != k or scales.shape[0] != n \
            or k % scales.shape[1] or bad_offsets:
        raise ValueError(f"quantized linear: x {tuple(x.shape)}, codes {q.dtype} {tuple(q.shape)}, scales "
                         f"{tuple(scales.shape)}, offsets {None if offsets is None else tuple(offsets.shape)} "
                         "do not fit")
    group = k // scales.shape[1]
    if group % 32:
        raise ValueError(f"quantized linear: group {group} is not a multiple of 32")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"quantized linear: activations must be fp32, bf16 or fp16, not {x.dtype}")
    y = x.new_empty(t, n)
    if t == 0 or n == 0:
        return y
    if x.stride(1) != 1:
        x = x.contiguous()
    q, scales = q.contiguous(), scales.contiguous()
    has_off = offsets is not None
    o = scales if offsets is None else offsets.contiguous()  # any pointer without offsets (never read)
    fp32 = x.dtype == torch.float32
    lp = plan(t, n, k, group, fp32, _sms(x.device), cfg)
    has_bias = bias is not None
    upcast = fp32 or upcast_dtype(x.dtype, _qmm_kernel)
    grid = (triton.cdiv(t, lp.block_m), triton.cdiv(n, lp.block_n), lp.splits)
    dst = y if lp.splits == 1 else torch.empty(lp.splits, t, n, dtype=torch.float32, device=x.device)
    b = bias if has_bias else scales  # any pointer when there is no bias (never read)
    _qmm_kernel[grid](x, q, scales, o, b, dst, t, n, k, q.shape[1], scales.shape[1], group, lp.k_split,
                      x.stride(0), y.stride(0), INT4=int4, HAS_OFF=has_off, HAS_BIAS=has_bias,
                      PARTIAL=lp.splits > 1, UPCAST=upcast,
                      BLOCK_M=lp.block_m, BLOCK_N=lp.block_n, GK=lp.gk, W=lp.gk // 2 if int4 else lp.gk,
                      SUB=lp.sub, num_warps=lp.warps,
                      num_stages=cfg.stages)
    if lp.splits > 1:
        _sum_kernel[(t, triton.cdiv(n, SUM_BLOCK))](dst, b, y, t, n, lp.splits, y.stride(0), HAS_BIAS=has_bias,
                                                    BLOCK=SUM_BLOCK, num_warps=4)
    return y
