"""A CPU kernel that does not build: the torch fallback by default, an error carrying the build's
message under LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI), so a broken toolchain cannot pass as skips;
a session of `unit` tests alone builds and loads none (tests/conftest.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lorafleet.kernels import build, lora_cpu, paged_attention_cpu

ROOT = Path(__file__).resolve().parents[2]
BUILD_ERROR = "Error building extension: c++: error: unrecognized command-line option '-fbogus'"


@pytest.fixture
def broken_build(monkeypatch, tmp_path):
    """Every kernel build fails as a bad compiler flag would; nothing built so far is remembered
    (an empty kernel cache, no module loaded in this process)."""
    from torch.utils import cpp_extension

    def fail(**kwargs):
        raise RuntimeError(BUILD_ERROR)
    monkeypatch.setattr(cpp_extension, "load_inline", fail)
    monkeypatch.setenv("LORAFLEET_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "_modules", {})
    monkeypatch.setattr(build, "_why_not", {})


def test_a_failed_build_falls_back_to_the_torch_path_by_default(broken_build, monkeypatch, caplog):
    monkeypatch.delenv("LORAFLEET_REQUIRE_CPU_KERNELS", raising=False)
    with caplog.at_level(logging.WARNING, logger="lorafleet.kernels"):
        assert lora_cpu.load() is None and paged_attention_cpu.load() is None
    assert "using the torch reference" in caplog.text and "-fbogus" in caplog.text


def test_a_failed_build_raises_the_build_error_when_kernels_are_required(broken_build, monkeypatch):
    monkeypatch.setenv("LORAFLEET_REQUIRE_CPU_KERNELS", "1")
    for load in (lora_cpu.load, paged_attention_cpu.load, lora_cpu.load):  # twice: not remembered as None
        with pytest.raises(build.KernelUnavailableError, match="-fbogus") as e:
            load()
        assert str(e.value.__cause__) == BUILD_ERROR


def test_the_torch_kernels_are_chosen_in_one_place_and_build_nothing(monkeypatch):
    from lorafleet.kernels import backend

    monkeypatch.setattr(build, "_modules", {})
    monkeypatch.setattr(build, "_why_not", {})
    monkeypatch.setattr(build, "_load_or_build", lambda *a, **k: pytest.fail("a kernel was built"))
    monkeypatch.setenv("LORAFLEET_KERNELS", "torch")
    ops = backend.select(torch.device("cpu"), torch.float32)
    assert ops.name == "torch" and not ops.graphs


def test_a_fallback_names_itself_torch_and_says_why(monkeypatch, caplog):
    from lorafleet.kernels import backend

    for dtype, why in ((torch.float16, "not float16"), (torch.float32, "unavailable")):
        if dtype == torch.float32:
            monkeypatch.setattr("lorafleet.kernels.cpu_module.load", lambda variant=None: None)
        with caplog.at_level("WARNING", logger="lorafleet.kernels"):
            ops = backend.cpu_kernels(dtype)
        assert ops.name == "torch" and why in ops.why
        assert any(ops.why in r.getMessage() for r in caplog.records)


def test_the_test_session_stops_at_start_when_a_required_kernel_does_not_build(broken_build, monkeypatch):
    from tests.conftest import build_kernels

    monkeypatch.setenv("LORAFLEET_REQUIRE_CPU_KERNELS", "1")
    with pytest.raises(pytest.exit.Exception, match="-fbogus"):
        build_kernels()
    monkeypatch.delenv("LORAFLEET_REQUIRE_CPU_KERNELS")
    build_kernels()  # without the variable: the run goes on (the kernel tests skip)


def session(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """A pytest session in a process of its own where any kernel build fails at once and must not
    (no compiler, LORAFLEET_REQUIRE_CPU_KERNELS=1), on an empty kernel cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("LORAFLEET_KERNELS", "LORAFLEET_DEVICE")}
    env.update(CXX=str(tmp_path / "no-compiler"), LORAFLEET_REQUIRE_CPU_KERNELS="1",
               LORAFLEET_KERNEL_CACHE=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.heavy  # it collects the whole tree in a subprocess: 14 s of the default tier
def test_a_session_of_unit_tests_collects_every_test_and_builds_or_loads_no_kernel(tmp_path):
    # the whole tree collected (no -m unit: no module may load a kernel as it is imported), one
    # unit file's tests selected and run
    out = session(tmp_path, "-k", "test_sampler", "tests")
    assert out.returncode == 0 and " passed" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    assert not (tmp_path / "cache").exists()


def test_a_session_with_a_test_past_the_unit_tier_stops_when_a_required_kernel_does_not_build(tmp_path):
    one = "test_the_torch_kernels_are_chosen_in_one_place_and_build_nothing"  # not unit: the session builds first
    out = session(tmp_path, f"{Path(__file__).relative_to(ROOT)}::{one}")
    assert out.returncode == pytest.ExitCode.INTERNAL_ERROR, out.stdout[-3000:] + out.stderr[-3000:]
    assert "no C++ compiler" in out.stdout + out.stderr
