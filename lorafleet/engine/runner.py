"""ModelRunner: a scheduled step in two phases, `launch` (order the rows, build the flat batch
and the LoRA segments, run the model, draw the tokens: all queued on the device) and `read` (each
drawing row's token, logprobs or error). It calls nothing above it: the engine appends, finishes
and counts what `read` returns.

Row order of the flat batch: single-token chunks first (decode), then multi-token chunks
(prefill), so one batched attention call covers every decode row (see kernels/reference.py).
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from lorafleet.engine.graphs import DecodeGraphs, fill_pending
from lorafleet.engine.scheduler import Chunk
from lorafleet.engine.step_inputs import Prefill, StepInputs
from lorafleet.adapters.batch import LoraBatch, group_shapes
from lorafleet.memory.kv import KVCacheManager
from lorafleet.model.grammar import apply_masks
from lorafleet.model.llama import LlamaModel
from lorafleet.model.sampler import Drawn, Plan, launch
from lorafleet.model.upload import Upload


@dataclass
class Launched:
    """A step on the device: its chunks in row order, the requests whose rows draw (in row
    order), the draws, when its `step()` call began, the adapters that landed for it, its forward
    pass's time, and (on a GPU) the event recorded after it, which copies into pages freed
    meanwhile must wait for."""

    chunks: list[Chunk]
    reqs: list
    drawn: Drawn
    t0: float
    loaded: int
    model_s: Callable[[], float]
    fence: torch.cuda.Event | None


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCacheManager, graphs: DecodeGraphs | None = None,
                 generator: torch.Generator | None = None, exact: bool = False):
        """`generator`: what draws for requests without a seed; `exact`: the sampler filters over
        whole rows (a step read one call late: a token drawn again would differ)."""
        self.model = model
        self.kv = kv
        self.device = model.device
        self.graphs = graphs  # pure decode steps at fixed shapes (CUDA graphs), or None
        self.generator = generator
        self.exact = exact
        self.lora_shapes = group_shapes(model.cfg.linear_features())
        self._model_s = 0.0  # the model's forward pass in the last execute(), on the CPU
        self._events = ((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                        if self.device.type == "cuda" else None)

    def launch(self, chunks: list[Chunk], prev: Launched | None, t0: float = 0.0, loaded: int = 0) -> Launched:
        """2. order the rows and build the batch, 3. run the model, 4. draw the tokens: all queued
        on the device. `prev`: the step still in flight, whose drawn tokens are the input of the
        rows that follow them."""
        chunks = self.order(chunks)
        reqs = [c.request for c in chunks if c.samples]
        held = [(j, r.matcher) for j, r in enumerate(reqs) if r.matcher is not None]  # structured output's rows
        up = Upload()  # the step's one copy: the sampler's numbers join the inputs
        plan = Plan(up, [r.params for r in reqs], [r.generator for r in reqs], self.generator,
                    self.model.cfg.vocab_size, self.exact, [j for j, _ in held])
        logits = self.execute(chunks, self.lora_batch(chunks), prev=prev.drawn.tokens if prev is not None else None,
                              up=up)
        drawn = launch(logits, plan, self.model.kernels.greedy,
                       constrain=functools.partial(apply_masks, rows=held) if held else None)
        fence = None
        if self.device.type == "cuda":
            fence = torch.cuda.Event()
            fence.record()
        return Launched(chunks, reqs, drawn, t0, loaded, self.model_time(), fence)

    @staticmethod
    def read(step: Launched) -> list[tuple]:
        """The step's draws read (a sync with the device): (request, token, logprobs or None,
        error or None) for each drawing row, in row order."""
        tokens, lps, errors = step.drawn.read()
        return [(req, token, lp, errors.get(i)) for i, (req, token, lp) in enumerate(zip(step.reqs, tokens, lps))]

    @staticmethod
    def order(chunks: list[Chunk]) -> list[Chunk]:
        """Decode rows first, then prefill chunks; within each, grouped by adapter (or mix) so
        that each adapter's rows form one segment for the LoRA op (by entry: a name replaced
        while requests still use its old weights has two), and each mix's one run of segments."""
        return (sorted((c for c in chunks if c.num_tokens == 1), key=_lora_key)
                + sorted((c for c in chunks if c.num_tokens > 1), key=_lora_key))

    def lora_batch(self, chunks: list[Chunk]) -> LoraBatch | None:
        """Segments of consecutive rows sharing an adapter (a mix: one per adapter, each with its
        scale, those at scale 0 left out: they contribute nothing); None when no row has one
        (then the model runs without any LoRA work). An aLoRA request's rows before its
        activation are in no segment: they run as the base (`adapter_rows`)."""
        if all(not c.request.loras for c in chunks):
            return None
        batch = LoraBatch(self.model.kernels, self.kv.pool.adapter_tensor, self.lora_shapes)
        end = 0
        for _, group in itertools.groupby(chunks, key=_lora_key):
            run = list(group)
            start, req = end, run[0].request
            end += sum(c.num_tokens for c in run)
            live = [(e, s) for e, s in zip(req.loras, req.scales) if s != 0.0]
            if not live:
                continue
            heads = [(e.heads, s) for e, s in live if e.heads is not None]
            for lo, hi in adapter_rows(run, start):
                batch.add_rows(lo, hi, [(e.row_table, s) for e, s in live], sum(e.max_rank for e, _ in live))
                if heads:
                    batch.add_heads(lo, hi, heads)
        return batch.finish()

    def inputs(self, chunks: list[Chunk], all_logits: bool = False) -> StepInputs:
        """The step's numbers on the host (`StepInputs`), built with array operations over
        per-sequence numbers (block tables come from the KV manager's array, one gather a kind of
        row). `all_logits`: every row's logits are wanted (tests).

        A pure decode step whose inputs are all read (most steps of a busy server on the CPU) is
        built by the kernels' `decode_batch` where they have one (the CPU's: one C++ call). Why:
        after the weights have streamed through the caches the numpy calls below each run cold,
        and the one call made whole steps faster (docs/benchmark-history.md)."""
        kv, bs, n = self.kv, self.kv.block_size, len(chunks)
        reqs = [c.request for c in chunks]
        fast = self.model.kernels.decode_batch
        if (fast is not None and not all_logits
                and all(c.num_tokens == 1 and c.samples and not c.request.num_pending for c in chunks)):
            starts = [r.num_computed for r in reqs]
            ids, pos, pages, offsets, lens, out_rows, tables = fast(
                kv.block_table, [kv.rows[r.request_id] for r in reqs], starts,
                [r.token_at(s, s + 1)[0] for r, s in zip(reqs, starts)], bs)
            return StepInputs(ids, pos, pages, offsets, lens, tables, out_rows)
        ntok = np.fromiter((c.num_tokens for c in chunks), np.int64, n)
        start = np.fromiter((r.num_computed for r in reqs), np.int64, n)
        rows = np.fromiter((kv.rows[r.request_id] for r in reqs), np.int64, n)
        samples = np.fromiter((c.samples for c in chunks), bool, n)
        table = kv.block_table
        nd = int(np.searchsorted(ntok > 1, True))                       # decode rows come first
        if nd == n:  # one token a sequence: flat rows are sequences
            ids = np.fromiter((r.input_ids(s, s + 1)[0] for r, s in zip(reqs, start.tolist())), np.int64, n)
            pos, flat_rows, last = start, rows, np.arange(n)
        else:
            first = np.cumsum(ntok) - ntok                               # each chunk's first flat row
            pos = np.arange(int(ntok.sum())) - np.repeat(first - start, ntok)
            ids = np.array([t for r, s, k in zip(reqs, start.tolist(), ntok.tolist()) for t in r.input_ids(s, s + k)],
                           dtype=np.int64)
            flat_rows, last = np.repeat(rows, ntok), first + ntok - 1
        drows, prow = rows[:nd], rows[nd:]
        tables = table[drows, :int(kv.num_blocks[drows].max())] if nd else np.empty((0, 0), np.int64)
        prefill = None
        if nd < n:
            blocks = kv.num_blocks[prow]
            prefill = Prefill(first[nd:], ntok[nd:], start[nd:], table[prow, :int(blocks.max())], blocks)
        return StepInputs(ids, pos, table[flat_rows, pos // bs], pos % bs, start[:nd] + 1, tables,
                          None if all_logits else last[samples], prefill)

    @torch.inference_mode()
    def execute(self, chunks: list[Chunk], lora: LoraBatch | None = None, all_logits: bool = False,
                prev: torch.Tensor | None = None, up: Upload | None = None) -> torch.Tensor:
        """`chunks` must already be in `order()`. Returns logits [S, V] for the chunks that
        sample, in chunk order (every row's logits [T, V] with `all_logits`, for tests). `prev`:
        the tokens the last step drew on the device, which rows whose input is not read yet take
        (`Request.input_ids`). `up`: columns that travel with the step's inputs (the sampler's
        `Plan`), sent with them in the step's one copy."""
        step = self.inputs(chunks, all_logits)
        up = Upload() if up is None else up
        fixed = self.graphs is not None and not all_logits and step.pure_decode and self.graphs.fits(step, lora)
        if not fixed:
            if lora is not None:
                lora.stage(up)
            ids, positions, meta, rows = step.upload(self.device, up)
            if lora is not None:
                lora.landed(up)
        t0 = time.perf_counter()
        if self.device.type == "cuda":  # the forward's device time, read once the sampled tokens are
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        if fixed:
            assert self.graphs is not None  # fixed: graphs exist
            logits = self.graphs.run(step, lora, up, prev)  # stages `lora`'s segments with the step's inputs
        else:
            if prev is not None:
                ids = fill_pending(ids, prev)
            logits = self.model(ids, positions, meta, self.kv.cache, rows, lora)
        if self.device.type == "cuda":
            assert self._events is not None  # recorded above
            self._events[1].record()
        else:
            self._model_s = time.perf_counter() - t0
        return logits

    def model_time(self):
        """The last `execute()`'s forward pass time, as a function to call later: on a GPU it
        reads the pair of events that call recorded (once its step is done)."""
        if self.device.type != "cuda":
            return lambda s=self._model_s: s
        assert self._events is not None  # execute() recorded them
        start, end = self._events

        def device_s() -> float:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return device_s


def _lora_key(c: Chunk) -> tuple:
    return c.request.lora_key


def adapter_rows(run: list[Chunk], start: int) -> list[tuple[int, int]]:
    """The flat rows [lo, hi) of `run` (consecutive chunks on one adapter, from flat row `start`)
    that use their adapter, contiguous ones merged: every row, but an aLoRA request's rows at
    positions before its activation (a chunk's first position is its `num_computed`), which run
    as the base. A chunk may lie wholly before the activation, hold it, or follow it."""
    out: list[tuple[int, int]] = []
    at = start
    for c in run:
        act = c.request.activation
        lo = at if act is None else at + min(c.num_tokens, max(0, act - c.request.num_computed))
        hi = at = at + c.num_tokens
        if lo < hi:
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi)
            else:
                out.append((lo, hi))
    return out
