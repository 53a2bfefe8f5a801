"""Iteration-level continuous batching over the unified pool.

Each `schedule()` call picks, under a token budget, a chunk of work for as many sequences as fit:
a decode step is a chunk of one token, a prompt a chunk of up to the remaining budget (chunked
prefill), and a preempted sequence simply recomputes its prompt and output as one long prompt.

- Running sequences are served oldest first; new arrivals never starve them.
- Waiting ones are admitted in the policy's order (fair across adapters by default, see
  `policy.py`; preempted sequences first) while the budget, `max_num_seqs` and free pages
  allow, minus the room kept for running sequences to grow: a small watermark, plus their
  expected growth (below). Admission is by pages from the one pool, not by adapter slots.
- Expected growth: every running sequence (and the one being admitted) is expected to generate
  `growth` of the tokens its `max_tokens` still allows, and admission keeps the KV pages for
  that. `growth` starts at GROWTH_START, decays by GROWTH_DECAY per step to GROWTH_MIN (most
  requests stop long before their `max_tokens`), and returns to 1 at a preemption (these ones
  do not). Without it admission filled the pool with prompts whose answers then had no room,
  and preempted sequences recomputed them (figures: docs/benchmark-history.md).
  The idea is SGLang's "new token ratio"; the rule here is ours.
- A waiting request whose adapter is not on the device yet is skipped, never blocking those
  behind it (no head-of-line blocking); the prefetcher is bringing its adapter in.
- A running sequence that needs a KV page first takes it from idle adapters and cached KV
  blocks (the arbiter's one eviction order, `memory/arbiter.py`); only then is the newest
  running sequence preempted (pages freed, work recomputed).
- Admission pins a request's adapters (all of a mix's, which are ready together or it waits);
  preemption and finishing unpin them.
- Admission first takes what the prefix cache holds of the request's leading blocks
  (`KVCacheManager.adopt_prefix`) and computes only the rest.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from lorafleet.engine.policy import FCFS, key
from lorafleet.engine.request import Request, Status
from lorafleet.memory.kv import KVCacheManager

GROWTH_START = 0.7   # expected share of the remaining max_tokens a running sequence generates
GROWTH_MIN = 0.1
GROWTH_DECAY = 0.001  # per step without a preemption: from 1 to GROWTH_MIN in 900 steps
GROWTH_AFTER_PREEMPTION = 1.0


@dataclass(slots=True)
class Chunk:
    """Compute tokens [request.num_computed, request.num_computed + num_tokens) of `request`.
    `samples`: the chunk reaches the end of the known tokens, so its last row yields a new token
    (fixed when the chunk is made: the step then moves the request on)."""

    request: Request
    num_tokens: int
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.request.num_computed + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # could not grow even alone: "length"


class Scheduler:
    """Waiting requests sit in one FCFS queue per policy key (adapter name, "" for the base), kept
    across steps; the policy picks among the queues' heads. Every queue operation is O(1) per
    request (a finished waiting request is dropped lazily, when it reaches its queue's head);
    the per-key counts the policy and the prefetcher need are kept up to date as requests move."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 residency=None, arbiter=None, policy=None, watermark: float = 0.01, max_model_len: int | None = None):
        self.kv = kv
        self.max_model_len = max_model_len  # caps what a sequence can still grow (None: max_tokens alone)
        self.growth = GROWTH_START
        self.residency = residency  # None: no adapters (pins)
        self.arbiter = arbiter      # None: nothing to evict (room for KV, `memory/arbiter.py`)
        self.policy = policy or FCFS()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_pages = int(kv.pool.num_pages * watermark)
        self.queues: dict[str, deque[Request]] = {}   # key -> waiting requests, FCFS (preempted first)
        self.preempted: dict[Request, None] = {}      # waiting after preemption, oldest first
        self.running: dict[Request, None] = {}        # in admission order
        self.num_waiting = 0
        self.active: dict[str, int] = {}              # key -> waiting + running requests
        self.waiting_loras: dict = {}                 # adapter entry -> waiting requests, first come first

    # -- the queues --------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.policy.on_arrival(request, self.active)
        k = key(request)
        self.active[k] = self.active.get(k, 0) + 1
        self.queues.setdefault(k, deque()).append(request)
        self._enter_waiting(request)

    def requeue(self, request: Request) -> None:
        """A preempted request waits again, at the front of its queue."""
        self.queues.setdefault(key(request), deque()).appendleft(request)
        self.preempted[request] = None
        self._enter_waiting(request)

    def _enter_waiting(self, req: Request) -> None:
        req.status = Status.WAITING
        self.num_waiting += 1
        for e in req.loras:
            self.waiting_loras[e] = self.waiting_loras.get(e, 0) + 1

    def _leave_waiting(self, req: Request) -> None:
        self.num_waiting -= 1
        self.preempted.pop(req, None)
        for e in req.loras:
            left = self.waiting_loras[e] - 1
            if left:
                self.waiting_loras[e] = left
            else:
                del self.waiting_loras[e]

    @property
    def waiting(self) -> list[Request]:
        """Every waiting request (stats, failures, tests; not the hot path)."""
        return [r for q in self.queues.values() for r in q if r.status is Status.WAITING]

    def has_unfinished(self) -> bool:
        return bool(self.num_waiting or self.running)

    def wanted_adapters(self) -> list:
        """Adapters (registry entries) of waiting requests, without repeats, in the order their
        first waiting request came (for the prefetcher)."""
        return list(self.waiting_loras)

    def _head(self, k: str) -> Request | None:
        q = self.queues.get(k)
        while q and q[0].status is not Status.WAITING:  # finished while waiting: dropped here
            q.popleft()
        if not q:
            self.queues.pop(k, None)
            return None
        return q[0]

    def _ready(self, req: Request) -> bool:
        return all(e.ready for e in req.loras)

    def _room(self, pages: int, protect=()) -> bool:
        """Free pages for KV, evicting idle adapters (never those in `protect`; those of waiting
        requests last) if that is enough."""
        if self.kv.pool.can_allocate(pages):
            return True
        return (self.arbiter is not None
                and self.arbiter.make_room(pages, set(protect), for_kv=True, wanted=self.waiting_loras))

    def _could_hold(self, pages: int, protect=()) -> bool:
        """Whether `pages` could be had for KV without preempting: free, or evictable."""
        if self.kv.pool.can_allocate(pages):
            return True
        return self.arbiter is not None and self.arbiter.reclaimable(protect) >= pages

    # -- a step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            if req.num_pending and self._ends_when_read(req):
                continue  # its token not read yet ends it: nothing to compute past it
            n = min(req.num_tokens - req.num_computed, budget)
            if req.num_computed + n > self.kv.capacity(req.request_id):  # else its pages hold the chunk
                if not self._make_room(req, req.num_computed + n, out):
                    continue
                self.kv.grow(req.request_id, req.num_computed + n)
            out.chunks.append(Chunk(req, n))
            budget -= n
        if out.preempted:
            self.growth = GROWTH_AFTER_PREEMPTION
        else:
            self.growth = max(GROWTH_MIN, self.growth - GROWTH_DECAY)
            self._admit(out, budget)
        return out

    def _ends_when_read(self, req: Request) -> bool:
        """Its tokens, those not read yet counted, reach its max_tokens or the context."""
        return (len(req.output_token_ids) + req.num_pending >= req.params.max_tokens
                or (self.max_model_len is not None and req.num_tokens >= self.max_model_len))

    def _expected_pages(self, req: Request) -> int:
        """KV pages `req` is expected to still take: the rest of its known tokens (a prompt
        being prefilled) and `growth` of the tokens its max_tokens still allows."""
        left = req.params.max_tokens - len(req.output_token_ids)
        if self.max_model_len is not None:
            left = min(left, self.max_model_len - req.num_tokens)
        return self.kv.extra_pages(req.request_id, req.num_tokens + math.ceil(self.growth * max(0, left)))

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        now = time.monotonic()
        heads = {k: h for k in list(self.queues) if (h := self._head(k)) is not None and self._ready(h)}
        promised = sum(self._expected_pages(r) for r in self.running) if heads else 0  # their expected growth
        while budget > 0 and len(self.running) < self.max_num_seqs and heads:
            req = next((r for r in self.preempted if heads.get(key(r)) is r), None)
            req = req or heads[self.policy.pick(heads)]
            if not self._ready(req):  # admitting another request evicted its adapter
                del heads[key(req)]
                continue
            cached = self.kv.adopt_prefix(req)  # the KV of its leading blocks, when cached
            req.num_computed = cached
            n = min(req.num_tokens - req.num_computed, budget)
            need = self.kv.extra_pages(req.request_id, req.num_computed + n)
            reserve = self.watermark_pages if self.running else 0  # alone, it may use the watermark
            # and grow into whatever room is left; with others, the expected growth of all of them
            # must fit in what could be freed, but nothing is evicted for it before it is needed
            expected = promised + self._expected_pages(req) if self.running else need  # >= need
            if not (self._could_hold(reserve + expected, req.loras)
                    and self._room(need + reserve, protect=req.loras)):
                self.kv.unadopt(req, cached)
                req.num_computed = 0
                break  # admitted when pages come back
            if not req.num_preemptions:  # what its prompt found cached (usage), not a recomputation's
                req.num_cached_tokens = cached
            k = key(req)
            self.queues[k].popleft()
            self._leave_waiting(req)
            self._start(req, now)
            self.kv.grow(req.request_id, req.num_computed + n)
            promised += self._expected_pages(req)
            out.chunks.append(Chunk(req, n))
            budget -= n
            if (h := self._head(k)) is not None and self._ready(h):
                heads[k] = h
            else:
                heads.pop(k, None)
        if budget > 0 and len(self.running) < self.max_num_seqs:
            for k in list(self.queues):  # heads that only lack their adapter: the exposed wait starts
                h = self._head(k)
                if h is not None and not self._ready(h) and h.adapter_blocked_since is None:
                    h.adapter_blocked_since = now

    def _start(self, req: Request, now: float) -> None:
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        if req.adapter_blocked_since is not None:
            req.adapter_wait += now - req.adapter_blocked_since
            req.adapter_blocked_since = None
        if req.adapter_cold and not req.num_preemptions:  # what a cold adapter cost it (the eviction order)
            self.arbiter.observe_miss(req.adapter_wait,
                                      sum(len(e.pages) for e in req.loras) * self.kv.pool.page_bytes)
        self.policy.on_admit(req)
        req.status = Status.RUNNING
        self.running[req] = None
        for e in req.loras:
            self.residency.pin(e)

    def _make_room(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Idle adapters first, then the newest running sequences, until `req` can hold
        `num_tokens` positions. False when `req` itself had to go."""
        while not self._room(self.kv.extra_pages(req.request_id, num_tokens)):
            victim = next(reversed(self.running))
            if victim is req and len(self.running) == 1:
                # alone and still no room: the pool cannot hold this sequence any longer (the
                # engine ends it with "length")
                self.finish(req)
                out.finished.append(req)
                return False
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def computed(self, chunks: list[Chunk]) -> None:
        """The step ran `chunks`: their tokens are computed, and their full blocks named for the
        prefix cache. The scheduler is the one writer of `num_computed` (admission sets it to
        what the cache held, preemption to 0, this to what ran). Only a chunk that fills a block
        has one to name: the KV manager has named every full block before it (its `num_hashed`
        never falls below `num_computed // block_size`). A chunk whose input was not read yet
        (`Request.num_pending`) names its blocks once it is (`read`)."""
        bs = self.kv.block_size
        for c in chunks:
            req = c.request
            before = req.num_computed
            req.num_computed = before + c.num_tokens
            if req.num_computed // bs != before // bs and not req.num_pending:
                self.kv.commit(req)

    def read(self, req: Request) -> None:
        """A token `req` drew in an earlier step is read (appended): the blocks its computed
        positions fill are named now."""
        if req.status is Status.RUNNING:
            self.kv.commit(req)

    def preempt(self, req: Request) -> None:
        self._stop(req)
        req.num_computed = 0
        req.num_preemptions += 1
        self.requeue(req)

    def _stop(self, req: Request) -> None:
        del self.running[req]
        self.kv.free(req.request_id)
        for e in req.loras:
            self.residency.unpin(e)

    def finish(self, req: Request) -> None:
        """Take `req` out of the queues and free its pages (finished or aborted)."""
        if req.status is Status.RUNNING:
            self._stop(req)
        elif req.status is Status.WAITING:
            self._leave_waiting(req)  # its queue entry goes when it reaches the head
        self.kv.free(req.request_id)
        k = key(req)
        self.active[k] -= 1
        if not self.active[k]:
            del self.active[k]
        self.policy.on_finish(req)
        req.status = Status.FINISHED
