"""The import boundaries of docs/structures.md: the CLI starts without torch; the engine never
pulls in the front ends."""

from __future__ import annotations

import subprocess
import sys

import pytest


def imported_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("module", ["lorafleet", "lorafleet.cli.main", "lorafleet.errors", "lorafleet.client",
                                    "lorafleet.paths", "lorafleet.config", "lorafleet.openmp", "lorafleet.tui.app"])
def test_front_ends_do_not_import_torch(module):
    mods = imported_after(f"import {module}")
    assert not {"torch", "triton"} & mods, f"{module} imports torch/triton"


def test_lorafleet_help_runs_without_torch():
    code = ("import sys, runpy\nsys.argv = ['lorafleet', '--help']\n"
            "from lorafleet.cli.main import app\n"
            "try:\n    app()\nexcept SystemExit:\n    pass\n")
    mods = imported_after(code)
    assert "torch" not in mods


def test_lorafleet_status_runs_without_torch(tmp_path):
    """`lorafleet status` with no daemon: the friendly line and exit 3, and never torch."""
    code = ("import os, sys\n"
            f"os.environ['LORAFLEET_SOCKET'] = {str(tmp_path / 'none.sock')!r}\n"
            "from lorafleet.cli.main import app\n"
            "try:\n    app(['status'], prog_name='lorafleet')\n"
            "except SystemExit as e:\n    assert e.code == 3, e.code\n")
    mods = imported_after(code)
    assert "torch" not in mods and "lorafleet.engine.engine" not in mods
    assert "httpx" in mods  # it did talk to the client


def test_the_engine_does_not_import_front_ends():
    mods = imported_after("import lorafleet.engine.engine")
    assert not {"textual", "typer", "fastapi", "uvicorn", "lorafleet.server", "lorafleet.cli"} & mods


def test_the_tui_talks_to_the_daemon_only():
    """`lorafleet top` sees what /v1/stats says, through the client: no engine, server or store."""
    mods = imported_after("import lorafleet.tui.app, lorafleet.cli.top")
    assert not {m for m in mods if m.startswith(("lorafleet.engine", "lorafleet.server", "lorafleet.memory",
                                                    "lorafleet.store"))}
