"""The import boundaries of docs/structures.md: the CLI starts without torch; the engine never
pulls in the front ends."""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
from pathlib import Path

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


def test_the_tui_imports_nothing_of_the_cli():
    """`cli/top.py` imports the TUI, never the reverse: what both print with is `lorafleet/format.py`."""
    mods = imported_after("import lorafleet.tui.app, lorafleet.tui.model, lorafleet.tui.widgets, lorafleet.tui.screens")
    assert not {m for m in mods if m.startswith("lorafleet.cli")}


@pytest.mark.parametrize("module", ["lorafleet.snapshot", "lorafleet.format"])
def test_the_shapes_and_formats_the_front_ends_share_are_leaves(module):
    """The engine, the server, the TUI and the CLI all import these: they import nothing of lorafleet."""
    mods = imported_after(f"import {module}")
    assert {m for m in mods if m.startswith("lorafleet")} == {"lorafleet", module}
    assert not {"torch", "triton"} & mods


def test_kernels_from_a_checkout_does_not_shadow_the_hugging_face_package():
    """From the checkout's root, first on sys.path for `python -c` and `python -m` (and pytest),
    Python may find our kernels/ directory as a top-level `kernels`: with no __init__.py it is a
    namespace portion, which never shadows the installed Hugging Face `kernels` (transformers
    5.25 requires and imports it). `lorafleet.kernels` is ours, reached through the link
    lorafleet/kernels -> ../kernels that tools following imports by path follow too."""
    root = Path(__file__).resolve().parents[1]
    assert not (root / "kernels" / "__init__.py").exists()
    assert (root / "lorafleet" / "kernels").resolve() == root / "kernels"
    code = ("import kernels, lorafleet.kernels.backend, transformers.integrations.hub_kernels\n"
            "print(getattr(kernels, '__file__', None)); print(lorafleet.kernels.backend.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    top, ours = out.stdout.split()
    assert Path(ours).resolve() == root / "kernels" / "backend.py"
    try:
        importlib.metadata.distribution("kernels")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    assert (top != "None" and not Path(top).resolve().is_relative_to(root / "kernels")) == installed, (top, installed)


def package_graph() -> dict[str, dict[str, str]]:
    """Which part of lorafleet imports which (a subpackage, or a top-level module), with one place
    each edge is made: every import in the source counts, a function's lazy one too, since it
    ties the two parts together all the same. `from lorafleet import __version__` reads a
    constant of the facade, which imports nothing at import time: not an edge."""
    root = Path(__file__).resolve().parent.parent / "lorafleet"
    parts = {p.name if p.is_dir() else p.stem for p in root.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    edges: dict[str, dict[str, str]] = {}
    sources = [p for p in root.rglob("*.py")] + sorted((root / "kernels").resolve().glob("*.py"))
    for path in sources:
        rel = path.relative_to(root).parts if path.is_relative_to(root) else ("kernels", path.name)
        src = rel[0] if len(rel) > 1 else rel[0][:-3]
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                names = [n.module] if n.module != "lorafleet" else [
                    f"lorafleet.{a.name}" if a.name in parts else "lorafleet.__init__"
                    for a in n.names if a.name != "__version__"]
            elif isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            else:
                continue
            for name in names:
                bits = name.split(".")
                if bits[0] == "lorafleet" and len(bits) > 1 and bits[1] != src:
                    edges.setdefault(src, {}).setdefault(bits[1], f"{path.name}:{n.lineno}")
    return edges


def test_no_package_imports_one_that_imports_it():
    """The parts of lorafleet form a layered graph (model < adapters < memory < engine < server,
    store, front ends): a cycle would mean two parts that can only change together."""
    edges = package_graph()
    assert {"model", "adapters", "memory", "engine", "tui", "cli"} <= set(edges)
    cycles = []
    for start in edges:  # a depth-first walk from each part back to itself
        stack = [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for nxt in edges.get(node, {}):
                if nxt == start:
                    cycles.append(" -> ".join(f"{a} ({edges[a][b]})" for a, b in zip(trail, trail[1:] + [start])))
                elif nxt not in trail and len(trail) < 8:
                    stack.append((nxt, trail + [nxt]))
    assert not cycles, "package import cycles:\n" + "\n".join(sorted(set(cycles))[:10])


def test_the_model_imports_nothing_above_it():
    edges = package_graph()
    assert set(edges["model"]) <= {"errors", "kernels", "hugepages"}, edges["model"]
    assert set(edges["adapters"]) <= {"errors", "kernels", "model", "paths"}, edges["adapters"]
    assert set(edges["kernels"]) <= {"errors"}, edges["kernels"]
