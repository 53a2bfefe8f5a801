"""torch's OpenMP workers, for the processes that run the engine: how they wait, and which
thread owns them.

How they wait: set in the environment before torch loads libgomp (which reads it once, at load),
so only by the commands that start an engine (`serve`, the bench's lorafleet runs), never by
importing lorafleet. A decode step is ~100 short kernel calls with tens of microseconds of Python
between them, and between two calls torch's OpenMP workers fall asleep; waking a worker costs
more than a small kernel (on `tiny`'s shapes an o_proj LoRA call took 36 us on 2 threads against
10 us on one). `OMP_WAIT_POLICY=ACTIVE` with `GOMP_SPINCOUNT=2000` makes a worker spin ~0.1 ms
before it sleeps: across the gaps inside a step, not across the gaps between steps, where the
daemon's event loop and its clients need the cores (ACTIVE alone spins for minutes: through the
daemon, 70 tokens/s instead of 130 at batch 1). Measured in-process, `tiny`, batch 1 on one
rank-64 adapter: a step 10.3 -> 8.4 ms, its LoRA calls 2.4 -> 1.5 ms; through the daemon
(README, Kernels): one adapter at 1 in flight 95 -> 115 tokens/s, eight in turn 104 -> 125.
Both are defaults: a variable the user set wins.

Which thread owns them (`serial_thread`): libgomp gives every thread that runs a parallel region
a team of its own, and counts the workers of every team in the process; once they outnumber the
cores it spins at most 100 times (1,000 with ACTIVE) before it sleeps, whatever GOMP_SPINCOUNT
says. One other thread with a team is enough on 2 cores: a prefetch worker that copied an
adapter, or the thread that built the engine before the daemon's engine thread took it over. So
the engine's thread keeps the process's only team: the prefetch workers (which only read and
copy adapters, niced below the steps anyway) run their torch ops on themselves alone, and the
daemon's main thread gives its team up once the engine thread runs. Measured in-process with
libgomp's defaults (`tiny`, AMD EPYC, 2 threads, batch 8, 8 rank-64 adapters loaded by the
prefetcher, medians of 3 runs of 50 steps, the two forms in separate processes): a base decode
step 8.0 -> 6.3-6.6 ms (6.3 in a process that never loaded an adapter), one adapter on every
row 12.2 -> 7.9-8.4 ms, the 8 adapters in turn 16.8-17.4 -> 11.6-11.9 ms; with the daemon's
ACTIVE/2000, 6.7-6.9 -> 6.2-6.7, 8.1-8.2 -> 7.5-7.9 and 12.1-12.5 -> 11.2-11.4 ms. Through the
daemon (ACTIVE already) no change stood out of the host's noise.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import MutableMapping
from functools import cache

DEFAULTS = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "2000"}
OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the team's threads end, the runtime stays


def set_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """Put the defaults in `environ` (this process's, or a child's) where they are unset."""
    for name, value in DEFAULTS.items():
        environ.setdefault(name, value)


@cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch runs on, already in the process once torch is imported (RTLD_NOLOAD:
    never a second copy); None where torch runs on another OpenMP runtime, whose workers are
    counted differently."""
    try:
        return ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
    except (OSError, AttributeError):  # not loaded, or no RTLD_NOLOAD (not a POSIX system)
        return None


def serial_thread() -> None:
    """From now on torch's CPU ops on the calling thread run on it alone, and the OpenMP team it
    started, if any, ends (why: the module doc). Other threads keep their thread counts."""
    import torch

    # ATen sets a thread's OpenMP count at the thread's first parallel op: done now, so that it
    # cannot raise the count set below again
    torch.get_num_threads()
    gomp = _libgomp()
    if gomp is None:
        return
    gomp.omp_set_num_threads(1)  # this thread's count only (an OpenMP ICV of its own)
    gomp.omp_pause_resource_all(OMP_PAUSE_SOFT)
