"""Shared fixtures: tiny random models in real Hugging Face formats, built per test session.

Every engine built in the tests checks the pool's integrity after each step
(LORAFLEET_DEBUG_CHECKS=1). Without a GPU, Triton kernels run interpreted (TRITON_INTERPRET=1).
The compiled CPU kernels are built once a session's tests are known, unless they are all `unit`
(`pytest_collection_finish`).
"""

from __future__ import annotations

import os
import re

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


def pytest_ignore_collect(collection_path, config):
    """Under `-m unit` (or `-m "unit and ..."`) a test file that never names the mark holds no unit
    test, so it is not imported: importing the whole tree was most of the tier's seconds."""
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_") and \
            re.fullmatch(r"\s*unit(\s+and\s.*)?", config.option.markexpr or "", re.DOTALL):
        try:
            return "mark.unit" not in collection_path.read_text(encoding="utf-8") or None
        except OSError:
            return None
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """A test is heavy or unit, never both: `-m unit` replaces the default `-m 'not heavy'`, so a
    heavy test in a file marked unit would join the seconds tier (mark that file's others one by one)."""
    both = [item.nodeid for item in items if item.get_closest_marker("unit") and item.get_closest_marker("heavy")]
    if both:
        raise pytest.UsageError(f"marked both heavy and unit: {', '.join(both)}")


def pytest_collection_finish(session):
    """Build the compiled CPU kernels once, after collection and before the first test, in this
    process (`build_kernels`), unless every selected test is `unit` (those never need them: a
    unit session builds and loads nothing, and fails a unit test that asks, `unit_kernels`).
    Not for --collect-only: nothing runs."""
    if session.config.option.collectonly or not session.items:
        return
    if any(item.name == "test_mypy_is_clean" for item in session.items):
        from tests import test_types

        test_types.start()  # beside the kernels' build and the tests before it (tests/test_types.py)
    if all(item.get_closest_marker("unit") for item in session.items):
        _refuse_kernels(session.config)
        torch.set_num_threads(1)  # beside other work torch's waiting threads spin: the tier took twice as long
        return
    build_kernels()


def build_kernels() -> None:
    """On a fresh machine the build takes most of a minute, which must not be spent inside a
    daemon a test is waiting for. With LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI) a kernel that does not
    build stops the run here, with the build error, before any test could skip or quietly take
    the torch path. Not where the tests run on a GPU (LORAFLEET_DEVICE=cuda: kernels/gpu_check.sh)
    or on the torch or Triton kernels alone (LORAFLEET_KERNELS). The other variants (`variant`'s
    heavy ones) are built by the first test that asks for each."""
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


_asked: list[str] = []  # the kernels a unit test asked for in a unit session


def _refuse_kernels(config) -> None:
    """In a unit session a kernel build raises (the torch path serves) and is remembered, so
    that `unit_kernels` fails the test that asked: a build here would cost the tier its seconds."""
    from lorafleet.kernels import build

    def refuse(name, *args, **kwargs):
        _asked.append(name)
        raise RuntimeError(f"a unit test asked for the CPU kernel {name}")

    real = build._load_or_build
    build._load_or_build = refuse
    config.add_cleanup(lambda: setattr(build, "_load_or_build", real))


@pytest.fixture(autouse=True)
def unit_kernels():
    """Fails, at teardown, a test of a unit session that asked for a compiled kernel: it is not
    a unit test (take its mark off, or have it use LORAFLEET_KERNELS=torch)."""
    yield
    if _asked:
        from lorafleet.kernels import build

        names = sorted(set(_asked))
        _asked.clear()
        for name in names:  # forgotten, so that the next test that asks fails too
            build._modules.pop(name, None)
            build._why_not.pop(name, None)
        pytest.fail(f"this test asked for the CPU kernel {', '.join(names)}: a unit test builds and loads no kernel")


def pytest_sessionfinish(session):
    from tests import test_types

    test_types.stop()
