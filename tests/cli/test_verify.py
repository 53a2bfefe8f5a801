"""`lorafleet verify` (exit 0 when the kernels agree, 1 on a disagreement naming them, 2 on usage, 3
without the daemon of --socket; `--json`'s one object) and `lorafleet serve`'s self-check (a
daemon refuses to start on a broken fast path, and starts with --no-self-check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from lorafleet.cli.main import app
from lorafleet.kernels import backend
from lorafleet.openmp import DEFAULTS
from tests.daemons import ADAPTERS, POOL, Daemon
from tests.engine.broken_kernels import HOOK, break_fast_path
from tests.fixtures import build_adapter, build_model

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
QUICK = ["--prompts", "1", "--tokens", "3", "--no-transformers"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("verify-cli"), "llama")


def invoke(*args, home: Path):
    # the OpenMP defaults `verify` sets are this process's: restored with the rest of the environment
    return runner.invoke(app, ["verify", *args], env={"LORAFLEET_HOME": str(home), "LORAFLEET_SOCKET": None,
                                                      "COLUMNS": "200", **DEFAULTS})


def test_json_is_one_object_and_agreement_exits_0(base, tmp_path):
    zero = build_adapter(base, tmp_path / "zero", b_std=0.0, r=2, target_modules=["q_proj"])
    result = invoke(str(base), "--adapter", f"nothing={zero}", *QUICK, "--json", home=tmp_path)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report) >= {"model", "device", "dtype", "quantization", "kernels", "prompts", "tokens", "targets",
                           "ok", "problems", "warnings"}
    assert report["ok"] and report["kernels"] == backend.select(torch.device("cpu"), torch.float32).label
    base_target, nothing = report["targets"]
    assert base_target["name"] == "base" and base_target["adapter"] is None
    assert set(base_target["torch"]) == {"max_logit_diff", "tolerance", "greedy", "ok"}
    assert nothing["name"] == "nothing" and nothing["changes_nothing"] and nothing["tensors"]["unused"] == []
    assert len(report["warnings"]) == 1
    strict = invoke(str(base), "--adapter", str(zero), *QUICK, "--strict", home=tmp_path)  # PATH: named "zero"
    assert strict.exit_code == 1 and "warning: zero: changes nothing" in strict.stderr


def test_a_disagreement_exits_1_naming_the_kernels(base, tmp_path, monkeypatch):
    want = backend.select(torch.device("cpu"), torch.float32).label
    break_fast_path(monkeypatch)
    result = invoke(str(base), *QUICK, home=tmp_path)
    assert result.exit_code == 1
    assert f"error: base: the {want} kernels' prefill logits differ from the torch reference" in result.stderr


def test_usage_errors_exit_2_and_no_daemon_exits_3(base, tmp_path):
    assert invoke(str(base), "--socket", str(tmp_path / "d.sock"), home=tmp_path).exit_code == 2
    assert invoke(str(base), "--prompts", "0", home=tmp_path).exit_code == 2
    assert invoke(str(base), "--kernels", "fastest", home=tmp_path).exit_code == 2
    result = invoke("--socket", str(tmp_path / "nobody.sock"), "--json", home=tmp_path)
    assert result.exit_code == 3 and json.loads(result.stderr)["error"]["code"] == "daemon_unreachable"


def test_socket_verifies_what_the_daemon_serves(served):
    stats = served.stats()["engine"]
    assert stats["self_check"]["kernels"] == stats["kernels_label"]  # serve checked itself at start
    assert stats["self_check"]["max_abs_diff"] <= stats["self_check"]["tolerance"]
    result = invoke("--socket", str(served.socket), *QUICK, "--json", home=served.home)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["model"] == stats["model"] and report["kernels"] == stats["kernels_label"]
    names = [t["name"] for t in report["targets"]]
    assert names[0] == "base" and set(names[1:]) == set(ADAPTERS)


def start(root: Path, model: Path, *args: str) -> Daemon:
    """`lorafleet serve` on a fast path made wrong (`broken_kernels.HOOK`) in a process of its own."""
    home, sock, log_path = root / "home", root / "run" / "d.sock", root / "daemon.log"
    home.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-c", HOOK, "serve", str(model), "--socket", str(sock),
                                 "--device", "cpu", "--pool-bytes", POOL, *args], cwd=ROOT, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "LORAFLEET_HOME": str(home), "COLUMNS": "200"})
    return Daemon(proc, sock, home, log_path)


def test_serve_refuses_a_broken_fast_path_and_starts_without_the_check(base, tmp_path):
    refused = start(tmp_path / "a", base)
    assert refused.wait(120) == 1
    assert "self-check failed" in refused.log() and "logits differ from the torch reference" in refused.log()
    assert not refused.socket.exists()
    daemon = start(tmp_path / "b", base, "--no-self-check")
    try:
        daemon.wait_ready()
        assert daemon.stats()["engine"]["self_check"] is None
    finally:
        daemon.stop()
