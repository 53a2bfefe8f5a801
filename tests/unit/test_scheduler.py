"""Scheduler corner cases with a stub residency: admission never pins an adapter that an
earlier admission of the same step evicted."""

from __future__ import annotations

import torch

from lorafleet import SamplingParams
from lorafleet.engine.request import Request
from lorafleet.engine.scheduler import Scheduler
from lorafleet.memory.kv import KVCacheManager, kv_page_elems
from lorafleet.memory.pool import PagePool


class StubResidency:
    """Adapters own pool pages; make_room evicts unpinned, unprotected ones."""

    def __init__(self, pool, adapters):
        self.pool, self.ready, self.pins, self.pages = pool, {}, {}, {}
        for name, n in adapters.items():
            self.pages[name] = pool.allocate(n, pool.owner_id(name))
            self.ready[name] = True

    def is_ready(self, name):
        return name is None or self.ready[name]

    def make_room(self, pages, protect=frozenset(), for_kv=False):
        for name in list(self.ready):
            if self.pool.can_allocate(pages):
                break
            if self.ready[name] and name not in protect and not self.pins.get(name):
                self.pool.free(self.pages.pop(name))
                self.ready[name] = False
        return self.pool.can_allocate(pages)

    def pin(self, name):
        assert self.ready[name], f"adapter {name!r} pinned while not on the device"
        self.pins[name] = self.pins.get(name, 0) + 1

    def unpin(self, name):
        self.pins[name] -= 1


def test_a_preempted_request_whose_adapter_was_just_evicted_waits():
    pool = PagePool(9, kv_page_elems(1, 16, 1, 4), torch.float32, "cpu")
    kv = KVCacheManager(pool, 1, 16, 1, 4)
    residency = StubResidency(pool, {"b": 2, "c": 2})   # 5 pages left for KV
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=1000, residency=residency)
    params = SamplingParams(max_tokens=4)
    reqs = [Request(f"p{i}", list(range(1, n + 1)), params, adapter)   # 3, 3 and 1 pages of KV
            for i, (adapter, n) in enumerate([(None, 40), ("b", 40), ("c", 16)])]
    for r in reversed(reqs):  # as after preemption: at the front, oldest first
        r.num_preemptions = 1
        sched.waiting.appendleft(r)
    sched.add(Request("new", [1, 2, 3], params, None))  # keeps a ready head in the queues
    out = sched.schedule()
    admitted = [c.request.adapter for c in out.chunks]
    assert admitted == [None, "b", None]         # b's room came from evicting c; c's request waits
    assert not residency.ready["c"] and reqs[2] in sched.waiting
    pool.check_integrity()
