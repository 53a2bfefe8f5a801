"""A source file is one noun a reader can hold: every Python, C++ and shell source of the package
and its kernels stays within MAX_LINES (issue 49's mark; a file past it is split by what it
holds, as `bench/suite_tables.py` and `kernels/lora_triton_jit.py` were)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400
SOURCES = ("*.py", "*.cpp", "*.h", "*.sh")


def sources() -> set[Path]:
    found = set()
    for folder in ("lorafleet", "kernels"):
        for pattern in SOURCES:
            found |= {p.resolve() for p in (ROOT / folder).rglob(pattern)}  # lorafleet/kernels links to kernels/
    return found


def test_every_source_file_is_within_the_mark():
    files = sources()
    assert len(files) > 50  # the walk found the tree
    over = {p.relative_to(ROOT).as_posix(): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not over, f"over {MAX_LINES} lines, split by what they hold: {over}"
