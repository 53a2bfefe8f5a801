"""DESIGN.md's import boundaries: the CLI starts without torch; the engine never pulls in the
front ends."""

from __future__ import annotations

import subprocess
import sys

import pytest


def imported_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("module", ["lorafleet", "lorafleet.cli.main", "lorafleet.errors"])
def test_front_ends_do_not_import_torch(module):
    mods = imported_after(f"import {module}")
    assert not {"torch", "triton"} & mods, f"{module} imports torch/triton"


def test_lorafleet_help_runs_without_torch():
    code = ("import sys, runpy\nsys.argv = ['lorafleet', '--help']\n"
            "from lorafleet.cli.main import app\n"
            "try:\n    app()\nexcept SystemExit:\n    pass\n")
    mods = imported_after(code)
    assert "torch" not in mods


def test_the_engine_does_not_import_front_ends():
    mods = imported_after("import lorafleet.engine.engine")
    assert not {"textual", "typer", "fastapi", "uvicorn", "lorafleet.server", "lorafleet.cli"} & mods
