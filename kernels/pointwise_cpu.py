"""The CPU row-wise ops of a decode step, each one call that reads its rows once: RMSNorm, the residual add with
the next RMSNorm, RoPE of q and k in place, SiLU(gate) * up, the KV write into the pool's pages, and the greedy
pick of each row's token. Why: a layer's many small torch ops (a norm is six, RoPE seven a tensor, the KV write
two `index_put_`) cost their dispatch at decode, not their arithmetic, and torch's CPU `argmax` is not vectorised.

Semantics: each op is its namesake in `reference.py`, computed in fp32 and rounded to the tensor's dtype where the
reference rounds (bf16: after the normalisation and after the weight; each RoPE product and their sum; SiLU and the
product), so bf16 results are the reference's bit for bit but for the order of the norm's sum. Rows go over torch's
threads only when there are enough of them (prefill). Built in the CPU kernels' one extension (`cpu_module`);
LORAFLEET_KERNELS=torch chooses the references.
"""

from __future__ import annotations

import torch

from lorafleet.kernels.cpu_module import load  # the CPU kernels' one extension


FUNCTIONS = ["rms_norm", "add_rms_norm", "rope_", "silu_mul", "write_kv", "greedy"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return load().rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return load().add_rms_norm(x, delta, weight, eps)


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    load().rope_(q, k, cos, sin, positions)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    return load().silu_mul(gu)


def write_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_pages: torch.Tensor,
             slot_offsets: torch.Tensor) -> None:
    load().write_kv(kv, k, v, slot_pages, slot_offsets)


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return load().greedy(logits)
