"""The decoder layers of a CPU decode step in one call: the loop of `LlamaModel.forward`
over its layers, in C++, calling the same C++ kernels the Python loop calls one by one.

Why: a decode step on `tiny` (8 layers) made ~100 kernel calls, and the Python between them
(argument passing, the qkv split into three views, each LoRA group's metadata view, the wrappers)
took a noticeable share of the step against the memory bound, beside the engine's bookkeeping.
Here a step's layers are one call; the model's Python still embeds the tokens and runs the final
norm and LM head. Steps with the one call are faster than with the Python loop, at batch 1 and 8,
with and without adapters.

How: the driver below is compiled in the CPU kernels' one extension (`cpu_module`), after the
kernels' sources (`panels_cpu` as `pn::`, `linear_cpu` as `lin::`, `quant_cpu` as `qt::` (a
quantized projection's, where its scales are given), `pointwise_cpu` as `pw::`,
`lora_cpu` as `lo::`, `paged_attention_cpu` as `att::`), whose C++ functions it calls directly.

Semantics: those of the Python loop on the CPU kernels, op for op and in the same order, so the
result is the same bit for bit (`tests/kernels/test_decode_layers_cpu.py` asserts equality);
rows past `linear_cpu.max_rows()` go to torch's GEMM, as `lin::linear` sends every caller's. Only
decode rows (one query token per sequence): a step with a prefill row runs the Python loop.
LORAFLEET_KERNELS=torch chooses the reference.

Two more calls for a decode step, because every Python call after the layers' weights have
streamed through the caches runs cold (a trivial numpy call took many times its warm time):
- `decode_forward`: the whole forward pass of a decode-only step (the embedding, the layers,
  the final norm and the LM head), `Kernels.decode_forward`; the Python forward's logits bit
  for bit. Alone, within the noise of the Python around `decode_layers`.
- `decode_batch`: a pure decode step's inputs (`ModelRunner.inputs`), in one call instead of
  ~20 numpy calls; steps faster at batch 1 and 8.
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
    """Every layer of a decode-only step (`meta.num_decode == len(x)`): x [T, H] the embedded
    tokens (updated in place, as the Python loop updates it); `layers` the model's
    `reference.Layer`s flattened; `meta` the step's `AttentionMetadata`; `lora` a
    `adapters.batch.LoraBatch` or None. Returns the last layer's MLP output, for the caller to add."""
    return load().decode_layers(x, layers, *_step_args(kv, cos, sin, positions, meta, scale, eps, heads, kv_heads,
                                                      head_dim, lora))


def _step_args(kv, cos, sin, positions, meta, scale, eps, heads, kv_heads, head_dim, lora) -> tuple:
    """The arguments after the weights that the C++ `decode_layers` and `decode_forward` both take,
    in their order: the pool, RoPE tables, the step's attention metadata, the model's numbers,
    and the LoRA batch's pool and segments (none without adapters)."""
    lora_tensors = [] if lora is None else [lora.weights, lora.seg]
    return (kv, cos, sin, positions, meta.slot_pages, meta.slot_offsets, meta.decode_block_tables,
            meta.decode_context_lens, scale, eps, heads, kv_heads, head_dim, lora_tensors)


def decode_forward(w: DecodeWeights, input_ids: torch.Tensor, positions: torch.Tensor, meta, kv: torch.Tensor,
                   logits_rows: torch.Tensor, lora=None) -> torch.Tensor:
    """The model's forward pass for a decode-only step (`meta.num_decode == len(input_ids)`) in one
    call, on the tensors `w` holds: the embedding, every layer (the C++ `decode_layers`), the final
    norm and the LM head; returns fp32 logits [S, V] for `logits_rows`. The same ops in the same
    order as the Python forward around `decode_layers`, so the same logits bit for bit."""
    return load().decode_forward(input_ids, logits_rows, w.embed, w.embed_s, w.layers, w.norm, w.lm_head,
                                 w.lm_head_s, w.lm_head_o,
                                 *_step_args(kv, w.cos, w.sin, positions, meta, w.scale, w.eps, w.heads,
                                             w.kv_heads, w.head_dim, lora))


def decode_batch(table, rows: list[int], starts: list[int], ids: list[int], block_size: int) -> list[np.ndarray]:
    """A pure decode step's inputs, as `ModelRunner.inputs` builds them (`StepInputs`' ids,
    positions, slot pages, slot offsets, context lengths, logits rows and block tables [n, width]:
    int64 views of one allocation), for n sequences that each decode one token and sample it:
    `table` the KV manager's block table (a numpy int64 array), each sequence's `rows` in it, its
    `starts` (tokens computed so far: the new token's position) and its token `ids`. The block
    tables are as wide as the longest sequence needs (the general path's: as wide as the most
    blocks a row holds; attention reads only `lens` tokens either way)."""
    flat, n = load().decode_batch(torch.from_numpy(table), rows, starts, ids, block_size).numpy(), len(rows)
    return [*(flat[k * n:(k + 1) * n] for k in range(6)), flat[6 * n:].reshape(n, -1)]
