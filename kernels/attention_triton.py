"""The GPU paged-attention kernels: write this step's K/V into the pool's pages, decode attention
and batched causal prefill attention, all reading the pages in place (no gathered copy).

Semantics (identical to `reference.write_kv` and `reference.paged_attention`). The KV layout is
one layer's view of the unified pool, kv [P, 2, BLK, KVH, D] (K at 0, V at 1), usually a strided
view pool[:, layer] of [P, L, 2, BLK, KVH, D]: every stride is honoured. A sequence's token at
position p lives in page table[p // BLK] at slot p % BLK. Query head h reads kv head
h // (H // KVH) (GQA; H a multiple of KVH).
  write_kv       kv[slot_pages[t], 0, slot_offsets[t]] = k[t] and kv[..., 1, ...] = v[t].
  paged_decode   out[b, h] = softmax_{t < lens[b]}(scale * q[b, h] . K_t) @ V_t, with
                 K_t, V_t read through tables[b].
  paged_prefill  sequence s owns q rows [q_start[s], q_start[s] + q_len[s]) at positions
                 start_pos[s] .. start_pos[s] + q_len[s] - 1; the query at position p attends to
                 the keys at positions 0..p read through tables[s] (this step's K/V are already
                 in the pages: call write_kv first): out[row, h] = softmax(scale q.K) @ V.
                 Only those rows of `out` are written.
Scores and the softmax are fp32 (online softmax, one block of keys per iteration); the output is
rounded once to q's dtype.

Why it exists: the torch path gathers each sequence's context into a padded tensor per layer per
step and loops over prefill sequences in Python. Here every decode row is a (B, KVH) row of
programs, each reading its kv head's keys and values once for the query heads that share them,
and all prefill sequences share one launch over (S, query blocks, H); neither grid
depends on the lengths' values (decode at all; prefill only through `max_q_len`, which the caller
may pass as a static bound), so both can be captured in a CUDA graph.

Precision: fp32 inputs use `tl.dot(..., input_precision="ieee")` (no TF32). fp16/bf16 inputs
multiply in their own dtype with fp32 accumulation (the probabilities are rounded to that dtype
for P @ V, as flash attention does). Under the Triton interpreter (TRITON_INTERPRET=1) `tl.dot`
on bf16 operands is wrong (it multiplies the raw uint16 bit patterns), so bf16 operands are
upcast to fp32 there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorafleet.kernels.triton_utils import block, upcast as upcast_dtype


def _pad(n: int) -> int:
    """A power of two >= n and >= 16 (tl.dot wants every dimension >= 16)."""
    return max(16, triton.next_power_of_2(int(n)))


@triton.jit
def _write_kv_kernel(kv_ptr, k_ptr, v_ptr, pages_ptr, offsets_ptr,
                     s_p, s_2, s_t, s_h, s_d, sk0, sk1, sk2, sv0, sv1, sv2, KVH, D,
                     H_P: tl.constexpr, D_P: tl.constexpr):
    t = tl.program_id(0)
    page = tl.load(pages_ptr + t)
    slot = tl.load(offsets_ptr + t)
    hh = tl.arange(0, H_P)
    dd = tl.arange(0, D_P)
    mask = (hh[:, None] < KVH) & (dd[None, :] < D)
    dst = kv_ptr + page * s_p + slot * s_t + hh[:, None] * s_h + dd[None, :] * s_d
    kt = tl.load(k_ptr + t * sk0 + hh[:, None] * sk1 + dd[None, :] * sk2, mask=mask)
    vt = tl.load(v_ptr + t * sv0 + hh[:, None] * sv1 + dd[None, :] * sv2, mask=mask)
    tl.store(dst, kt.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + s_2, vt.to(kv_ptr.dtype.element_ty), mask=mask)


def write_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_pages: torch.Tensor,
             slot_offsets: torch.Tensor) -> None:
    """kv[slot_pages[t], 0, slot_offsets[t]] = k[t]; same for v at 1. kv: [P, 2, BLK, KVH, D]
    (any strides); k, v: [T, KVH, D] (any strides); slot_pages, slot_offsets: [T] int64."""
    T = k.shape[0]
    if T == 0:
        return
    _, _, _, kvh, d = kv.shape
    _write_kv_kernel[(T,)](kv, k, v, slot_pages.contiguous(), slot_offsets.contiguous(),
                           *kv.stride(), *k.stride(), *v.stride(), kvh, d,
                           H_P=triton.next_power_of_2(kvh), D_P=triton.next_power_of_2(d))


DECODE_TOKENS = 64  # keys one decode iteration reads: whole pages, at least one


@triton.jit
def _decode_kernel(q_ptr, kv_ptr, tables_ptr, lens_ptr, out_ptr, scale,
                   sq0, sq1, sq2, s_p, s_2, s_t, s_h, s_d, so0, so1, so2, st0, G, D,
                   UPCAST: tl.constexpr, BLK: tl.constexpr, TOK: tl.constexpr, TOK_P: tl.constexpr,
                   G_P: tl.constexpr, D_P: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    L = tl.load(lens_ptr + b)
    gg = tl.arange(0, G_P)
    dd = tl.arange(0, D_P)
    dmask = dd < D
    qmask = (gg < G)[:, None] & dmask[None, :]
    heads = kh * G + gg  # the query heads that read this kv head
    q = tl.load(q_ptr + b * sq0 + heads[:, None] * sq1 + dd[None, :] * sq2, mask=qmask, other=0.0)
    tok = tl.arange(0, TOK_P)
    m_i = tl.full([G_P], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P], dtype=tl.float32)
    acc = tl.zeros([G_P, D_P], dtype=tl.float32)
    for j in range(0, tl.cdiv(L, TOK)):  # TOK // BLK pages per iteration
        pos = j * TOK + tok
        tmask = (tok < TOK) & (pos < L)
        page = tl.load(tables_ptr + b * st0 + pos // BLK, mask=tmask, other=0)
        mask = tmask[:, None] & dmask[None, :]
        base = kv_ptr + page[:, None] * s_p + kh * s_h + (pos % BLK)[:, None] * s_t + dd[None, :] * s_d
        k = tl.load(base, mask=mask, other=0.0)                          # [TOK_P, D_P], once for G heads
        if UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))                                    # [G_P, TOK_P], fp32
        s = tl.where(tmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every iteration holds a key
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(base + s_2, mask=mask, other=0.0)
        if UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(out_ptr + b * so0 + heads[:, None] * so1 + dd[None, :] * so2, o.to(out_ptr.dtype.element_ty), mask=qmask)


def decode_warps(head_dim: int) -> int:
    """Warps of a decode program: 8 from 128 lanes of head_dim up (with 4, each thread would hold
    too many registers on sm_90: `tests/kernels/test_triton_compile.py` prints them)."""
    return 8 if _pad(head_dim) >= 128 else 4


def paged_decode(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """q: [B, H, D]; kv: [P, 2, BLK, KVH, D] (one layer's view of the pool, any strides); tables:
    [B, maxb] int64 (padding entries: any valid page); lens: [B] int64 (>= 1). Returns [B, H, D]
    in q's dtype. Grid (B, KVH), independent of the lengths' values: each program serves the
    H / KVH query heads that share its kv head (GQA), so each key and value is read once per
    sequence, not once per query head; it reads its context DECODE_TOKENS keys (whole pages) per
    iteration, not one page: the page ids and the keys of several pages are in flight at once,
    where one page a step left each program waiting on one dependent load after another. The
    heads' scores and sums are matrix products (`tl.dot`, the heads padded to 16 rows)."""
    B, H, D = q.shape
    _, _, blk, kvh, _ = kv.shape
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    tables = tables.contiguous()
    tok = blk * max(1, DECODE_TOKENS // blk)
    group = H // kvh
    _decode_kernel[(B, kvh)](q, kv, tables, lens.contiguous(), out, float(scale),
                             *q.stride(), *kv.stride(), *out.stride(), tables.stride(0), group, D,
                             UPCAST=upcast_dtype(q.dtype, _write_kv_kernel), BLK=blk, TOK=tok, TOK_P=_pad(tok), G_P=_pad(group),
                             D_P=_pad(D), num_warps=decode_warps(D))
    return out


@triton.jit
def _prefill_kernel(q_ptr, kv_ptr, out_ptr, q_start_ptr, q_len_ptr, start_pos_ptr, tables_ptr, scale,
                    sq0, sq1, sq2, s_p, s_2, s_t, s_h, s_d, so0, so1, so2, st0, G, D,
                    UPCAST: tl.constexpr, BLK: tl.constexpr, D_P: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    s = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    h = tl.program_id(2)
    kh = h // G
    q0 = tl.load(q_start_ptr + s)
    ql = tl.load(q_len_ptr + s)
    sp = tl.load(start_pos_ptr + s)
    if m0 >= ql:
        return
    ii = m0 + tl.arange(0, BLOCK_M)
    imask = ii < ql
    qpos = sp + ii
    dd = tl.arange(0, D_P)
    dmask = dd < D
    rows = (q0 + ii).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * sq0 + h * sq1 + dd[None, :] * sq2,
                mask=imask[:, None] & dmask[None, :], other=0.0)
    kv_end = sp + tl.minimum(m0 + BLOCK_M, ql)  # keys past the block's last query are masked anyway
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_P], dtype=tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        kp = n0 + tl.arange(0, BLOCK_N)
        kmask = kp < kv_end
        page = tl.load(tables_ptr + s * st0 + kp // BLK, mask=kmask, other=0)
        base = kv_ptr + page * s_p + (kp % BLK) * s_t + kh * s_h  # [BLOCK_N]
        kt = tl.load(base[None, :] + dd[:, None] * s_d, mask=dmask[:, None] & kmask[None, :], other=0.0)
        if UPCAST:
            qk = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
        else:
            qk = tl.dot(q, kt)
        valid = kmask[None, :] & (kp[None, :] <= qpos[:, None])
        qk = tl.where(valid, qk * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))  # finite: key 0 is in the first block
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(base[:, None] + s_2 + dd[None, :] * s_d, mask=kmask[:, None] & dmask[None, :], other=0.0)
        if UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * so0 + h * so1 + dd[None, :] * so2, o.to(out_ptr.dtype.element_ty),
             mask=imask[:, None] & dmask[None, :])


