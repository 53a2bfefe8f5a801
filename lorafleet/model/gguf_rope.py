"""A GGUF file's rope scaling (`gguf.py`): llama.cpp stores a llama3 rope as a tensor,
`rope_freqs.weight`, each frequency's divisor; its parameters are recovered from it and checked
to give the same frequencies."""

from __future__ import annotations

import math

import numpy as np

from lorafleet.errors import UnsupportedModelError
from lorafleet.model.config import ModelConfig

ROPE_FREQS = "rope_freqs.weight"


def llama3_rope(freqs: np.ndarray, theta: float, head_dim: int, source: str) -> dict | None:
    """Rope scaling from llama.cpp's rope_freqs tensor (each frequency's divisor): linear when they
    are all one factor, else llama3's parameters, recovered and checked to give the same divisors.
    In the blend, s = orig / ((high - low) * wavelen) - low / (high - low): only a = orig / (high -
    low) and b = low / (high - low) matter, so low = 1 is taken."""
    factor = float(freqs.max())
    if len(freqs) != head_dim // 2:
        raise UnsupportedModelError(f"{source}: {ROPE_FREQS} has {len(freqs)} values, not {head_dim // 2}")
    if np.allclose(freqs, 1.0):
        return None
    if np.allclose(freqs, factor):
        return {"rope_type": "linear", "factor": factor}
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float64) / head_dim))
    x = inv / (2 * math.pi)  # 1 / wavelen
    mid = (freqs > 1 + 1e-6) & (freqs < factor * (1 - 1e-6))
    s = (1 / freqs[mid] - 1 / factor) / (1 - 1 / factor)
    low, high, orig = 1.0, 4.0, 0.0  # with fewer than two blended frequencies: Llama 3's low and high
    if mid.sum() >= 2:
        a, c = np.polyfit(x[mid], s, 1)  # s = a x - b, b = -c
        if c < 0:
            high, orig = 1.0 - 1.0 / c, -a / c
    elif mid.sum() == 1:
        orig = (3 * s[0] + 1) / x[mid][0]
    else:  # every wavelength below orig / 4 is kept, every one above orig slowed: orig between
        ones, slow = x[freqs <= 1 + 1e-6], x[freqs >= factor * (1 - 1e-6)]
        lo, hi = 4 / ones.min() if len(ones) else 0.0, 1 / slow.max() if len(slow) else math.inf
        orig = 8192.0 if lo < 8192 < hi else math.sqrt(lo * hi) if lo and math.isfinite(hi) else 0.0
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
               "original_max_position_embeddings": orig}
    if high > low and orig > 0:
        from lorafleet.model.llama import rope_inv_freq

        cfg = ModelConfig(family="llama", vocab_size=1, hidden_size=head_dim, intermediate_size=1, num_layers=1,
                          num_heads=1, num_kv_heads=1, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=theta,
                          rope_scaling=scaling)
        got = rope_inv_freq(cfg).double().numpy()
        if np.allclose(got, inv / freqs, rtol=1e-4, atol=0):
            return scaling
    raise UnsupportedModelError(f"{source}: {ROPE_FREQS} is not a rope scaling lorafleet reproduces (linear or llama3)")
