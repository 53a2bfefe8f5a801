"""Issue 64 (8): the bench's lines and tables carry their styles as rich Text, never as markup,
so a console that prints markup literally (lorafleet's, off a terminal and in files) shows none."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from lorafleet.bench import runner, tables

pytestmark = pytest.mark.unit


def plain(renderable) -> str:
    out = io.StringIO()
    Console(file=out, markup=False, highlight=False, width=200).print(renderable)
    return out.getvalue()


def test_a_runs_line_shows_no_markup():
    ok = {"system": "lorafleet", "status": "ok", "seconds": 2.0, "generated_tokens": 100,
          "details": {"repeats": [{"tokens_per_s": 50.0}, {"tokens_per_s": 52.0}], "other_cores": 1.5}}
    bad = {"system": "llama.cpp", "status": "skipped", "reason": "no [server] here", "seconds": 0}
    for run in (ok, bad):
        text = plain(runner._summary("tiny", run))
        assert "[/" not in text and "[bold" not in text and "[yellow" not in text, text
    assert "50.0 tokens/s" in plain(runner._summary("tiny", ok)) and "no [server] here" in plain(runner._summary("t", bad))


def test_a_missed_target_shows_no_markup():
    assert plain(tables.verdict(False)).strip() == "missed" and plain(tables.verdict(True)).strip() == "met"
