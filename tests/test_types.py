"""The type check: mypy over lorafleet/ (the kernels through their link) with the settings of
`[tool.mypy]` in pyproject.toml, clean. Its cache (.mypy_cache, at the checkout's root) makes a
rerun take seconds; a cold one takes most of a minute on 2 cores, so a session that selects this
test starts mypy in the background as it begins (`start`, from tests/conftest.py: niced, it
takes the CPU the other tests leave while they wait on their daemons) and the test collects it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
_run: tuple[subprocess.Popen, IO[str]] | None = None  # mypy and the file its output goes to


def start() -> None:
    global _run
    if _run is None and importlib.util.find_spec("mypy") is not None:
        out = tempfile.TemporaryFile("w+")  # not a pipe: nobody reads it until the end
        _run = subprocess.Popen(["nice", "-n", "10", sys.executable, "-m", "mypy"], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, text=True), out


def stop() -> None:
    """A session that ends before the test ran (-x, Ctrl-C) leaves no mypy behind."""
    if _run is not None and _run[0].poll() is None:
        _run[0].kill()
        _run[0].wait()


def test_mypy_is_clean():
    assert importlib.util.find_spec("mypy") is not None, "mypy is not installed: pip install -e '.[test]'"
    start()
    assert _run is not None
    proc, out = _run
    proc.wait(timeout=900)
    out.seek(0)
    assert proc.returncode == 0, f"mypy found errors (run `mypy` from {ROOT}):\n{out.read()}"
