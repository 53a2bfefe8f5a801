"""A CPU decode step in one C++ call each: `decode_layers` runs `LlamaModel.forward`'s loop over its layers,
`decode_forward` the whole forward pass, `decode_batch` builds the step's inputs. Why: the Python between a
step's many kernel calls, each cold once the weights have streamed through the caches, is a noticeable share
of a memory-bound step. The driver (`cpu/decode_layers.cpp`) is compiled in the CPU kernels' one extension
(`cpu_module`) after their sources and calls their C++ directly (`pn::`, `lin::`, `qt::`, `pw::`, `lo::`, `att::`).

Semantics: the Python loop's on the CPU kernels, op for op in its order, so the result is the same bit for bit
(`tests/kernels/test_decode_layers_cpu.py` asserts it); rows past `linear_cpu.max_rows()` go to torch's GEMM, as
`lin::linear` sends every caller's. Decode rows only (one query token per sequence): a step with a prefill row
runs the Python loop. LORAFLEET_KERNELS=torch chooses the reference.
"""

from __future__ import annotations

import numpy as np
import torch

from lorafleet.kernels.cpu_module import load
from lorafleet.kernels.reference import DecodeWeights

FUNCTIONS = ["decode_layers", "decode_forward", "decode_batch"]


def decode_layers(x: torch.Tensor, layers: list, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor, meta, scale: float, eps: float, heads: int, kv_heads: int,
                  head_dim: int, lora=None) -> torch.Tensor:
    """Every layer of a decode-only step (`meta.num_decode == len(x)`): x [T, H] the embedded tokens
    (updated in place, as the Python loop does); `layers` the model's `reference.Layer`s flattened; `meta`
    the step's `AttentionMetadata`; `lora` a `adapters.batch.LoraBatch` or None. Returns the last layer's
    MLP output, for the caller to add."""
    return load().decode_layers(x, layers, *_step_args(kv, cos, sin, positions, meta, scale, eps, heads, kv_heads,
                                                      head_dim, lora))


def _step_args(kv, cos, sin, positions, meta, scale, eps, heads, kv_heads, head_dim, lora) -> tuple:
    """The arguments after the weights, in the C++ `decode_layers` and `decode_forward`'s order: the pool,
    RoPE tables, attention metadata, the model's numbers, the LoRA pool and segments (none without adapters)."""
    lora_tensors = [] if lora is None else [lora.weights, lora.seg]
    return (kv, cos, sin, positions, meta.slot_pages, meta.slot_offsets, meta.decode_block_tables,
            meta.decode_context_lens, scale, eps, heads, kv_heads, head_dim, lora_tensors)


def decode_forward(w: DecodeWeights, input_ids: torch.Tensor, positions: torch.Tensor, meta, kv: torch.Tensor,
                   logits_rows: torch.Tensor, lora=None) -> torch.Tensor:
    """The forward pass of a decode-only step (`meta.num_decode == len(input_ids)`) on `w`'s tensors:
    fp32 logits [S, V] for `logits_rows`, the Python forward's bit for bit (the same ops in its order)."""
    return load().decode_forward(input_ids, logits_rows, w.embed, w.embed_s, w.layers, w.norm, w.lm_head,
                                 w.lm_head_s, w.lm_head_o,
                                 *_step_args(kv, w.cos, w.sin, positions, meta, w.scale, w.eps, w.heads,
                                             w.kv_heads, w.head_dim, lora))


def decode_batch(table, rows: list[int], starts: list[int], ids: list[int], block_size: int) -> list[np.ndarray]:
    """`ModelRunner.inputs` for n sequences that each decode and sample one token: `StepInputs`' ids,
    positions, slot pages, slot offsets, context lengths, logits rows and block tables [n, width] (as wide
    as the longest sequence needs: attention reads `lens` tokens), int64 views of one allocation.
    `table`: the KV manager's block table (numpy int64); `rows`: each sequence's row in it; `starts`: its
    tokens computed so far; `ids`: its token."""
    flat, n = load().decode_batch(torch.from_numpy(table), rows, starts, ids, block_size).numpy(), len(rows)
    return [*(flat[k * n:(k + 1) * n] for k in range(6)), flat[6 * n:].reshape(n, -1)]
