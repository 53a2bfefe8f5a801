"""ModelRunner: turns a scheduled step into flat batch tensors, runs the model, returns logits.

Row order of the flat batch: single-token chunks first (decode), then multi-token chunks
(prefill), so one batched attention call covers every decode row (see kernels/reference.py).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from lorafleet.engine.scheduler import Chunk
from lorafleet.kernels import paged_attention_cpu as attention_cpu
from lorafleet.kernels.reference import AttentionMetadata, PrefillSeq
from lorafleet.lora.batch import LoraBatch, kernel_weights
from lorafleet.memory.kv import KVCacheManager
from lorafleet.model.llama import LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCacheManager):
        self.model = model
        self.kv = kv
        self.device = model.device
        self.kernel_weights = kernel_weights(kv.pool.tensor)  # None: torch reference only
        self.attention_kernel = attention_cpu.usable(kv.pool.tensor)
        self.last_model_s = 0.0  # the model's forward pass in the last execute()

    @staticmethod
    def order(chunks: list[Chunk]) -> list[Chunk]:
        """Decode rows first, then prefill chunks; within each, grouped by adapter so that each
        adapter's rows form one segment for the LoRA op (by entry: a name replaced while
        requests still use its old weights has two)."""
        def key(c: Chunk):
            lora = c.request.lora
            return (lora.name, lora.uid) if lora is not None else ("", 0)
        return (sorted((c for c in chunks if c.num_tokens == 1), key=key)
                + sorted((c for c in chunks if c.num_tokens > 1), key=key))

    def lora_batch(self, chunks: list[Chunk], residency) -> LoraBatch | None:
        """Segments of consecutive rows sharing an adapter; None when no row has one (then the
        model runs without any LoRA work)."""
        if all(c.request.lora is None for c in chunks):
            return None
        batch = LoraBatch(self.kernel_weights)
        row, start, current = 0, 0, None
        for c in chunks + [None]:
            lora = c.request.lora if c is not None else None
            if c is None or lora is not current:
                if current is not None and row > start:
                    batch.add_rows(start, row, residency.step_views(current), current.kernel_meta)
                start, current = row, lora
            if c is not None:
                row += c.num_tokens
        return batch.finish()

    @torch.inference_mode()
    def execute(self, chunks: list[Chunk], lora=None, all_logits: bool = False) -> torch.Tensor:
        """`chunks` must already be in `order()`. Returns logits [S, V] for the chunks that
        sample, in chunk order (every row's logits [T, V] with `all_logits`, for tests)."""
        dev, bs = self.device, self.kv.block_size
        ids, pos, pages, rows = [], [], [], []
        decode_tables, decode_lens, prefills = [], [], []
        row = 0
        for c in chunks:
            r, start = c.request, c.request.num_computed
            ids.extend(r.token_at(start, start + c.num_tokens))
            p = np.arange(start, start + c.num_tokens)
            table = np.asarray(self.kv.table(r.request_id), dtype=np.int64)
            pos.append(p)
            pages.append(table[p // bs])                   # the page receiving each new K/V
            if c.num_tokens == 1:
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                prefills.append(PrefillSeq(row, c.num_tokens, start, torch.from_numpy(table).to(dev)))
            row += c.num_tokens
            if c.samples:
                rows.append(row - 1)
        positions = np.concatenate(pos)
        pages = np.concatenate(pages)
        meta = AttentionMetadata(
            slot_pages=torch.from_numpy(pages).to(dev),
            slot_offsets=torch.from_numpy(positions % bs).to(dev),
            num_decode=len(decode_tables), prefills=prefills)
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            padded = np.zeros((len(decode_tables), width), dtype=np.int64)
            for i, t in enumerate(decode_tables):
                padded[i, :len(t)] = t
            lens = torch.tensor(decode_lens, device=dev)
            meta.decode_block_tables = torch.from_numpy(padded).to(dev)
            meta.decode_context_lens = lens
            meta.decode_kernel = self.attention_kernel
            if not self.attention_kernel:
                meta.decode_mask = (torch.arange(width * bs, device=dev) < lens[:, None])[:, None, None, :]
        ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.from_numpy(positions).to(dev)
        rows = torch.arange(row, device=dev) if all_logits else torch.tensor(rows, dtype=torch.long, device=dev)
        t0 = time.perf_counter()
        logits = self.model(ids, positions, meta, self.kv.cache, rows, lora)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.last_model_s = time.perf_counter() - t0
        return logits
