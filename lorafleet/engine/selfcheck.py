"""The start-up self-check: the served kernels (`kernels.backend.select`'s choice) against the torch
reference kernels (`kernels/reference.py`, the oracle of every op) on the same weights, one short
prompt, before the engine takes its pool. `lorafleet verify` is the thorough form (several
prompts, greedy tokens, adapters, transformers/PEFT); this is the one a daemon can afford at
every start.

Decisions:
- The reference is a second model loaded from the same files with `kernels="torch"`, quantized
  the same way where the base is (the same codes and scales), so the check compares kernels and
  never quantization. It doubles the weights' memory while it runs: it runs before the page
  pool is sized (on a GPU the pool takes most of the memory left) and is dropped as soon as it
  has answered. `EngineConfig.self_check=False` (`serve --no-self-check`) skips it where that
  memory is not there.
- One prompt across two KV pages, then one decode row on it: the prefill path and the decode
  path (the CPU's is one C++ call, `Kernels.decode_forward`), through a KV of its own, so
  nothing of the engine is touched.
- The tolerance is relative to the logits' scale (their largest magnitude, at least 1) and
  looser as the compute precision is lower: the kernels may order sums differently (that is
  their point), which moves the last bits of every product. A quantized base's is looser again:
  the kernels dequantize in registers, in another order than `reference.dequantize`.
- Skipped where the served kernels are the reference themselves.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from lorafleet.errors import SelfCheckError
from lorafleet.kernels.reference import AttentionMetadata, PrefillSeq
from lorafleet.snapshot import SelfCheck

log = logging.getLogger("lorafleet.engine")

BLOCK = 16                # the check's KV page, in tokens
PROBE_LEN = BLOCK + 4     # one prompt across two pages: paged writes and reads are exercised
RELATIVE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
QUANTIZED = 2.0           # a quantized base's tolerance, times its dtype's


def tolerance(dtype: torch.dtype, quantization: str | None, ref: torch.Tensor) -> float:
    """The largest |logit difference| taken as agreement with the reference logits `ref`."""
    rel = RELATIVE.get(dtype, RELATIVE[torch.bfloat16]) * (QUANTIZED if quantization else 1.0)
    return rel * max(1.0, float(ref.abs().max()))


def probe_ids(vocab: int, n: int = PROBE_LEN, seed: int = 0) -> list[int]:
    """`n` fixed token ids of a `vocab`-token model (ids 0-2, often special, left out)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(3, vocab - 1), vocab, (n,), generator=g).tolist()


@torch.inference_mode()
def probe_logits(model, ids: list[int], then: int | None = None) -> torch.Tensor:
    """`model`'s (a `LlamaModel`) fp32 logits of every row of `ids` prefilled from position 0, on
    the host ([len(ids), V]); with `then`, one more row: the logits of token `then` decoded after
    them ([len(ids) + 1, V]). Through a KV cache of its own, pages of BLOCK tokens."""
    cfg, dev, t = model.cfg, model.device, len(ids)
    pages = -(-(t + (then is not None)) // BLOCK)
    kv = torch.zeros(pages, cfg.num_layers, 2, BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype, device=dev)
    table = torch.arange(pages, device=dev)
    pos = torch.arange(t, device=dev)
    one = torch.tensor([0], device=dev)
    meta = AttentionMetadata(slot_pages=pos // BLOCK, slot_offsets=pos % BLOCK, prefills=[PrefillSeq(0, t, 0, table)],
                             prefill_starts=one, prefill_lens=one + t, prefill_positions=one,
                             prefill_block_tables=table[None], max_prefill_len=t)
    out = [model(torch.tensor(ids, device=dev), pos, meta, kv, pos)]
    if then is not None:
        at = torch.tensor([t], device=dev)
        meta = AttentionMetadata(slot_pages=at // BLOCK, slot_offsets=at % BLOCK, num_decode=1,
                                 decode_block_tables=table[None], decode_context_lens=at + 1)
        out.append(model(torch.tensor([then], device=dev), at, meta, kv, one))
    return torch.cat(out).float().cpu()


def self_check(model, folder: str | Path, config) -> SelfCheck:
    """Check `model` (served from `folder` with the `EngineConfig` `config`) against the torch
    reference on the same weights; returns what it found (kernels, max_abs_diff, tolerance,
    seconds; `skipped` with the reason where there is nothing to compare). Raises SelfCheckError,
    naming the kernels and the difference, when they disagree."""
    from lorafleet.model.loader import load_model

    label = model.kernels.label
    if model.kernels.name == "torch":
        return {"kernels": label, "skipped": "the kernels are the torch reference"}
    t0 = time.perf_counter()
    ids = probe_ids(model.cfg.vocab_size)
    fast = probe_logits(model, ids, then=ids[0])
    reference = load_model(folder, model.device, model.dtype, max_len=PROBE_LEN + 1, quantize=config.quantize,
                           kernels="torch")
    try:
        ref = probe_logits(reference, ids, then=ids[0])
    finally:
        del reference  # its last reference: freed here (no cycle holds a model; a full gc costs more than the check)
        if model.device.type == "cuda":
            torch.cuda.empty_cache()  # back to the device before the pool is sized from what is free
    diff = float((fast - ref).abs().max())
    tol = tolerance(model.numerics, model.quantization, ref)
    found: SelfCheck = {"kernels": label, "max_abs_diff": diff, "tolerance": tol, "seconds": time.perf_counter() - t0}
    precision = str(model.dtype).removeprefix("torch.") + (f", {model.quantization}" if model.quantization else "")
    if not diff <= tol:  # NaN disagrees too
        raise SelfCheckError(
            f"self-check failed: the {label} kernels' logits differ from the torch reference's on the same "
            f"weights by up to {diff:.3g} (tolerance {tol:.3g} at {precision}); serve the reference kernels "
            "(LORAFLEET_KERNELS=torch), or skip the check (`lorafleet serve --no-self-check`) at your own risk; "
            "`lorafleet verify` compares more")
    log.info("self-check: the %s kernels agree with the torch reference (max |logit diff| %.3g, tolerance %.3g "
             "at %s; %.2fs)", label, diff, tol, precision, found["seconds"])
    return found
