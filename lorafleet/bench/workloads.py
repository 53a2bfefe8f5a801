"""Benchmark workloads: how many requests, how long their prompts and outputs are, when they
arrive. A workload and its seed fix the requests exactly (a private `random.Random`, never the
global RNG), so every system under test gets the same token ids and lengths.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from lorafleet.errors import ConfigError

ARRIVALS = ("all-at-once",)
FIRST_ORDINARY_ID = 3  # ids 0-2 are pad/bos/eos in the random bench models


@dataclass(frozen=True)
class Workload:
    """Lengths are drawn uniformly from the inclusive ranges (lo, hi)."""

    name: str
    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    seed: int = 0
    arrival: str = "all-at-once"
    description: str = ""

    def __post_init__(self):
        if self.num_requests < 1:
            raise ConfigError(f"workload {self.name}: num_requests must be >= 1")
        for field, (lo, hi) in (("prompt_len", self.prompt_len), ("output_len", self.output_len)):
            if not 1 <= lo <= hi:
                raise ConfigError(f"workload {self.name}: {field} needs 1 <= lo <= hi, got {(lo, hi)}")
        if self.arrival not in ARRIVALS:
            raise ConfigError(f"workload {self.name}: arrival {self.arrival!r} is not one of {ARRIVALS}")

    @property
    def max_seq_len(self) -> int:
        return self.prompt_len[1] + self.output_len[1]


WORKLOADS: dict[str, Workload] = {
    "base-only": Workload("base-only", 64, (16, 256), (16, 256),
                          description="base model only, 64 requests arriving at once"),
    "quick": Workload("quick", 8, (8, 32), (8, 32), description="a smoke run of base-only"),
}


def get_workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r} (choose from {', '.join(WORKLOADS)})")
    return WORKLOADS[name]


def make_requests(workload: Workload, vocab_size: int) -> list[tuple[list[int], int]]:
    """[(prompt token ids, max_tokens)] in arrival order; the same for the same workload and
    vocabulary size, and the same lengths for any vocabulary size."""
    if vocab_size <= FIRST_ORDINARY_ID:
        raise ConfigError(f"vocab_size must be > {FIRST_ORDINARY_ID}, got {vocab_size}")
    rng = random.Random(workload.seed)
    # lengths first, so that they do not depend on the vocabulary: every shape gets the same
    lengths = [(rng.randint(*workload.prompt_len), rng.randint(*workload.output_len))
               for _ in range(workload.num_requests)]
    return [([rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(prompt_len)], output_len)
            for prompt_len, output_len in lengths]
