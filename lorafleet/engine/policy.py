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
"""

from __future__ import annotations

from lorafleet.engine.request import Request

W_PROMPT = 1.0
W_OUTPUT = 2.0  # a generated token costs a step of its own; prompt tokens are batched


def key(req: Request) -> str:
    return req.adapter or ""


def charge(req: Request) -> float:
    return W_PROMPT * len(req.prompt_token_ids) + W_OUTPUT * req.params.max_tokens


class FCFS:
    name = "fcfs"

    def on_arrival(self, req: Request, active: set[str]) -> None:
        pass

    def pick(self, heads: dict[str, Request]) -> str:
        return min(heads, key=lambda k: heads[k].arrival_time)

    def on_admit(self, req: Request) -> None:
        pass

    def on_finish(self, req: Request) -> None:
        pass

    def snapshot(self) -> dict:
        return {"policy": self.name}


class VTC(FCFS):
    name = "vtc"

    def __init__(self):
        self.counters: dict[str, float] = {}

    def on_arrival(self, req: Request, active: set[str]) -> None:
        k = key(req)
        if k in active:
            return
        floor = min((self.counters.get(a, 0.0) for a in active), default=None)
        current = self.counters.get(k, 0.0)
        self.counters[k] = current if floor is None else max(current, floor)

    def pick(self, heads: dict[str, Request]) -> str:
        return min(heads, key=lambda k: (self.counters.get(k, 0.0), heads[k].arrival_time))

    def on_admit(self, req: Request) -> None:
        if req.num_preemptions:  # re-admission after preemption was paid for already
            return
        self.counters[key(req)] = self.counters.get(key(req), 0.0) + charge(req)

    def on_finish(self, req: Request) -> None:
        if req.first_scheduled_time is not None:  # it was admitted: refund what it left unused
            unused = req.params.max_tokens - len(req.output_token_ids)
            self.counters[key(req)] = self.counters.get(key(req), 0.0) - W_OUTPUT * max(0, unused)

    def snapshot(self) -> dict:
        return {"policy": self.name, "counters": dict(self.counters)}


POLICIES = {"vtc": VTC, "fcfs": FCFS}
