"""Iteration-level continuous batching over the unified pool.

Each `schedule()` call picks, under a token budget, a chunk of work for as many sequences as fit:
a decode step is a chunk of one token, a prompt a chunk of up to the remaining budget (chunked
prefill), and a preempted sequence simply recomputes its prompt and output as one long prompt.
Running sequences are served oldest first and are never starved by new arrivals; new arrivals
are admitted FCFS while the budget, `max_num_seqs` and free pages (minus a small watermark that
keeps room for running sequences to grow) allow. When a running sequence needs a KV page and
none is free, the newest running sequence is preempted (its pages freed, its work recomputed
later), so the oldest always make progress.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lorafleet.engine.request import Request, Status
from lorafleet.memory.kv import KVCacheManager


@dataclass
class Chunk:
    """Compute tokens [request.num_computed, request.num_computed + num_tokens) of `request`."""

    request: Request
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens, so its last row yields a new token."""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # could not grow even alone

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 watermark: float = 0.01):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_pages = int(kv.pool.num_pages * watermark)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._make_room(req, req.num_computed + n, out):
                continue
            self.kv.grow(req.request_id, req.num_computed + n)
            out.chunks.append(Chunk(req, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed, budget)
            if not self.kv.can_grow(req.request_id, req.num_computed + n, reserve=self.watermark_pages):
                if self.running or not self.kv.can_grow(req.request_id, req.num_computed + n):
                    break  # admitted when pages come back; alone, it may dip into the watermark
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            self.kv.grow(req.request_id, req.num_computed + n)
            out.chunks.append(Chunk(req, n))
            budget -= n
        return out

    def _make_room(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until `req` can hold `num_tokens` positions.
        False when `req` itself had to go."""
        while not self.kv.can_grow(req.request_id, num_tokens):
            victim = self.running[-1]
            if victim is req and len(self.running) == 1:
                # alone and still no room: the pool cannot hold this sequence any longer
                req.finish_reason = "length"
                self.finish(req)
                out.finished.append(req)
                return False
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Take `req` out of the queues and free its pages (finished or aborted)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        req.status = Status.FINISHED
