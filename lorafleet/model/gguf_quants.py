"""llama.cpp's block types, dequantized in torch: the reference every kernel and every conversion
of a GGUF tensor is checked against (itself checked against the `gguf` package's
`gguf.quants.dequantize` on random blocks, tests/unit/test_gguf_quants.py).

A tensor of a block type is rows of blocks: each row of K values is K / B blocks of S bytes
(`gguf.GGML_QUANT_SIZES[type]` = (B, S)). `dequantize(raw, type)` takes the rows' bytes, uint8
[..., K / B * S], on any device, and gives float32 [..., K]. The layouts, from ggml's block
structs (`d`, `m`, `dmin`: float16; `q`: the codes; element i of a block is the i-th value):

- Q4_0 (32, 18): d, 16 bytes: byte j's low nibble is element j, its high nibble element j + 16;
  v = d (q - 8). Q4_1 (32, 20): d, m, the same nibbles; v = d q + m.
- Q5_0 (32, 22): d, 4 bytes of fifth bits (bit i of their little-endian word: element i), Q4_0's
  nibbles; v = d (q - 16). Q5_1 (32, 24): d, m, the same; v = d q + m.
- Q8_0 (32, 34): d, 32 int8; v = d q.
- Q2_K (256, 84): 16 bytes of 4-bit scale (low) and min (high) for 16 groups of 16, 64 bytes of
  2-bit codes (byte j of half h holds elements h 128 + s 32 + j at bits 2s), d, dmin;
  v = d sc q - dmin mn.
- Q3_K (256, 110): 32 bytes of high bits (bit b of byte j: element 32 b + j; a bit that is 0
  subtracts 4), 64 bytes of 2-bit low codes as Q2_K's, 12 bytes of 6-bit signed scales (16
  groups of 16, +32 offset: low nibbles in bytes 0-7, two high bits in bytes 8-11), d;
  v = d (sc - 32) q.
- Q4_K (256, 144): d, dmin, 12 bytes of 6-bit scales and mins for 8 groups of 32, 128 bytes of
  nibbles (32-byte chunk c: low nibbles group 2c, high nibbles group 2c + 1); v = d sc q - dmin mn.
- Q5_K (256, 176): Q4_K's, with 32 bytes of fifth bits (bit g of byte j: group g's element j).
- Q6_K (256, 210): 128 bytes of low nibbles, 64 bytes of two high bits, 16 int8 scales (groups of
  16), d; v = d sc (q - 32).
"""

from __future__ import annotations

import gguf
import torch

T = gguf.GGMLQuantizationType
QK_K = 256
# the block types lorafleet reads (`gguf.py`); IQ and ternary types are refused by name
BLOCK_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)


def block_shape(qtype: T) -> tuple[int, int]:
    """(values, bytes) of one block."""
    return gguf.GGML_QUANT_SIZES[qtype]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] bytes -> float32 [n, 1]."""
    return b.contiguous().view(torch.float16).float()


def _shifted(b: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """b [..., n] -> [..., len(shifts), n]: (b >> s) & mask for each shift."""
    s = torch.tensor(shifts, dtype=torch.uint8, device=b.device).view(-1, 1)
    return (b.unsqueeze(-2) >> s) & mask


def _nibbles(qs: torch.Tensor, chunk: int) -> torch.Tensor:
    """Bytes in chunks of `chunk`: each chunk's low nibbles, then its high ones."""
    n = qs.shape[0]
    return _shifted(qs.reshape(n, -1, chunk), (0, 4), 0x0F).reshape(n, -1)


