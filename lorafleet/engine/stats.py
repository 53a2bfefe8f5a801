"""Counters the engine keeps, as plain numbers: what `engine.stats()` reports.

Per step: tokens scheduled, sequences, step time; per request: queue time, TTFT, TPOT. Recent
values live in bounded windows so a long-running daemon does not grow.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW = 1024


def _percentile(values, q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0          # prompt tokens computed (recomputation included)
    num_generated_tokens: int = 0
    num_requests_finished: int = 0
    num_requests_aborted: int = 0
    num_preemptions: int = 0
    step_times: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    step_batch_sizes: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    ttfts: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    tpots: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    queue_times: deque = field(default_factory=lambda: deque(maxlen=WINDOW))

    def record_step(self, seconds: float, num_seqs: int, prompt_tokens: int, generated: int) -> None:
        self.num_steps += 1
        self.step_times.append(seconds)
        self.step_batch_sizes.append(num_seqs)
        self.num_prompt_tokens += prompt_tokens
        self.num_generated_tokens += generated

    def record_finished(self, req) -> None:
        self.num_requests_finished += 1
        if req.first_token_time is not None:
            self.ttfts.append(req.first_token_time - req.arrival_time)
            n = len(req.output_token_ids)
            if n > 1 and req.finish_time is not None:
                self.tpots.append((req.finish_time - req.first_token_time) / (n - 1))

    def snapshot(self) -> dict:
        def summary(values):
            return {"p50": _percentile(values, 0.5), "p99": _percentile(values, 0.99)}
        return {
            "num_steps": self.num_steps,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "num_requests_finished": self.num_requests_finished,
            "num_requests_aborted": self.num_requests_aborted,
            "num_preemptions": self.num_preemptions,
            "step_time_s": summary(self.step_times),
            "ttft_s": summary(self.ttfts),
            "tpot_s": summary(self.tpots),
        }
