"""Counters the engine keeps, as plain numbers: what `engine.stats()` reports.

Per step: tokens scheduled, sequences, step time; per request: queue time, TTFT, TPOT. Recent
values live in bounded windows so a long-running daemon does not grow.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from lorafleet.snapshot import CounterStats, MixCounts, Quantiles

WINDOW = 1024
STEP_LOG = 100_000  # per-step records kept for the switch regression (~100 bytes each)


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]) of the values that are not None; None if none.
    The one definition: engine stats, /metrics and the bench all report through it."""
    s = sorted(v for v in values if v is not None)
    return _nearest_rank(s, q) if s else None


def _nearest_rank(s: list[float], q: float) -> float:
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


def summary(values: Iterable[float | None]) -> Quantiles:
    """{"p50", "p99"} of the values (None where there are none)."""
    s = sorted(v for v in values if v is not None) if values else ()
    if not s:  # most adapters of a large fleet have no loads or waits yet: the common case, fast
        return {"p50": None, "p99": None}
    return {"p50": _nearest_rank(s, 0.5), "p99": _nearest_rank(s, 0.99)}


@dataclass
class Counters:
    """The engine's counters (`engine.counters`); `snapshot` is their part of `Engine.stats()`."""

    num_steps: int = 0
    num_prompt_tokens: int = 0          # prompt tokens computed (recomputation included)
    num_generated_tokens: int = 0
    num_requests_finished: int = 0
    num_requests_aborted: int = 0
    num_preemptions: int = 0
    num_discarded: int = 0              # drawn tokens dropped: their request ended before they were read
    step_times: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    step_batch_sizes: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    ttfts: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    tpots: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    queue_times: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    adapter_waits: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    steps: deque = field(default_factory=lambda: deque(maxlen=STEP_LOG))
    num_adapter_loads: int = 0
    mix_sizes: dict[int, int] = field(default_factory=dict)  # adapters in a mix -> requests that named one
    alora_requests: int = 0             # finished requests on an aLoRA
    alora_reused_tokens: int = 0        # their prompt tokens the prefix cache served (the base's history, mostly)
    _last_read: float = 0.0  # when the last step was read (`record_launched`)

    def record_mix(self, adapters: int) -> None:
        """A request named a mix of `adapters` adapters (counted when it is accepted)."""
        self.mix_sizes[adapters] = self.mix_sizes.get(adapters, 0) + 1

    def mixes(self) -> MixCounts:
        """`requests`: accepted requests that named a mix; `adapters`: the adapters they named in
        all (adapters / requests: the mean mix); `by_size`: requests per mix size."""
        return {"requests": sum(self.mix_sizes.values()), "adapters": sum(k * n for k, n in self.mix_sizes.items()),
                "by_size": {str(k): n for k, n in sorted(self.mix_sizes.items())}}

    def record_launched(self, chunks: list, t0: float, loaded: int, generated: int, model_s: float) -> int:
        """A step read: its chunks, when its `step()` call began, the adapters that landed for
        it, the tokens it generated and its forward pass's time; its time runs from the later of
        `t0` and the last read (read one call late: the time between reads). Returns its prompt
        tokens."""
        prompt_tokens = sum(c.num_tokens for c in chunks if not (c.samples and c.num_tokens == 1))
        now = time.perf_counter()
        seconds, self._last_read = now - max(t0, self._last_read), now
        self.record_step(seconds, len(chunks), prompt_tokens, generated,
                         distinct_adapters=len({n for c in chunks for n in c.request.names or (None,)}),
                         adapters_loaded=loaded, model_s=model_s)
        return prompt_tokens

    def record_step(self, seconds: float, num_seqs: int, prompt_tokens: int, generated: int,
                    distinct_adapters: int = 0, adapters_loaded: int = 0, model_s: float = 0.0) -> None:
        """`model_s`: the model's forward pass (LoRA included); the rest of `seconds` is the
        host-side work (schedule, batch build, sampling, output processing), `host_s`."""
        self.steps.append({"time_s": seconds, "host_s": seconds - model_s, "num_seqs": num_seqs,
                           "num_tokens": prompt_tokens + generated, "num_generated": generated,
                           "distinct_adapters": distinct_adapters, "adapters_loaded": adapters_loaded})
        self.num_adapter_loads += adapters_loaded
        self.num_steps += 1
        self.step_times.append(seconds)
        self.step_batch_sizes.append(num_seqs)
        self.num_prompt_tokens += prompt_tokens
        self.num_generated_tokens += generated

    def record_finished(self, req) -> None:
        self.num_requests_finished += 1
        if req.activation is not None:
            self.alora_requests += 1
            self.alora_reused_tokens += req.num_cached_tokens
        if req.first_scheduled_time is not None:
            self.queue_times.append(req.first_scheduled_time - req.arrival_time)
            self.adapter_waits.append(req.adapter_wait)
        if req.first_token_time is not None:
            self.ttfts.append(req.first_token_time - req.arrival_time)
            n = len(req.output_token_ids)
            if n > 1 and req.finish_time is not None:
                self.tpots.append((req.finish_time - req.first_token_time) / (n - 1))

    def snapshot(self) -> CounterStats:
        return {
            "num_steps": self.num_steps,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "num_requests_finished": self.num_requests_finished,
            "num_requests_aborted": self.num_requests_aborted,
            "num_preemptions": self.num_preemptions,
            "num_discarded": self.num_discarded,
            "num_adapter_loads": self.num_adapter_loads,
            "alora": {"requests": self.alora_requests, "reused_tokens": self.alora_reused_tokens},
            "queue_time_s": summary(self.queue_times),
            "adapter_wait_s": summary(self.adapter_waits),
            "step_time_s": summary(self.step_times),
            "ttft_s": summary(self.ttfts),
            "tpot_s": summary(self.tpots),
        }
