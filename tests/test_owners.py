"""One owner per piece of state: each of these fields is assigned in one module only (the others
call its interface). A second writer is a design error this test names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1] / "lorafleet"

# field -> the one module that assigns it
OWNERS = {
    "finish_reason": "engine/engine.py",       # Engine._finish: every way a request ends
    "num_computed": "engine/scheduler.py",     # admission, preemption, `computed`
    "row_table": "memory/residency.py",        # an adapter's state: residency alone
    "ready_step": "memory/residency.py",
    "served": "memory/residency.py",
    "pins": "memory/residency.py",
    "kv_salt": "memory/residency.py",
    "invocation": "memory/residency.py",       # an aLoRA's sequence: registration, or an eager load's inspection
    "num_pending": "engine/engine.py",         # the step in flight: launched, read
    "pending_row": "engine/engine.py",
    "activation": "engine/engine.py",          # add_request: where an aLoRA takes over, fixed for the request's life
    "detokenizer": "engine/output.py",         # the one place a token becomes text
}


def assignments(path: Path):
    """(attribute name, line) of every `x.name = ...`, `x.name += ...` in the file."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and not (isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                    yield sub.attr, node.lineno


def test_each_field_has_one_writer():
    writers: dict[str, set[str]] = {name: set() for name in OWNERS}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for name, line in assignments(path):
            if name in writers:
                writers[name].add(f"{rel}:{line}")
    for name, owner in OWNERS.items():
        files = {w.split(":")[0] for w in writers[name]}
        assert files <= {owner}, f"{name} is written outside {owner}: {sorted(writers[name])}"
        assert files, f"{name}: no writer found in {owner} (renamed?)"


# -- the front ends talk to the engine through its interface ------------------------------------------

FRONT_ENDS = ["server", "deploy", "store/resolver.py"]


def engine_accesses(path: Path):
    """(member, line) of every `engine.member`, `self.engine.member` or `x.worker.engine.member`."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "engine") or \
                    (isinstance(owner, ast.Attribute) and owner.attr == "engine"):
                yield node.attr, node.lineno


def test_the_front_ends_use_only_the_engines_interface():
    from lorafleet.engine.api import MEMBERS

    files = [p for f in FRONT_ENDS for p in ((ROOT / f).rglob("*.py") if (ROOT / f).is_dir() else [ROOT / f])]
    outside = [f"{p.relative_to(ROOT)}:{line} engine.{name}" for p in files
               for name, line in engine_accesses(p) if name not in MEMBERS]
    assert not outside, "the front ends reach into the engine beyond lorafleet/engine/api.py: " + ", ".join(outside)
    assert any(True for p in files for _ in engine_accesses(p)), "no engine access found: the check reads nothing"
