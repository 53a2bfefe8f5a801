"""A GGUF tensor's data as lorafleet holds it (`gguf.py` reads the file, undoes llama.cpp's row
permutation and chooses which of these each weight takes), from the memory-mapped file, a few
rows at a time where it is computed, so a tensor's fp32 copy is never whole:

- `float_tensor`: F32, F16, BF16 as they are;
- `blocks`: Q8_0 and Q4_0, byte for byte lorafleet's int8 / int4 codes and float16 scales;
- `affine`: the types whose groups of 32 are scale * q + offset (`gguf_quants.AFFINE`), as codes,
  float16 scales and float32 offsets (`quant.from_affine`);
- `requantized`: any block type dequantized (`gguf_quants`) and requantized to int8 in groups;
- `dequantized`: any block type in float32.
Rows come in the file's order.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from lorafleet.model import gguf_quants, quant

T = gguf.GGMLQuantizationType
FLOAT_TYPES = {T.F32: np.float32, T.F16: np.float16}
ROWS_AT_ONCE = 1 << 22  # values computed at once: about 16 MB of fp32


def _raw(t) -> np.ndarray:
    """The tensor's bytes as rows [N, K / B * S]."""
    n, k = t.shape
    block, size = gguf.GGML_QUANT_SIZES[t.type]
    return np.asarray(t.data).reshape(n, k // block * size)


def _row_steps(t):
    n, k = t.shape
    step = max(1, ROWS_AT_ONCE // k)
    return [slice(r, r + step) for r in range(0, n, step)]


def float_tensor(t) -> torch.Tensor:
    if t.type == T.BF16:
        bits = np.ascontiguousarray(t.data).view(np.int16).reshape(t.shape).copy()
        return torch.from_numpy(bits).view(torch.bfloat16)
    return torch.from_numpy(np.asarray(t.data, dtype=FLOAT_TYPES[t.type]).reshape(t.shape).copy())


def dequantized(t, rows: slice = slice(None)) -> torch.Tensor:
    """A block-type tensor's `rows` in float32 (`gguf_quants`)."""
    return gguf_quants.dequantize(torch.from_numpy(np.ascontiguousarray(_raw(t)[rows])), t.type)


def affine(t, scheme: str, shift: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """An affine type's codes (q - shift in `scheme`), float16 scales and float32 offsets (None
    where it has none)."""
    n, k = t.shape
    size = gguf.GGML_QUANT_SIZES[t.type][1]
    raw, parts = _raw(t), []
    for rows in _row_steps(t):
        chunk = torch.from_numpy(np.ascontiguousarray(raw[rows]))
        m = chunk.shape[0]
        q, scale, offset = gguf_quants.affine(chunk.reshape(-1, size), t.type)
        parts.append(quant.from_affine(q.reshape(m, k), scale.reshape(m, -1),
                                       None if offset is None else offset.reshape(m, -1), scheme, shift))
    codes, scales, offsets = zip(*parts)
    return torch.cat(codes), torch.cat(scales), None if offsets[0] is None else torch.cat(offsets)


def requantized(t, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Any block type as int8 codes with float16 scales in groups of `group`: each value within
    half an int8 step of its group's largest."""
    n, k = t.shape
    q = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // group, dtype=torch.float16)
    for rows in _row_steps(t):
        q[rows], scales[rows] = quant.quantize(dequantized(t, rows), "int8", group)
    return q, scales


def blocks(t) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 or Q4_0 tensor's blocks as (codes, float16 scales [N, K / 32])."""
    n, k = t.shape
    block, size = gguf.GGML_QUANT_SIZES[t.type]
    b = np.asarray(t.data).reshape(n, k // block, size)
    scales = torch.from_numpy(np.ascontiguousarray(b[..., :2]).view(np.float16).reshape(n, k // block))
    if t.type == T.Q8_0:
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k))
    else:  # Q4_0's 16 bytes a block are our int4 codes' layout already
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).reshape(n, k // 2))
    return q, scales
