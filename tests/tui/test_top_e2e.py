"""End to end: `lorafleet top` in tmux against a real daemon under load. The captured screen
shows the pool map, the adapters under load with their tiers, and a non-zero throughput; `q`
ends it. tmux is needed: CI sets LORAFLEET_REQUIRE_TMUX=1, so a missing tmux fails there."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest

from tests.daemons import ADAPTERS

pytestmark = pytest.mark.heavy  # runs `lorafleet top` in tmux

TMUX = shutil.which("tmux")
if TMUX is None and os.environ.get("LORAFLEET_REQUIRE_TMUX") != "1":
    pytest.skip("tmux is not installed (LORAFLEET_REQUIRE_TMUX=1 makes this a failure)", allow_module_level=True)

LOADED = ADAPTERS[:3]


def tmux(*args: str, check: bool = True) -> str:
    assert TMUX is not None, "tmux is required (LORAFLEET_REQUIRE_TMUX=1) but not installed"
    out = subprocess.run([TMUX, "-L", f"lorafleet-test-{os.getpid()}", *args], capture_output=True, text=True,
                         timeout=30)
    if check:
        assert out.returncode == 0, out.stderr
    return out.stdout


def keep_busy(daemon, stop: threading.Event) -> tuple[list[threading.Thread], list[str]]:
    """Requests to the adapters in LOADED, back to back, until `stop`: the threads, and the
    errors they met."""
    errors = []

    def loop(adapter):
        with daemon.http(timeout=60) as c:
            while not stop.is_set():
                r = c.post("/v1/completions", json={"model": adapter, "prompt": "hello world, the quick brown",
                                                    "max_tokens": 24, "temperature": 0, "ignore_eos": True})
                if r.status_code != 200:
                    errors.append(r.text)
                    return
    threads = [threading.Thread(target=loop, args=(a,), daemon=True) for a in LOADED]
    for t in threads:
        t.start()
    return threads, errors


def test_top_shows_the_pool_the_busy_adapters_and_throughput(served, tmp_path):
    stop = threading.Event()
    threads, errors = keep_busy(served, stop)
    cmd = (f"cd {os.getcwd()} && LORAFLEET_HOME={tmp_path} {sys.executable} -m lorafleet.cli.main top "
           f"--socket {served.socket} --interval 0.3")
    tmux("new-session", "-d", "-s", "top", "-x", "100", "-y", "30", cmd)
    screen = ""
    try:
        deadline = time.monotonic() + 60
        while True:
            screen = tmux("capture-pane", "-p", "-t", "top", check=False)
            tok = re.search(r"tok/s (\d+(?:\.\d+)?)", screen)
            rows = {a for a in LOADED if re.search(rf"{re.escape(a)}\s+device\b", screen)}
            if tok and float(tok.group(1)) > 0 and rows == set(LOADED) and "pages ×" in screen:
                break
            assert time.monotonic() < deadline, f"top did not show the load within 60s:\n{screen}"
            time.sleep(0.3)
        assert not errors, errors
        assert "live" in screen and "pid" in screen
        # the pool map: the adapters' and the running requests' pages are drawn
        pool_lines = screen.split("pages ×")[0]
        assert "█" in pool_lines
        assert re.search(r"loads per step \(last \d+\)", screen)
        tmux("send-keys", "-t", "top", "q")
        deadline = time.monotonic() + 15
        while "top" in tmux("list-sessions", "-F", "#{session_name}", check=False).split():
            assert time.monotonic() < deadline, "q did not end lorafleet top"
            time.sleep(0.2)
    finally:
        stop.set()
        tmux("kill-server", check=False)
        for t in threads:
            t.join(60)
    served.wait_idle(30)  # the session's daemon goes back to the other tests idle
