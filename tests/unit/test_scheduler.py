"""Scheduler corner cases: with a stub residency, admission never pins an adapter that an
earlier admission of the same step evicted; admission keeps KV room for the expected growth of
running sequences."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lorafleet import SamplingParams
from lorafleet.engine import scheduler
from lorafleet.engine.request import Request
from lorafleet.engine.scheduler import Scheduler
from lorafleet.memory.kv import KVCacheManager, kv_page_elems
from lorafleet.memory.pool import PagePool

pytestmark = pytest.mark.unit


class Entry(SimpleNamespace):
    __hash__ = object.__hash__  # identity, as residency's entries


class StubResidency:
    """Adapters own pool pages; as the arbiter, make_room evicts unpinned, unprotected ones, wanted
    ones last."""

    def __init__(self, pool, adapters):
        self.pool, self.entries = pool, {}
        for name, n in adapters.items():
            pages = pool.allocate(n, pool.new_owner(name))
            self.entries[name] = Entry(name=name, ready=True, pins=0, pages=pages, kv_salt=name.encode())

    def make_room(self, pages, protect=frozenset(), for_kv=False, wanted=frozenset()):
        for e in sorted(self.entries.values(), key=lambda e: e in wanted):
            if self.pool.can_allocate(pages):
                break
            if e.ready and e not in protect and not e.pins:
                self.pool.free(e.pages)
                e.ready = False
        return self.pool.can_allocate(pages)

    def reclaimable(self, protect=None):
        return self.pool.num_free + sum(len(e.pages) for e in self.entries.values()
                                        if e.ready and e is not protect and not e.pins)

    def pin(self, entry):
        assert entry.ready, f"adapter {entry.name!r} pinned while not on the device"
        entry.pins += 1

    def unpin(self, entry):
        entry.pins -= 1


def test_a_preempted_request_whose_adapter_was_just_evicted_waits():
    pool = PagePool(9, kv_page_elems(1, 16, 1, 4), torch.float32, "cpu")
    kv = KVCacheManager(pool, 1, 16, 1, 4)
    residency = StubResidency(pool, {"b": 2, "c": 2})   # 5 pages left for KV
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=1000, residency=residency, arbiter=residency)
    params = SamplingParams(max_tokens=4)
    reqs = [Request(f"p{i}", list(range(1, n + 1)), params, adapter,   # 3, 3 and 1 pages of KV
                    loras=(residency.entries[adapter],) if adapter else (), scales=(1.0,) if adapter else ())
            for i, (adapter, n) in enumerate([(None, 40), ("b", 40), ("c", 16)])]
    for r in reqs:  # as after preemption: at the front of their queues, oldest first
        sched.add(r)
        r.num_preemptions = 1
        sched.preempted[r] = None
    sched.add(Request("new", [1, 2, 3], params, None))  # keeps a ready head in the queues
    out = sched.schedule()
    admitted = [c.request.adapter for c in out.chunks]
    assert admitted == [None, "b", None]         # b's room came from evicting c; c's request waits
    assert not residency.entries["c"].ready and reqs[2] in sched.waiting
    pool.check_integrity()


def _serve(sched, requests) -> int:
    """Drive the scheduler as the engine does (every chunk computed, one token per sampling
    chunk, finished at max_tokens); returns the number of preemptions."""
    for r in requests:
        sched.add(r)
    preemptions = 0
    for _ in range(10_000):
        if not sched.has_unfinished():
            return preemptions
        out = sched.schedule()
        preemptions += len(out.preempted)
        assert not out.finished, "a sequence ran out of room even alone"
        for chunk in out.chunks:
            req, samples = chunk.request, chunk.samples
            req.num_computed += chunk.num_tokens
            if samples:
                req.output_token_ids.append(7)
                if len(req.output_token_ids) == req.params.max_tokens:
                    sched.finish(req)
    raise AssertionError("the requests never finished")


def test_admission_keeps_room_for_what_running_sequences_will_generate(monkeypatch):
    """Sixteen 16-token prompts that each generate 48 tokens (4 pages at the end) in a pool of
    10 pages. Admitting by today's free pages alone preempts again and again; keeping their
    expected growth (70% of the remaining max_tokens at first) preempts once, when that guess
    proves short, and never again (after it admission expects every remaining token)."""
    params = SamplingParams(max_tokens=48, ignore_eos=True)

    def run():
        pool = PagePool(10, kv_page_elems(1, 16, 1, 4), torch.float32, "cpu")
        sched = Scheduler(KVCacheManager(pool, 1, 16, 1, 4), max_num_seqs=8, max_num_batched_tokens=1000,
                          max_model_len=128)
        n = _serve(sched, [Request(f"r{i}", list(range(1, 17)), params) for i in range(16)])
        assert pool.num_free == pool.num_pages
        return n

    assert run() == 1
    for name in ("GROWTH_START", "GROWTH_MIN", "GROWTH_AFTER_PREEMPTION"):
        monkeypatch.setattr(scheduler, name, 0.0)
    assert run() > 10  # without the expected growth (19 when written)


def test_a_preemption_makes_admission_expect_every_remaining_token():
    pool = PagePool(4, kv_page_elems(1, 16, 1, 4), torch.float32, "cpu")
    sched = Scheduler(KVCacheManager(pool, 1, 16, 1, 4), max_num_seqs=8, max_num_batched_tokens=1000)
    sched.growth = 0.0
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    reqs = [Request(f"r{i}", list(range(1, 17)), params) for i in range(3)]
    for r in reqs:
        sched.add(r)
    preempted = 0
    for _ in range(200):  # one-page prompts admitted together, then growing into 3 pages each
        if preempted:
            break
        out = sched.schedule()
        preempted += len(out.preempted)
        for chunk in out.chunks:
            req, samples = chunk.request, chunk.samples
            req.num_computed += chunk.num_tokens
            if samples:
                req.output_token_ids.append(7)
    assert sched.growth == scheduler.GROWTH_AFTER_PREEMPTION == 1.0
