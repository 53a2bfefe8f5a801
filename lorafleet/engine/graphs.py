"""Decode steps replayed as CUDA graphs, which adapter switches never invalidate.

A pure decode step (one token per sequence) runs at a fixed shape: its batch is padded up to a
bucket (1, 2, 4, 8, 16, 32, ... up to `max_num_seqs`), and everything that changes from step to
step is *data* in fixed buffers the graph reads: token ids, positions, the KV slots to write,
block tables and context lengths, and for LoRA the segments, each segment's adapter metadata and
its page table. Which adapters are resident, their ranks and where their pages lie never enter a
capture: one graph per (bucket, with LoRA or not) serves every adapter mix, so the number of
captures and their memory do not grow with the number of adapters, and no switch re-captures.
A batch without any adapter replays the graph captured without LoRA: it pays nothing for it.

Fixed bounds make the LoRA launch grid static: segments of at most `SEGMENT_ROWS` rows (longer
runs of one adapter are split), ranks up to `MAX_RANK`, page tables as wide as a rank-256
adapter on every module needs. A step beyond a bound (a longer context than the block-table
width, a larger adapter) runs eagerly instead (`eager_fallbacks`), never wrongly.

Padding rows write their K/V into the pool's `scratch_page` and attend to it alone; their
logits are dropped.

`capture=False` runs the very same fixed-shape buffers eagerly: how the CPU tests check that
padding, buckets and the per-step data give the eager path's tokens (a CUDA graph records
exactly these launches).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from lorafleet.kernels.reference import META_FIELDS, AttentionMetadata
from lorafleet.lora.batch import GROUPS, MODULE_SLOTS, LoraBatch

SEGMENT_ROWS = 16   # rows of one LoRA segment in a captured step (the kernels' row block)
MAX_RANK = 256      # the largest adapter rank a captured step serves


def buckets(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: powers of two below `max_num_seqs`, then `max_num_seqs` itself."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model, kv, base, max_num_seqs: int, max_model_len: int, capture: bool):
        self.model, self.kv, self.capture = model, kv, capture
        self.buckets = buckets(max_num_seqs)
        pool = kv.pool
        dev, n = pool.tensor.device, self.buckets[-1]
        scratch = pool.scratch_page
        self.max_blocks = -(-max_model_len // kv.block_size)
        numel = base.num_layers * MAX_RANK * sum(i + o for i, o in base.features.values())
        self.max_adapter_pages = -(-numel // pool.page_elems)
        # the fixed buffers every capture reads (bucket b uses their first b rows)
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_pages = torch.full((n,), scratch, dtype=torch.long, device=dev)
        self.slot_offsets = torch.zeros(n, dtype=torch.long, device=dev)
        self.block_tables = torch.full((n, self.max_blocks), scratch, dtype=torch.long, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.long, device=dev)
        self.logits_rows = torch.arange(n, device=dev)
        self.seg = torch.zeros(n, 2, dtype=torch.long, device=dev)
        self.meta = torch.zeros(base.num_layers, len(GROUPS), n, MODULE_SLOTS, META_FIELDS, dtype=torch.long,
                                device=dev)
        self.lora_tables = torch.zeros(n, self.max_adapter_pages, dtype=torch.long, device=dev)
        self._graphs: dict[tuple[int, bool], tuple[object, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.captures = self.replays = self.recaptures = self.eager_fallbacks = 0
        self.capture_s = 0.0
        self.capture_bytes = 0

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def fits(self, meta: AttentionMetadata, lora: LoraBatch | None) -> bool:
        """Whether this step (its metadata from `ModelRunner.prepare`) can run at a fixed shape:
        a pure decode step within the bounds (one beyond a bound runs eagerly and is counted;
        steps with prefill rows always run eagerly)."""
        if meta.prefills:
            return False
        ok = (meta.num_decode <= self.buckets[-1] and meta.decode_block_tables.shape[1] <= self.max_blocks
              and (lora is None or (lora.max_rank <= MAX_RANK and lora.host[2].shape[1] <= self.max_adapter_pages)))
        if not ok:
            self.eager_fallbacks += 1
        return ok

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            lora: LoraBatch | None) -> torch.Tensor:
        """The step's tensors (from `ModelRunner.prepare`, decode rows only) into the fixed
        buffers, then the bucket's graph. Returns logits [n, V]."""
        n = ids.shape[0]
        b = self.bucket(n)
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slot_pages[:n].copy_(meta.slot_pages)
        self.slot_pages[n:b].fill_(self.kv.pool.scratch_page)
        self.slot_offsets[:n].copy_(meta.slot_offsets)
        width = meta.decode_block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.decode_block_tables)
        self.block_tables[n:b].fill_(self.kv.pool.scratch_page)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        self.context_lens[n:b].fill_(1)
        if lora is not None:
            self._set_lora(lora, b)
        key = (b, lora is not None)
        if key not in self._graphs:
            self._capture(key)
        graph, logits = self._graphs[key]
        if graph is None:
            logits = self._forward(*key)
        else:
            graph.replay()
        self.replays += 1
        return logits[:n]

    def _set_lora(self, lora: LoraBatch, b: int) -> None:
        """The step's segments, split into runs of at most SEGMENT_ROWS rows, into the buffers:
        b segments in all, the unused ones empty and of rank 0."""
        metas, seg, tables = lora.host
        which = np.concatenate([np.full(-(-(hi - lo) // SEGMENT_ROWS), i) for i, (lo, hi) in enumerate(seg)])
        starts = np.concatenate([np.arange(lo, hi, SEGMENT_ROWS) for lo, hi in seg])
        split = np.zeros((b, 2), dtype=np.int64)
        split[:len(starts), 0] = starts
        split[:len(starts), 1] = np.minimum(starts + SEGMENT_ROWS, seg[which, 1])
        meta = np.zeros((*metas.shape[:2], b, *metas.shape[3:]), dtype=np.int64)
        meta[:, :, :len(which)] = metas[:, :, which]
        self.seg[:b].copy_(torch.from_numpy(split))
        self.meta[:, :, :b].copy_(torch.from_numpy(meta))
        self.lora_tables[:len(which), :tables.shape[1]].copy_(torch.from_numpy(tables[which]))

    def _forward(self, b: int, with_lora: bool) -> torch.Tensor:
        meta = AttentionMetadata(slot_pages=self.slot_pages[:b], slot_offsets=self.slot_offsets[:b], num_decode=b,
                                 decode_block_tables=self.block_tables[:b], decode_context_lens=self.context_lens[:b])
        lora = None
        if with_lora:
            lora = LoraBatch.fixed(self.model.kernels, self.kv.pool.tensor, self.seg[:b], self.meta[:, :, :b],
                                   self.lora_tables[:b], SEGMENT_ROWS, MAX_RANK)
        return self.model(self.ids[:b], self.positions[:b], meta, self.kv.cache, self.logits_rows[:b], lora)

    def _capture(self, key: tuple[int, bool]) -> None:
        t0 = time.perf_counter()
        self.recaptures += key in self._graphs  # never, by construction: the stats prove it
        if not self.capture:
            self._graphs[key] = (None, None)
        else:
            dev = self.kv.pool.tensor.device
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):       # compile and warm the kernels outside the capture
                self._forward(*key)
            torch.cuda.current_stream(dev).wait_stream(side)
            torch.cuda.synchronize(dev)
            free_before = torch.cuda.mem_get_info(dev)[0]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._forward(*key)
            torch.cuda.synchronize(dev)
            self.capture_bytes += max(0, free_before - torch.cuda.mem_get_info(dev)[0])
            self._graphs[key] = (graph, logits)
        self.captures += 1
        self.capture_s += time.perf_counter() - t0

    def stats(self) -> dict:
        return {"enabled": True, "captured": self.capture, "buckets": self.buckets, "captures": self.captures,
                "replays": self.replays, "recaptures": self.recaptures, "eager_fallbacks": self.eager_fallbacks,
                "capture_s": self.capture_s, "capture_bytes": self.capture_bytes}
