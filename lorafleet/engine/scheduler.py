"""Iteration-level continuous batching over the unified pool.

Each `schedule()` call picks, under a token budget, a chunk of work for as many sequences as fit:
a decode step is a chunk of one token, a prompt a chunk of up to the remaining budget (chunked
prefill), and a preempted sequence simply recomputes its prompt and output as one long prompt.

- Running sequences are served oldest first; new arrivals never starve them.
- Waiting ones are admitted in the policy's order (fair across adapters by default, see
  `policy.py`; preempted sequences first) while the budget, `max_num_seqs` and free pages
  (minus a small watermark kept for running sequences to grow) allow. Admission is by pages
  from the one pool, not by adapter slots.
- A waiting request whose adapter is not on the device yet is skipped, never blocking those
  behind it (no head-of-line blocking); the prefetcher is bringing its adapter in.
- A running sequence that needs a KV page first takes it from idle adapters (least recently
  used); only then is the newest running sequence preempted (pages freed, work recomputed).
- Admission pins a request's adapter; preemption and finishing unpin it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from lorafleet.engine.policy import FCFS, key
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
                 residency=None, policy=None, watermark: float = 0.01):
        self.kv = kv
        self.residency = residency  # None: no adapters (every adapter is "ready")
        self.policy = policy or FCFS()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_pages = int(kv.pool.num_pages * watermark)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        active = {key(r) for r in self.waiting} | {key(r) for r in self.running}
        self.policy.on_arrival(request, active)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def wanted_adapters(self) -> list:
        """Adapters (registry entries) of waiting requests, in queue order, without repeats (for
        the prefetcher)."""
        return list(dict.fromkeys(r.lora for r in self.waiting if r.lora is not None))

    def _ready(self, req: Request) -> bool:
        return req.lora is None or req.lora.ready

    def _room(self, pages: int, protect=None) -> bool:
        """Free pages for KV, evicting idle adapters (never `protect`) if that is enough."""
        if self.kv.pool.can_allocate(pages):
            return True
        keep = {protect} if protect is not None else set()
        return self.residency is not None and self.residency.make_room(pages, keep, for_kv=True)

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
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        now = time.monotonic()
        queues: dict[str, deque[Request]] = {}
        for req in self.waiting:
            queues.setdefault(key(req), deque()).append(req)
        preempted = [r for r in self.waiting if r.num_preemptions]
        while budget > 0 and len(self.running) < self.max_num_seqs:
            # readiness is re-read every time: admitting one request may evict another's adapter
            heads = {k: q[0] for k, q in queues.items() if q and self._ready(q[0])}
            if not heads:
                break
            req = next((r for r in preempted if self._ready(r) and heads.get(key(r)) is r), None)
            req = req or heads[self.policy.pick(heads)]
            n = min(req.num_tokens - req.num_computed, budget)
            need = self.kv.extra_pages(req.request_id, req.num_computed + n)
            reserve = self.watermark_pages if self.running else 0  # alone, it may use the watermark
            if not self._room(need + reserve, protect=req.lora):
                break  # admitted when pages come back
            queues[key(req)].popleft()
            if req in preempted:
                preempted.remove(req)
            self.waiting.remove(req)
            self._start(req, now)
            self.kv.grow(req.request_id, req.num_computed + n)
            out.chunks.append(Chunk(req, n))
            budget -= n
        if budget > 0 and len(self.running) < self.max_num_seqs:
            for q in queues.values():  # heads that only lack their adapter: the exposed wait starts
                if q and not self._ready(q[0]) and q[0].adapter_blocked_since is None:
                    q[0].adapter_blocked_since = now

    def _start(self, req: Request, now: float) -> None:
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        if req.adapter_blocked_since is not None:
            req.adapter_wait += now - req.adapter_blocked_since
            req.adapter_blocked_since = None
        self.policy.on_admit(req)
        req.status = Status.RUNNING
        self.running.append(req)
        if req.lora is not None:
            self.residency.pin(req.lora)

    def _make_room(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Idle adapters first, then the newest running sequences, until `req` can hold
        `num_tokens` positions. False when `req` itself had to go."""
        while not self._room(self.kv.extra_pages(req.request_id, num_tokens)):
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
        self._stop(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _stop(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        if req.lora is not None:
            self.residency.unpin(req.lora)

    def finish(self, req: Request) -> None:
        """Take `req` out of the queues and free its pages (finished or aborted)."""
        if req in self.running:
            self._stop(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        self.policy.on_finish(req)
        req.status = Status.FINISHED
