"""How torch's OpenMP workers wait, for the processes that run the engine: set in the
environment before torch loads libgomp (which reads it once, at load), so only by the commands
that start an engine (`serve`, the bench's lorafleet runs), never by importing lorafleet.

Why: a decode step is ~100 short kernel calls with tens of microseconds of Python between them,
and between two calls torch's OpenMP workers fall asleep. libgomp spins only ~100 times before it
sleeps once a process holds more OpenMP threads than cores, which is the engine's case (its own
thread and the prefetch workers each get a team), and waking a worker costs more than a small
kernel: on `tiny`'s shapes an o_proj LoRA call took 36 us on 2 threads against 10 us on one.
`OMP_WAIT_POLICY=ACTIVE` with `GOMP_SPINCOUNT=2000` makes a worker spin ~0.1 ms before it sleeps:
across the gaps inside a step, not across the gaps between steps, where the daemon's event loop
and its clients need the cores (ACTIVE alone spins for minutes: through the daemon, 70 tokens/s
instead of 130 at batch 1). Measured in-process, `tiny`, batch 1 on one rank-64 adapter: a step
10.3 -> 8.4 ms, its LoRA calls 2.4 -> 1.5 ms; through the daemon (README, Kernels): one adapter at
1 in flight 95 -> 115 tokens/s, eight in turn 104 -> 125.
Both are defaults: a variable the user set wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

DEFAULTS = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "2000"}


def set_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """Put the defaults in `environ` (this process's, or a child's) where they are unset."""
    for name, value in DEFAULTS.items():
        environ.setdefault(name, value)
