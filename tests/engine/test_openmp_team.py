"""The engine's thread keeps the process's only OpenMP team (`lorafleet/openmp.py`): a thread
that calls `serial_thread` runs torch's ops on itself alone and ends the team it had, and the
prefetch workers are such threads."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lorafleet import Engine

# In a process of its own (the test process's threads keep their teams): a thread's first
# parallel op starts a team (one more OS thread with 2 torch threads), unless the thread called
# serial_thread first; the main thread's team ends when it calls it; threads started afterwards
# keep the process's count. Prints what it saw as key=value.
PROBE = r"""
import os, threading, time
import torch
from lorafleet import openmp

torch.set_num_threads(2)
big = torch.ones(1 << 22)

def tasks():
    return len(os.listdir("/proc/self/task"))

def settled(deadline=10.0):
    # the thread count once it has held for 0.2 s (threads that ended leave /proc a moment later)
    end = time.monotonic() + deadline
    last, since = tasks(), time.monotonic()
    while time.monotonic() < end and time.monotonic() - since < 0.2:
        time.sleep(0.01)
        if tasks() != last:
            last, since = tasks(), time.monotonic()
    return last

def in_thread(serial):
    out = {}
    def body():
        if serial:
            openmp.serial_thread()
        out["threads"] = torch.get_num_threads()
        before = tasks()
        big.add_(1)
        out["new"] = tasks() - before
    settled()  # an earlier thread's team may still be ending: its exit would count as -1
    t = threading.Thread(target=body)
    t.start()
    t.join(30)
    return out

plain, serial = in_thread(False), in_thread(True)
big.add_(1)  # the main thread's team
with_team = settled()
openmp.serial_thread()
print(f"plain_threads={plain['threads']} plain_new={plain['new']} serial_threads={serial['threads']} "
      f"serial_new={serial['new']} main_threads={torch.get_num_threads()} "
      f"main_released={with_team - settled()} later_threads={in_thread(False)['threads']}")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="counts threads in /proc/self/task (Linux)")
def test_a_serial_thread_starts_no_team_and_ends_its_own():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = dict(kv.split("=") for kv in out.stdout.split())
    assert seen["plain_threads"] == "2" and seen["plain_new"] == "1"    # the control: a team is visible
    assert seen["serial_threads"] == "1" and seen["serial_new"] == "0"
    assert seen["main_threads"] == "1" and seen["main_released"] == "1"
    assert seen["later_threads"] == "2"                                  # no one else's count changed


def test_prefetch_workers_run_torch_on_themselves_alone(llama_dir):
    threads = torch.get_num_threads()
    engine = Engine(llama_dir)
    try:
        counts = {engine.prefetcher.executor.submit(torch.get_num_threads).result(timeout=60) for _ in range(8)}
    finally:
        engine.close()
    assert counts == {1}
    assert torch.get_num_threads() == threads  # the engine's (this) thread keeps its own
