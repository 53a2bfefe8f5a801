"""Shared fixtures: tiny random models in real Hugging Face formats, built per test session.

Every engine built in the tests checks the pool's integrity after each step
(LORAFLEET_DEBUG_CHECKS=1). Without a GPU, Triton kernels run interpreted (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

os.environ.setdefault("LORAFLEET_DEBUG_CHECKS", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # the Triton kernels run interpreted on the CPU; triton reads this when a kernel module is
    # first imported, so it is set before any test could import one
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from lorafleet.kernels import cpu_module  # noqa: E402
from tests.fixtures import build_model, force_kernels, variant_params  # noqa: E402


@pytest.fixture(params=variant_params())
def variant(request, monkeypatch):
    """A test that takes this runs on every CPU kernel variant this CPU can execute
    (`cpu_module.VARIANTS`: AVX2, AVX-512 in Intel's and AMD's layouts, AMX; this CPU's own in the
    default tier, the others heavy: a build each), each forced as LORAFLEET_KERNELS forces it
    (`force_kernels`). So an AVX-512 host checks the code an AVX2 or an AMD CPU runs, whichever
    CPU CI lands on."""
    return force_kernels(monkeypatch, request.param)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("llama"), "llama")


# real daemons for tests/server and tests/cli (a session fixture, shared by both)
from tests.daemons import adapter_dirs, chat_model_dir, served  # noqa: E402,F401


def pytest_configure(config):
    """Build the compiled CPU kernels once, up front, in this process: on a fresh machine that
    takes most of a minute, which must not be spent inside a daemon a test is waiting for. With
    LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI) a kernel that does not build stops the run here, with
    the build error, before any test could skip or quietly take the torch path. Not where the
    tests run on a GPU (LORAFLEET_DEVICE=cuda: lorafleet/bench/gpu_check.sh) or on the torch or Triton
    kernels alone (LORAFLEET_KERNELS). The other variants (`variant`'s heavy ones) are built by the
    first test that asks for each."""
    if os.environ.get("LORAFLEET_DEVICE", "cpu").startswith("cuda") or \
            os.environ.get("LORAFLEET_KERNELS", "auto") in ("torch", "triton"):
        return
    from lorafleet.kernels import build

    forced = os.environ.get("LORAFLEET_KERNELS")
    try:
        cpu_module.load(forced if forced in cpu_module.VARIANTS else None)
    except build.KernelUnavailableError as e:
        pytest.exit(f"{e}\n(unset LORAFLEET_REQUIRE_CPU_KERNELS to test the torch fallback instead)",
                    returncode=pytest.ExitCode.INTERNAL_ERROR)
