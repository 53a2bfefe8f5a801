"""torch's OpenMP workers, for the processes that run the engine: how they wait, and which
thread owns them.

How they wait: set in the environment before torch loads libgomp (which reads it once, at load),
so only by the commands that start an engine (`serve`, the bench's lorafleet runs), never by
importing lorafleet. A decode step is ~100 short kernel calls with a little Python between
them, and between two calls torch's OpenMP workers fall asleep; waking a worker costs more than
a small kernel, so a small call on 2 threads measured slower than on one. `OMP_WAIT_POLICY=ACTIVE`
with `GOMP_SPINCOUNT=2000` makes a worker spin briefly before it sleeps: across the gaps inside a
step, not across the gaps between steps, where the daemon's event loop and its clients need the
cores (ACTIVE alone spins for minutes: through the daemon it measured much slower). With it,
steps and their LoRA calls measured faster, in-process and through the daemon (docs/benchmark-history.md).
Both are defaults: a variable the user set wins.

Which thread owns them (`serial_thread`): libgomp gives every thread that runs a parallel region
a team of its own, and counts the workers of every team in the process; once they outnumber the
cores it spins at most 100 times (1,000 with ACTIVE) before it sleeps, whatever GOMP_SPINCOUNT
says. One other thread with a team is enough on 2 cores: a prefetch worker that copied an
adapter, or the thread that built the engine before the daemon's engine thread took it over. So
the engine's thread keeps the process's only team: the prefetch workers (which only read and
copy adapters, niced below the steps anyway) run their torch ops on themselves alone, and the
daemon's main thread gives its team up once the engine thread runs. In-process, decode steps
(base, one adapter, adapters in turn) measured faster with one team, under libgomp's defaults
and under the daemon's ACTIVE/2000; through the daemon the change stayed within the noise.
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
