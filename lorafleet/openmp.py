"""torch's OpenMP workers in the processes that run the engine: how they wait, and which thread owns them.

How they wait (`set_defaults`): OMP_WAIT_POLICY=ACTIVE with GOMP_SPINCOUNT=2000, so that a worker spins across
the short gaps between a step's kernel calls (waking one costs more than a small kernel) but sleeps between
steps, when the daemon's event loop needs the cores (ACTIVE alone spins for minutes). libgomp reads them once,
at load: only the commands that start an engine (`serve`, the bench's runs) set them, never an import; a
variable the user set wins.

Which thread owns them (`serial_thread`): libgomp gives each thread that runs a parallel region a team, and
once all teams' workers outnumber the cores it spins at most 100 times (1,000 with ACTIVE) whatever
GOMP_SPINCOUNT says. So the engine's thread keeps the process's only team: prefetch workers run their torch
ops alone, and the daemon's main thread gives its team up once the engine thread runs.
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
