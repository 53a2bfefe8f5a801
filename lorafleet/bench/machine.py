"""The machine the bench shares: its cores, its load, and how much CPU other processes took
while a figure was timed.

With torch on every core, one other busy process stalls each parallel op until the OS runs the
thread the op waits for: on a small machine a decode step can take many times longer, in bursts
of seconds, and the same requests can be served an order of magnitude slower or faster. The
bench cannot stop other work; it measures it per replay (`other_cores`), so that a figure timed
beside it is reported as such (`report.noise_warnings`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

MIN_WINDOW_S = 0.2


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def load_average() -> float | None:
    """The 1-minute load average."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def cpu_seconds(pids: tuple[int, ...] = ()) -> tuple[float, float] | None:
    """(CPU seconds the whole machine has been busy, CPU seconds of this process and `pids`),
    from /proc; None where there is none. Busy: user, nice, system, irq, softirq and steal (a
    hypervisor's other guests are other work too)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        ours = 0
        for pid in ("self", *pids):
            stat = Path(f"/proc/{pid}/stat").read_text()
            after_name = stat[stat.rindex(")") + 2:].split()  # fields from the 3rd (state) on
            ours += int(after_name[11]) + int(after_name[12])  # utime, stime: fields 14 and 15
    except (OSError, ValueError, IndexError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    busy = sum(v for i, v in enumerate(fields) if i not in (3, 4))  # all but idle and iowait
    return busy / tick, ours / tick


def process_tree(pid: int) -> tuple[int, ...]:
    """`pid` and its descendants now (a daemon and its render processes); those gone meanwhile are
    left out."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        with contextlib.suppress(OSError, ValueError):
            for task in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
    return tuple(tree)


def other_cpu_seconds(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """CPU seconds other processes used between two `cpu_seconds` readings."""
    if before is None or after is None:
        return None
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1]))


def other_cores(cpu_s: float | None, seconds: float) -> float | None:
    """Cores other processes kept busy, on average, over `seconds` in which they used `cpu_s`;
    None for windows under `MIN_WINDOW_S`, too short for the kernel's 10 ms accounting tick."""
    if cpu_s is None or seconds < MIN_WINDOW_S:
        return None
    return cpu_s / seconds
