"""Admission order among waiting requests: FCFS, or fair across adapters (the default).

Fairness is a virtual token counter per adapter (the base model counts as one more adapter), in
the spirit of VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024):
- admitting a request charges its adapter w_p * prompt tokens + w_q * max_tokens up front;
  what it did not generate is refunded when it finishes;
- the next request admitted is the head of the adapter with the smallest counter;
- an adapter that becomes active (no request waiting or running) has its counter lifted to the
  smallest counter of the active ones, so idle time earns no credit to burst later.
The promise (tested): while adapters a and b both have requests waiting, their counters never
differ by more than U, the largest charge of one request. With requests of equal shape, their
generated tokens over any such window differ by at most max_tokens * (1 + max_num_seqs):
one request's worth of admissions plus what is still in flight. A flooding adapter therefore
gets its fair share, not more, whatever its request rate.

A mix (a request on k adapters) is one request: it waits in a queue of its own (its label, so
the same mix queues FCFS), is admitted once, and its charge is split evenly: each of its adapters
is charged (and refunded) 1/k of it. Its queue's counter is the mean of its adapters' counters.
So a mix costs its adapters together what one request costs one adapter, and an adapter used
through mixes is served no more than its share.
"""

from __future__ import annotations

from collections.abc import Collection

from lorafleet.engine.request import Request
from lorafleet.snapshot import SchedulerStats

W_PROMPT = 1.0
W_OUTPUT = 2.0  # a generated token costs a step of its own; prompt tokens are batched


def key(req: Request) -> str:
    """The queue a request waits in: its adapter's name, its mix's label, "" for the base."""
    return req.label or ""


def accounts(req: Request) -> list[tuple[str, float]]:
    """The counters a request's charge goes to, with their shares."""
    names = req.names or ("",)
    return [(name, 1.0 / len(names)) for name in names]


def charge(req: Request) -> float:
    return W_PROMPT * len(req.prompt_token_ids) + W_OUTPUT * req.params.max_tokens


class FCFS:
    name = "fcfs"

    def on_arrival(self, req: Request, active: Collection[str]) -> None:
        pass

    def pick(self, heads: dict[str, Request]) -> str:
        return min(heads, key=lambda k: heads[k].arrival_time)

    def on_admit(self, req: Request) -> None:
        pass

    def on_finish(self, req: Request) -> None:
        pass

    def snapshot(self) -> SchedulerStats:
        return {"policy": self.name}


class VTC(FCFS):
    name = "vtc"

    def __init__(self):
        self.counters: dict[str, float] = {}

    def on_arrival(self, req: Request, active: Collection[str]) -> None:
        floor = min((self.counters.get(a, 0.0) for a in active), default=None)
        for name, _ in accounts(req):
            if name in active:
                continue
            current = self.counters.get(name, 0.0)
            self.counters[name] = current if floor is None else max(current, floor)

    def _counter(self, req: Request) -> float:
        return sum(share * self.counters.get(name, 0.0) for name, share in accounts(req))

    def pick(self, heads: dict[str, Request]) -> str:
        return min(heads, key=lambda k: (self._counter(heads[k]), heads[k].arrival_time))

    def _charge(self, req: Request, amount: float) -> None:
        for name, share in accounts(req):
            self.counters[name] = self.counters.get(name, 0.0) + share * amount

    def on_admit(self, req: Request) -> None:
        if req.num_preemptions:  # re-admission after preemption was paid for already
            return
        self._charge(req, charge(req))

    def on_finish(self, req: Request) -> None:
        if req.first_scheduled_time is not None:  # it was admitted: refund what it left unused
            unused = req.params.max_tokens - len(req.output_token_ids)
            self._charge(req, -W_OUTPUT * max(0, unused))

    def snapshot(self) -> SchedulerStats:
        return {"policy": self.name, "counters": dict(self.counters)}


POLICIES = {"vtc": VTC, "fcfs": FCFS}
