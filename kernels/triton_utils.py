"""What the Triton kernels' launchers share: tile sizes and the dtype rule of their dot products."""

from __future__ import annotations

import torch
import triton


def block(n: int, lo: int, hi: int) -> int:
    """A tile's size for `n` items: the power of two covering it, within [lo, hi]."""
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


def interpreted(kernel) -> bool:
    """Whether `kernel` (a `@triton.jit` function) runs under the interpreter: triton decides when
    a kernel is decorated, i.e. when its module is first imported (TRITON_INTERPRET=1 by then)."""
    return type(kernel).__name__ == "InterpretedFunction"


def upcast(dtype: torch.dtype, kernel) -> bool:
    """Whether dot operands of this dtype are upcast to fp32 (ieee) rather than multiplied as is:
    fp32 always; bf16 under the interpreter (numpy has no bf16 dot)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreted(kernel))
