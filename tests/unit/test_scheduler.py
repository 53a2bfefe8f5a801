"""Scheduler corner cases with a stub residency: admission never pins an adapter that an
earlier admission of the same step evicted."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lorafleet import SamplingParams
from lorafleet.engine.request import Request
from lorafleet.engine.scheduler import Scheduler
from lorafleet.memory.kv import KVCacheManager, kv_page_elems
from lorafleet.memory.pool import PagePool


class Entry(SimpleNamespace):
    __hash__ = object.__hash__  # identity, as residency's entries


class StubResidency:
    """Adapters own pool pages; make_room evicts unpinned, unprotected ones."""

    def __init__(self, pool, adapters):
        self.pool, self.entries = pool, {}
        for name, n in adapters.items():
            pages = pool.allocate(n, pool.new_owner(name))
            self.entries[name] = Entry(name=name, ready=True, pins=0, pages=pages, kv_salt=name.encode())

    def make_room(self, pages, protect=frozenset(), for_kv=False):
        for e in self.entries.values():
            if self.pool.can_allocate(pages):
                break
            if e.ready and e not in protect and not e.pins:
                self.pool.free(e.pages)
                e.ready = False
        return self.pool.can_allocate(pages)

    def pin(self, entry):
        assert entry.ready, f"adapter {entry.name!r} pinned while not on the device"
        entry.pins += 1

    def unpin(self, entry):
        entry.pins -= 1


def test_a_preempted_request_whose_adapter_was_just_evicted_waits():
    pool = PagePool(9, kv_page_elems(1, 16, 1, 4), torch.float32, "cpu")
    kv = KVCacheManager(pool, 1, 16, 1, 4)
    residency = StubResidency(pool, {"b": 2, "c": 2})   # 5 pages left for KV
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=1000, residency=residency)
    params = SamplingParams(max_tokens=4)
    reqs = [Request(f"p{i}", list(range(1, n + 1)), params, adapter,   # 3, 3 and 1 pages of KV
                    lora=residency.entries[adapter] if adapter else None)
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
