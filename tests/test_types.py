"""The type check: mypy over lorafleet/ (the kernels through their link) with the settings of
`[tool.mypy]` in pyproject.toml, clean. Its cache (.mypy_cache, at the checkout's root) makes a
rerun take seconds; a cold one takes about a minute on 2 cores."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_is_clean():
    assert importlib.util.find_spec("mypy") is not None, "mypy is not installed: pip install -e '.[test]'"
    run = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"mypy found errors (run `mypy` from {ROOT}):\n{run.stdout}{run.stderr}"
