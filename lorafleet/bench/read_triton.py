"""A vectorized read of a whole tensor (one fp32 sum per program): the rate a kernel that must read
that many bytes can reach on this device, launch and tail included. `gpu_micro.py` measures each
LoRA case against it at the case's own byte count."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 8192  # elements a program reads (16 KB of bf16)


@triton.jit
def _read_kernel(src_ptr, partial_ptr, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src_ptr + offs, mask=offs < N, other=0.0)
    tl.store(partial_ptr + pid, tl.sum(x.to(tl.float32), axis=0))


def programs(n: int) -> int:
    return triton.cdiv(n, BLOCK)


def read_all(src: torch.Tensor, partial: torch.Tensor) -> None:
    """partial[p] = the sum of src's elements [p * BLOCK, (p + 1) * BLOCK) (src flat, contiguous)."""
    _read_kernel[(programs(src.numel()),)](src, partial, src.numel(), BLOCK=BLOCK, num_warps=8)
