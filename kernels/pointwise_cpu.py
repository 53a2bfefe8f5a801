"""The CPU row-wise ops of a decode step, each one call: RMSNorm, the residual add with the next
RMSNorm, rotary embedding of q and k in place, SiLU(gate) * up, the KV write into the pool's
pages, and the greedy pick of each row's token.

Why they exist: between its four matmuls a Llama layer runs ~40 small torch ops (a norm is six:
pow, mean, add, rsqrt, mul, mul; RoPE is seven per tensor, plus two gathers of the cos/sin
tables). At decode each costs its dispatch, not its arithmetic, and together they took a large
share of the step's memory bound (measured on SmolLM2-135M's shapes). Here each is one call that
reads its rows once. Two more had the same cause: the KV write was two `index_put_` calls per
layer, and torch's `argmax`, unvectorised on the CPU, was slow over a large vocabulary (the
kernel: one vector pass per piece of a row).

Semantics: each op is its reference in `reference.py` (`rms_norm`, `add_rms_norm`, `rope_`,
`silu_mul`, `write_kv`, `greedy`), computed in fp32 and rounded to the tensor's dtype where the reference rounds
(bf16: after the normalisation and after the weight; each RoPE product and their sum; SiLU and
the product), so bf16 results are the reference's bit for bit but for the order of the norm's
sum. Rows are spread over torch's threads only when there are enough of them (prefill).
Built with the other CPU kernels, as one extension (`cpu_module`); LORAFLEET_KERNELS=torch chooses the
references.
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
