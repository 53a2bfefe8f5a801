"""A pull killed with SIGKILL at random points, 20 times: the store stays consistent (every
manifest matches its blobs; the name means the old adapter or the new one, never a half), and
a later pull completes. What killed pulls leave is invisible to `ls` and removed by `gc`."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from lorafleet.store.pull import pull
from lorafleet.store.store import Store
from tests.fixtures import ALL7, build_adapter, build_model


def start_pull(folder, home):
    # TMPDIR: the scratch folder of a killed pull stays in the test's own folder, not the system's
    env = {**os.environ, "LORAFLEET_HOME": str(home), "TMPDIR": str(home.parent)}
    return subprocess.Popen([sys.executable, "-m", "lorafleet.cli.main", "pull", str(folder), "--name", "x"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


@pytest.mark.heavy  # dozens of pull processes killed at random points
def test_pulls_killed_at_random_points_leave_the_store_consistent(tmp_path):
    base = build_model(tmp_path / "base", "llama", hidden_size=256, intermediate_size=704, num_hidden_layers=4)
    old = build_adapter(base, tmp_path / "old", seed=1, r=8, target_modules=ALL7)
    new = build_adapter(base, tmp_path / "new", seed=2, r=256, target_modules=ALL7)  # ~35 MB: a long install
    home = tmp_path / "home"
    store = Store(home / "store")
    pull(str(base), name="base", base=True, store=store)
    old_digest = pull(str(old), name="x", store=store)["digest"]
    t0 = time.monotonic()
    proc = start_pull(new, home)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    duration = time.monotonic() - t0
    new_digest = store.get("adapters", "x")["digest"]
    assert new_digest != old_digest
    rng = random.Random(0)
    seen = set()
    for i in range(20):
        pull(str(old), name="x", store=store)                # the old weights again before each try
        proc = start_pull(new, home)
        time.sleep(rng.uniform(0.2, 1.0) * duration)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        assert store.check(deep=True) == [], f"kill {i}"
        digest = store.get("adapters", "x")["digest"]
        assert digest in (old_digest, new_digest), f"kill {i}"
        seen.add(digest)
    assert old_digest in seen  # some kills landed before the new manifest (the others: after)
    proc = start_pull(new, home)
    assert proc.wait(timeout=300) == 0
    assert store.get("adapters", "x")["digest"] == new_digest and store.check(deep=True) == []
    with store.lock():
        store.gc()
    named = {e["sha256"] for kind in ("models", "adapters") for m in store.list(kind) for e in m["files"].values()}
    assert {p.name for p in store.blobs.iterdir()} == named and not store.tmp.exists()
