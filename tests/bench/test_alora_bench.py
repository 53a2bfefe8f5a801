"""`python -m lorafleet.bench.alora` on the `micro` shape, judged by counts: each aLoRA call on a
base-answered history finds the history's whole blocks in the prefix cache and adds a page or
two, where a plain adapter's call computes and keeps the history again; the throughput run
serves both batches whole."""

from __future__ import annotations

import pytest

from lorafleet.bench import alora

pytestmark = pytest.mark.heavy  # whole benchmark runs


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAFLEET_HOME", str(tmp_path))  # the bench's base and adapters built here


def test_an_alora_call_reuses_the_history_a_plain_one_computes_again(home):
    r = alora.reuse("micro", history=48, n=2, rounds=1)
    blocks = 48 // r["page_tokens"]
    assert r["reused_tokens_median"] == blocks * r["page_tokens"]  # every whole block before the invocation
    assert r["alora_pages_added"] <= 2 * 2 < blocks * 2 <= r["plain_pages_added"]


def test_the_throughput_run_serves_both_batches(home):
    r = alora.throughput("micro", batch=4, rounds=1, prompt=24, new=4)
    assert r["mixed_tok_s"] > 0 and r["plain_tok_s"] > 0 and r["ratio"] > 0
