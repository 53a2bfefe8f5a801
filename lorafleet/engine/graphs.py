"""Decode steps replayed as CUDA graphs, which adapter switches never invalidate.

A pure decode step (one token per sequence) runs at a fixed shape: its batch is padded up to a
bucket (1, 2, 4, 8, 16, 32, ... up to `max_num_seqs`), and everything that changes from step to
step is *data* in fixed buffers the graph reads: token ids, positions, the KV slots to write,
block tables and context lengths, and for LoRA the segments, each segment's adapter metadata and
its page table. Which adapters are resident, their ranks and where their pages lie never enter a
capture. A batch without any adapter replays the graph captured without LoRA: it pays nothing
for it.

The LoRA launch grids are sized to the step, from three buckets that the graph's key holds: the
batch bucket, a segment bucket (`segment_buckets`: powers of 4 up to the batch bucket, then
`MIX_SEGMENTS` times it for steps of mixes, whose rows hold a segment per adapter; segments of
at most `SEGMENT_ROWS` rows, longer runs of one adapter split) and a rank bucket (`RANK_BUCKETS`:
the step's largest rank, a mix's the sum of its adapters', rounded up to 16, 64 or 256). So 64 one-row rank-16
segments launch 64 segments' programs at a rank bound of 16, and one adapter over 64 rows four
segments' at its own bound, where one grid of 64 segments at rank 256 served both (and mostly
found no work). The keys depend on those buckets alone, never on which adapters are loaded or
where their pages are (the kernels read that through the row tables the per-step segments
point to): at most `max_captures()` graphs for a `max_num_seqs`, each captured once, on its
first use, and no adapter switch re-captures. A step beyond a bound (a longer context than the
block-table width, a rank above 256, more segments than the top bucket) runs eagerly instead
(`eager_fallbacks`), never wrongly.

Padding rows write their K/V into the pool's `scratch_page` and attend to it alone; their
logits are dropped.

Each step's inputs reach the device in one copy: the runner hands its numbers over on the host
(`StepInputs`, numpy, as for every step), they are written into one staging buffer (pinned on CUDA) laid out as the
device buffer every capture reads (ids, positions, KV slots, context lengths, LoRA segments,
then the block tables, row by row), the sampler's per-row numbers after the bucket's tables, and
that prefix goes over in one non-blocking copy. Why: each `.to(device)` of pageable memory is a
copy that holds the host until it is done (seven a step, and as many launches to move them into the graph's buffers), on a step that
lasts about a millisecond on a GPU. Before the staging buffer is written again, the event
recorded after the last copy is waited for (already passed once the step's tokens were read).

`capture=False` runs the very same fixed-shape buffers eagerly: how the CPU tests check that
padding, buckets and the per-step data give the eager path's tokens (a CUDA graph records
exactly these launches).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from lorafleet.errors import ConfigError
from lorafleet.kernels.reference import SEG_FIELDS, AttentionMetadata
from lorafleet.adapters.batch import LoraBatch, group_shapes
from lorafleet.engine.step_inputs import StepInputs
from lorafleet.model.sampler import Plan
from lorafleet.model.upload import Upload
from lorafleet.snapshot import DecodeGraphsStats

SEGMENT_ROWS = 16              # rows of one LoRA segment in a captured step (the kernels' row block)
RANK_BUCKETS = (16, 64, 256)   # rank bounds a captured step's LoRA grid is sized to
MAX_RANK = RANK_BUCKETS[-1]    # the largest adapter rank a captured step serves
MIX_SEGMENTS = 4               # segments per row of a captured step's top segment bucket (mixes of up to 4 on average)


def fill_pending(ids: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """ids with each -1 - j replaced by prev[j] (`Request.input_ids`: inputs drawn by the last
    step and not read yet), on the device."""
    return torch.where(ids < 0, prev[(-1 - ids).clamp(0, len(prev) - 1)], ids)


def buckets(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: powers of two below `max_num_seqs`, then `max_num_seqs` itself."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max_num_seqs]


def segment_buckets(batch: int) -> list[int]:
    """LoRA segment counts a captured step of `batch` rows is sized to: powers of 4 below it, then
    `batch` (one segment a row: every request on one adapter), then MIX_SEGMENTS times it."""
    out, s = [], 1
    while s < batch:
        out.append(s)
        s *= 4
    return out + [batch, MIX_SEGMENTS * batch]


def max_captures(max_num_seqs: int) -> int:
    """The most graphs `DecodeGraphs` ever captures: per batch bucket one without LoRA and one per
    (segment bucket, rank bucket)."""
    return sum(1 + len(segment_buckets(b)) * len(RANK_BUCKETS) for b in buckets(max_num_seqs))


class DecodeGraphs:
    # the views __init__ lays out: of the staging buffer (numpy, on the host) and of the device buffer
    _ids: np.ndarray
    _positions: np.ndarray
    _slot_pages: np.ndarray
    _slot_offsets: np.ndarray
    _lens: np.ndarray
    _seg: np.ndarray
    _tables: np.ndarray
    ids: torch.Tensor
    positions: torch.Tensor
    slot_pages: torch.Tensor
    slot_offsets: torch.Tensor
    context_lens: torch.Tensor
    seg: torch.Tensor
    block_tables: torch.Tensor

    @classmethod
    def for_mode(cls, mode: str, model, kv, max_num_seqs: int, max_len: int) -> DecodeGraphs | None:
        """The engine's `decode_graphs` option: "auto" (captured where CUDA and the kernels have
        graphs), "on" (CUDA only), "fixed" (the fixed-shape path without capture: tests), "off"."""
        cuda = model.device.type == "cuda"
        if mode == "auto":
            mode = "on" if cuda and model.kernels.graphs else "off"
        if mode == "on" and not cuda:
            raise ConfigError("decode_graphs=on needs a CUDA device (use fixed to test the fixed-shape path)")
        return None if mode == "off" else cls(model, kv, max_num_seqs, max_len, capture=mode == "on")

    def __init__(self, model, kv, max_num_seqs: int, max_model_len: int, capture: bool):
        self.model, self.kv, self.capture = model, kv, capture
        self.lora_shapes = group_shapes(model.cfg.linear_features())
        self.buckets = buckets(max_num_seqs)
        pool = kv.pool
        dev, n = pool.tensor.device, self.buckets[-1]
        scratch = pool.scratch_page
        self.max_blocks = mb = -(-max_model_len // kv.block_size)
        segs = segment_buckets(n)[-1]
        # the inputs every capture reads (bucket b uses their first b rows), as one device buffer
        # and its staging twin on the host: [ids, positions, slot pages, slot offsets, context
        # lengths: n each][segments: segs x SEG_FIELDS][block tables: n x max_blocks][the
        # sampler's numbers, which no capture reads: after the bucket's last table row]
        self.tables_at = 5 * n + segs * SEG_FIELDS
        size = self.tables_at + n * mb + Plan.bound(n) // 8
        self.stage = torch.zeros(size, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.inputs = torch.zeros(size, dtype=torch.long, device=dev)
        self._staged = torch.cuda.Event() if dev.type == "cuda" else None  # after the last copy
        self.uploads = 0  # copies to the device: one a step
        views: dict[str, tuple[Any, ...]]
        host, views = self.stage.numpy(), {}
        for name, buf in (("host", host), ("dev", self.inputs)):
            views[name] = (buf[0:n], buf[n:2 * n], buf[2 * n:3 * n], buf[3 * n:4 * n], buf[4 * n:5 * n],
                           buf[5 * n:self.tables_at].reshape(segs, SEG_FIELDS),
                           buf[self.tables_at:self.tables_at + n * mb].reshape(n, mb))
        (self._ids, self._positions, self._slot_pages, self._slot_offsets, self._lens, self._seg,
         self._tables) = views["host"]
        (self.ids, self.positions, self.slot_pages, self.slot_offsets, self.context_lens, self.seg,
         self.block_tables) = views["dev"]
        self._slot_pages[:] = scratch
        self._lens[:] = 1
        self._tables[:] = scratch
        self.inputs.copy_(self.stage)
        self.logits_rows = torch.arange(n, device=dev)
        self._graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.captures = self.replays = self.recaptures = self.eager_fallbacks = 0
        self.capture_s = 0.0
        self.capture_bytes = 0

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def fits(self, step: StepInputs, lora: LoraBatch | None) -> bool:
        """Whether this decode step can run at a fixed shape: within the bounds (one beyond a
        bound runs eagerly and is counted; steps with prefill rows never come here)."""
        if lora is not None and lora.heads:  # own embeddings / LM heads: shapes of their own
            return False
        n = len(step.ids)
        ok = (n <= self.buckets[-1] and step.tables.shape[1] <= self.max_blocks
              and (lora is None or (lora.max_rank <= MAX_RANK
                                    and len(lora.split(SEGMENT_ROWS)) <= segment_buckets(self.bucket(n))[-1])))
        if not ok:
            self.eager_fallbacks += 1
        return ok

    def run(self, step: StepInputs, lora: LoraBatch | None, up: Upload, prev: torch.Tensor | None = None
            ) -> torch.Tensor:
        """The step's numbers into the staging buffer (padding rows on the scratch page), with
        the columns `up` holds (the sampler's: `Plan.bound` of them at most) after what the bucket
        reads, one copy of both to the device (`up.sent` then views of it), the inputs not read
        yet taken from `prev` (the last step's drawn tokens, `fill_pending`), then the bucket's
        graph. Returns the logits of the rows that sample [S, V]."""
        n = len(step.ids)
        b = self.bucket(n)
        if self._staged is not None:
            self._staged.synchronize()  # the last step's copy has read the staging buffer
        scratch = self.kv.pool.scratch_page
        self._ids[:n] = step.ids
        self._ids[n:b] = 0  # a padding row's id: any token, but never a pending one's -1 - j
        self._positions[:n] = step.positions
        self._slot_pages[:n] = step.slot_pages
        self._slot_pages[n:b] = scratch
        self._slot_offsets[:n] = step.slot_offsets
        self._tables[:n, :step.tables.shape[1]] = step.tables  # columns past it: pages of earlier steps, unread
        self._tables[n:b] = scratch
        self._lens[:n] = step.lens
        self._lens[n:b] = 1
        key = (b, 0, 0) if lora is None else self._set_lora(lora, b)
        end = self.tables_at + b * self.max_blocks
        extra = up.nbytes()
        assert extra <= Plan.bound(n), "more than a sampler's numbers beside a step's inputs"
        spans = up.write(self.stage.numpy()[end:].view(np.uint8))
        end += extra // 8
        self.inputs[:end].copy_(self.stage[:end], non_blocking=True)
        up.views(self.inputs[end - extra // 8:end].view(torch.uint8), spans)
        if self._staged is not None:
            self._staged.record()
        self.uploads += 1
        if prev is not None and (step.ids < 0).any():
            self.ids[:n].copy_(fill_pending(self.ids[:n], prev))
        if key not in self._graphs:
            self._capture(key)
        graph, logits = self._graphs[key]
        if graph is None:
            logits = self._forward(*key)
        else:
            assert logits is not None  # captured with its graph
            graph.replay()
        self.replays += 1
        logits = logits[:n]
        rows = step.out_rows  # a pure decode step's: in order, so n of them are every row
        return logits if rows is None or len(rows) == n else logits[torch.from_numpy(rows).to(logits.device)]

    def _set_lora(self, lora: LoraBatch, b: int) -> tuple[int, int, int]:
        """The step's segments, split into runs of at most SEGMENT_ROWS rows, into the staging
        buffer (the unused ones of the segment bucket empty); returns the graph's key."""
        split = lora.split(SEGMENT_ROWS)
        segs = next(s for s in segment_buckets(b) if s >= len(split))
        self._seg[:len(split)] = split
        self._seg[len(split):segs] = 0
        return b, segs, next(r for r in RANK_BUCKETS if r >= lora.max_rank)

    def _forward(self, b: int, segs: int, rank: int) -> torch.Tensor:
        meta = AttentionMetadata(slot_pages=self.slot_pages[:b], slot_offsets=self.slot_offsets[:b], num_decode=b,
                                 decode_block_tables=self.block_tables[:b], decode_context_lens=self.context_lens[:b])
        lora = None
        if segs:
            lora = LoraBatch.fixed(self.model.kernels, self.kv.pool.adapter_tensor, self.lora_shapes, self.seg[:segs],
                                   SEGMENT_ROWS, rank)
        return self.model(self.ids[:b], self.positions[:b], meta, self.kv.cache, self.logits_rows[:b], lora)

    def _capture(self, key: tuple[int, int, int]) -> None:
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

    def stats(self) -> DecodeGraphsStats:
        return {"enabled": True, "captured": self.capture, "buckets": self.buckets, "captures": self.captures,
                "keys": [list(k) for k in sorted(self._graphs)], "max_captures": max_captures(self.buckets[-1]),
                "replays": self.replays, "uploads": self.uploads, "recaptures": self.recaptures,
                "eager_fallbacks": self.eager_fallbacks,
                "capture_s": self.capture_s, "capture_bytes": self.capture_bytes}
