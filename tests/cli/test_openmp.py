"""The processes that run the engine set OpenMP's wait policy before torch loads
(`lorafleet/openmp.py`); a value the user set wins, and the bench's baselines keep theirs."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

from lorafleet import openmp
from lorafleet.bench import runner
from lorafleet.bench.jobs import Job

# runs `lorafleet serve` with the daemon replaced by a probe: what the environment holds when the
# engine would start, and whether torch was loaded before that
PROBE = """
import os, sys
import lorafleet.cli.serve as serve
def probe(*args, **kwargs):
    print(os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules)
serve._run = probe
from lorafleet.cli.main import app
app(["serve", "--socket", sys.argv[1]])
"""


def _serve_probe(tmp_path, **env) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in openmp.DEFAULTS}
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "s.sock")], env={**clean, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_serve_sets_the_wait_policy_before_torch_loads(tmp_path):
    assert _serve_probe(tmp_path) == ["ACTIVE", "2000", "False"]


def test_a_variable_the_user_set_wins(tmp_path):
    assert _serve_probe(tmp_path, OMP_WAIT_POLICY="PASSIVE") == ["PASSIVE", "2000", "False"]


def test_bench_workers_get_it_for_lorafleet_runs_only(tmp_path, monkeypatch):
    for name in openmp.DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    seen = {}

    def fake_run(argv, env, **kwargs):
        seen[job.system] = {k: env.get(k) for k in openmp.DEFAULTS}
        return SimpleNamespace(returncode=1, stderr="probe")

    monkeypatch.setattr(runner.subprocess, "run", fake_run)
    for system in ("lorafleet", "transformers"):
        job = Job(system, str(tmp_path), [])
        runner._run_isolated(job, tmp_path)
    assert seen["lorafleet"] == openmp.DEFAULTS
    assert seen["transformers"] == {k: None for k in openmp.DEFAULTS}
    assert "OMP_WAIT_POLICY" not in os.environ  # the bench's own process is left as it was