def _bits(b: torch.Tensor) -> torch.Tensor:
    """[n, m] bytes -> [n, 8 m] bits, little-endian within each byte."""
    return _shifted(b, tuple(range(8)), 1).transpose(-1, -2).reshape(b.shape[0], -1)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> 8 6-bit scales and 8 6-bit mins (float32 [n, 8] each)."""
    s = s.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], -1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], -1)
    return sc.float(), mn.float()


# the types whose every 32 values are v = scale * q + offset, q small integers (`affine`): they map
# onto lorafleet's int4 / int8 codes with a float16 scale, and an offset, per group of 32
AFFINE = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K)


def affine(raw: torch.Tensor, qtype: T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Blocks [n, S] of an `AFFINE` type -> (q int16 [n, B], scale float32 [n, B / 32], offset float32
    [n, B / 32] or None): each group of 32 values is scale * q + offset (as `dequantize` computes
    them, bit for bit)."""
    n = raw.shape[0]
    if qtype == T.Q8_0:
        return raw[:, 2:].contiguous().view(torch.int8).to(torch.int16), _f16(raw[:, :2]), None
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        offset = 4 if qtype in (T.Q4_1, T.Q5_1) else 2       # d (and m)
        high = 4 if qtype in (T.Q5_0, T.Q5_1) else 0         # bytes of fifth bits
        q = _nibbles(raw[:, offset + high:], 16).to(torch.int16)
        if high:
            q = q + 16 * _bits(raw[:, offset:offset + 4]).to(torch.int16)
        if qtype in (T.Q4_1, T.Q5_1):
            return q, _f16(raw[:, :2]), _f16(raw[:, 2:4])
        return q - (16 if high else 8), _f16(raw[:, :2]), None
    if qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(raw[:, :2]), _f16(raw[:, 2:4])
        sc, mn = _k_scales(raw[:, 4:16])
        fifth = qtype == T.Q5_K
        q = _nibbles(raw[:, 48 if fifth else 16:], 32).reshape(n, 8, 32).to(torch.int16)
        if fifth:
            q = q + 16 * _shifted(raw[:, 16:48], tuple(range(8)), 1).to(torch.int16)
        return q.reshape(n, QK_K), d * sc, -(dmin * mn)
    raise ValueError(f"GGUF type {qtype.name} is not affine in groups of 32")


def _blocks(raw: torch.Tensor, qtype: T) -> torch.Tensor:
    """float32 [n, B] from blocks [n, S]."""
    n = raw.shape[0]
    if qtype in AFFINE:
        q, scale, offset = affine(raw, qtype)
        v = q.float().view(n, -1, 32) * scale.view(n, -1, 1)
        return (v if offset is None else v + offset.view(n, -1, 1)).view(n, -1)
    if qtype == T.Q2_K:
        scales, qs = raw[:, :16], raw[:, 16:80]
        d, dmin = _f16(raw[:, 80:82]), _f16(raw[:, 82:84])
        q = _shifted(qs.reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16).float()
        return (d.view(n, 1, 1) * (scales & 0x0F).float().unsqueeze(-1) * q
                - dmin.view(n, 1, 1) * (scales >> 4).float().unsqueeze(-1)).reshape(n, QK_K)
    if qtype == T.Q3_K:
        hmask, qs, s, d = raw[:, :32], raw[:, 32:96], raw[:, 96:108], _f16(raw[:, 108:110])
        low = _shifted(s[:, :8], (0, 4), 0x0F).reshape(n, 16)
        high = _shifted(s[:, 8:], (0, 2, 4, 6), 3).reshape(n, 16)
        sc = (low | (high << 4)).float() - 32
        ql = _shifted(qs.reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16).float()
        qh = _shifted(hmask, tuple(range(8)), 1).reshape(n, 16, 16).float()
        return (d.view(n, 1, 1) * sc.unsqueeze(-1) * (ql - 4 * (1 - qh))).reshape(n, QK_K)
    if qtype == T.Q6_K:
        ql, qh, scales, d = raw[:, :128], raw[:, 128:192], raw[:, 192:208], _f16(raw[:, 208:210])
        low = _nibbles(ql, 64).reshape(n, 8, 32)
        high = _shifted(qh.reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 8, 32)
        q = (low | (high << 4)).float().reshape(n, 16, 16) - 32
        sc = scales.contiguous().view(torch.int8).float()
        return (d.view(n, 1, 1) * sc.unsqueeze(-1) * q).reshape(n, QK_K)
    raise ValueError(f"GGUF type {qtype.name} has no reference dequantizer here")


def dequantize(raw: torch.Tensor, qtype: T) -> torch.Tensor:
    """Rows of `qtype` blocks, uint8 [..., K / B * S] -> float32 [..., K]."""
    values, size = block_shape(qtype)
    if raw.dtype != torch.uint8 or raw.shape[-1] % size:
        raise ValueError(f"{qtype.name} rows are uint8 multiples of {size} bytes, not {raw.dtype} {tuple(raw.shape)}")
    lead = raw.shape[:-1]
    out = _blocks(raw.reshape(-1, size), qtype)
    return out.reshape(*lead, raw.shape[-1] // size * values)