def paged_prefill(q: torch.Tensor, kv: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
                  start_pos: torch.Tensor, tables: torch.Tensor, scale: float, out: torch.Tensor,
                  max_q_len: int | None = None) -> None:
    """Causal attention of all prefill sequences in one launch (see the module docstring).
    q, out: [T, H, D] (any strides); kv: [P, 2, BLK, KVH, D]; q_start, q_len, start_pos: [S] int64;
    tables: [S, maxb] int64. max_q_len (an upper bound of q_len) is read from q_len when None or 0
    (a host sync); passed explicitly, the grid depends only on it (rows past it are skipped)."""
    S = q_len.shape[0]
    if S == 0:
        return
    _, H, D = q.shape
    _, _, blk, kvh, _ = kv.shape
    if not max_q_len:  # None, or 0 (AttentionMetadata's default when the caller left it unset)
        max_q_len = int(q_len.max())
    if max_q_len <= 0:
        return
    d_p = _pad(D)
    upcast = upcast_dtype(q.dtype, _write_kv_kernel)
    # fp32 products on CUDA cores (no TF32) hold far more registers: 16 x 32 tiles there, else
    # they spill on sm_90 (tests/kernels/test_triton_compile.py)
    block_m = block(max_q_len, 16, 16 if upcast else 64)
    block_n = 64 if d_p <= 64 and not upcast else 32
    tables = tables.contiguous()
    _prefill_kernel[(S, triton.cdiv(max_q_len, block_m), H)](
        q, kv, out, q_start.contiguous(), q_len.contiguous(), start_pos.contiguous(), tables, float(scale),
        *q.stride(), *kv.stride(), *out.stride(), tables.stride(0), H // kvh, D,
        UPCAST=upcast, BLK=blk, D_P=d_p, BLOCK_M=block_m, BLOCK_N=block_n)
