"""Each GGUF block type's torch dequantizer (`model/gguf_quants.py`) equals the `gguf` package's
`gguf.quants.dequantize` on random blocks: every byte random but the float16 scales, kept finite
and of a weight's size (random float16 bits would be infinities and NaNs, which both sides carry
alike but compare unequal)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from lorafleet.model import gguf_quants

pytestmark = pytest.mark.unit

T = gguf.GGMLQuantizationType
# where each block type keeps its float16 scales (byte offsets)
HALVES = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q2_K: (80, 82),
          T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_NL: (0,)}
# the values' standard deviation with every float16 scale at 1 (measured): scales of 0.05 / this
# give values of a trained weight's size
UNIT_STD = {T.Q4_0: 4.65, T.Q4_1: 4.64, T.Q5_0: 9.3, T.Q5_1: 9.3, T.Q8_0: 74.0, T.Q2_K: 12.9, T.Q3_K: 43.2,
            T.Q4_K: 218.0, T.Q5_K: 442.0, T.Q6_K: 1360.0, T.IQ4_NL: 4.65}


def random_blocks(qtype, rows: int, blocks: int, seed: int = 0, std: float | None = None) -> np.ndarray:
    """Random blocks; their float16 scales normal with `std` (default 0.01), or, for a weight,
    scaled to give values of standard deviation about `std`."""
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    scale = 0.01 if std is None else std / UNIT_STD[qtype]
    for at in HALVES[qtype]:
        d = (rng.uniform(0.5, 1.5, (rows, blocks)) * rng.choice([-1, 1], (rows, blocks)) * scale).astype(np.float16)
        raw[..., at:at + 2] = d.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, blocks * size)


def weight_blocks(qtype, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """A weight [N, K] of `qtype` blocks, values of a trained weight's size (std about 0.05)."""
    n, k = shape
    return random_blocks(qtype, n, k // gguf.GGML_QUANT_SIZES[qtype][0], seed, std=0.05)


@pytest.mark.parametrize("qtype", gguf_quants.BLOCK_TYPES, ids=lambda t: t.name)
def test_each_block_type_dequantizes_as_gguf_does(qtype):
    raw = random_blocks(qtype, rows=5, blocks=3)
    want = gguf.quants.dequantize(raw, qtype)
    got = gguf_quants.dequantize(torch.from_numpy(raw), qtype)
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32)))


def test_rows_and_leading_dimensions_are_kept_and_bad_rows_refused():
    raw = random_blocks(T.Q4_K, rows=6, blocks=2)
    flat = gguf_quants.dequantize(torch.from_numpy(raw), T.Q4_K)
    stacked = gguf_quants.dequantize(torch.from_numpy(raw).reshape(2, 3, -1), T.Q4_K)
    assert torch.equal(stacked.reshape(6, -1), flat)
    with pytest.raises(ValueError, match="multiples of 144 bytes"):
        gguf_quants.dequantize(torch.zeros(2, 100, dtype=torch.uint8), T.Q4_K)
    with pytest.raises(ValueError, match="IQ4_NL has no reference"):
        gguf_quants.dequantize(torch.zeros(1, 18, dtype=torch.uint8), T.IQ4_NL)
