"""Every way a request can end hands out its text exactly once: the `new_text` of its outputs,
concatenated, is its final text, and their `new_token_ids` its final `token_ids` (stop token,
stop string, length, the pool-full "length", deadline, abort, adapter error, a row that cannot
be sampled). On the demo fleet, whose echo makes the expected text known."""

from __future__ import annotations

import shutil
import time
from types import SimpleNamespace

import pytest

from lorafleet import Engine, SamplingParams
from lorafleet.engine import engine as engine_module
from lorafleet.demo import default_fleet
from lorafleet.demo.evaluate import chat_prompt
from tests.fixtures import stepping



@pytest.fixture(scope="module")
def fleet():
    return default_fleet()


@pytest.fixture(scope="module", params=["off", "on"])
def engine(fleet, request):
    """Steps read at once, and one step late (`async_decode`): every end the same."""
    engine = Engine(fleet.model, pool_bytes=8 << 20, async_decode=request.param)
    engine.load_adapter("upper", fleet.adapters["upper"])
    yield engine
    engine.close()


def run(engine, rid, abort_after: int | None = None):
    """Step until `rid` ends; every output it got (aborting it after `abort_after` outputs)."""
    outs = []
    for step_outs in stepping(engine, until=lambda: bool(outs and outs[-1].finished), timeout=60):
        outs += [o for o in step_outs if o.request_id == rid]
        if abort_after is not None and len(outs) >= abort_after and not outs[-1].finished:
            outs.append(engine.abort(rid))
    return outs


def check_text_once(outs, *reasons):
    final = outs[-1]
    assert final.finished and final.finish_reason in reasons, (final.finish_reason, final.error)
    assert "".join(o.new_text for o in outs) == final.text
    assert [t for o in outs for t in o.new_token_ids] == final.token_ids
    assert all(not o.finished for o in outs[:-1])
    for o in outs[:-1]:  # the whole answer comes once, at the end
        assert o.text is None and o.token_ids is None and o.logprobs is None and o.metrics is None
    return final


def test_stop_token(engine):
    rid = engine.add_request(chat_prompt(engine, None, "hello world"), SamplingParams(max_tokens=40, temperature=0))
    assert check_text_once(run(engine, rid), "stop").text == "hello world"


def test_stop_string_cut_and_held_back(engine):
    params = SamplingParams(max_tokens=40, temperature=0, stop=("o w", "zzzz"))
    rid = engine.add_request(chat_prompt(engine, None, "hello world"), params)
    assert check_text_once(run(engine, rid), "stop").text == "hell"


def test_length(engine):
    params = SamplingParams(max_tokens=7, temperature=0)
    rid = engine.add_request(chat_prompt(engine, None, "hello world"), params)
    assert check_text_once(run(engine, rid), "length").text == "hello w"


def test_pool_full_length(fleet):
    small = Engine(fleet.model, pool_bytes=1 << 16)  # 2 pages: 32 positions
    try:
        rid = small.add_request(chat_prompt(small, None, "hi"), SamplingParams(max_tokens=5000, temperature=0,
                                                                              ignore_eos=True))
        final = check_text_once(run(small, rid), "length")
        assert len(final.token_ids) < 5000 and final.text.startswith("hi")
    finally:
        small.close()


def test_deadline(engine, monkeypatch):
    """The deadline is read on the engine's clock, which here moves only when the test moves it:
    past the deadline once the request has 12 tokens, so it ends with exactly those, however
    long each step took on this machine."""
    now = [time.monotonic()]
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(monotonic=lambda: now[0], perf_counter=time.perf_counter))
    params = SamplingParams(max_tokens=5000, temperature=0, ignore_eos=True)
    rid = engine.add_request(chat_prompt(engine, None, "hello world"), params, deadline_s=0.3)
    outs = []
    for step_outs in stepping(engine, until=lambda: bool(outs and outs[-1].finished), timeout=60):
        outs += [o for o in step_outs if o.request_id == rid]
        if len(outs) == 12:
            now[0] += 1.0  # past the deadline: the next step ends it
    final = check_text_once(outs, "deadline")
    assert final.text.startswith("hello world") and len(final.token_ids) == 12


def test_abort(engine):
    params = SamplingParams(max_tokens=5000, temperature=0, ignore_eos=True)
    rid = engine.add_request(chat_prompt(engine, None, "hello world"), params)
    final = check_text_once(run(engine, rid, abort_after=6), "abort")
    assert final.text == "hello " and rid not in engine.requests


def test_adapter_error(engine, fleet, tmp_path):
    shutil.copytree(fleet.adapters["upper"], tmp_path / "gone")
    engine.register_adapter("gone", tmp_path / "gone")
    (tmp_path / "gone" / "adapter_model.safetensors").unlink()
    rid = engine.add_request(chat_prompt(engine, "upper", "hello world"), SamplingParams(max_tokens=8),
                             adapter="gone")
    final = check_text_once(run(engine, rid), "error")
    assert final.text == "" and "adapter_model.safetensors" in final.error


def test_a_row_that_cannot_be_sampled_ends_alone(engine, monkeypatch):
    """A step whose logits are not finite for one request fails that request only."""
    runner = engine.runner
    real = runner.execute
    prompts = [chat_prompt(engine, a, "hello world") for a in (None, "upper", None)]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3)
    alone = [engine.generate([p], params, adapters=[a])[0].text for p, a in zip(prompts, (None, "upper", None))]
    rids = [engine.add_request(p, params, adapter=a) for p, a in zip(prompts, (None, "upper", None))]
    victim = rids[1]

    def poisoned(chunks, lora=None, **kw):
        logits = real(chunks, lora, **kw).clone()
        rows = [c.request.request_id for c in chunks if c.samples]
        if victim in rows:
            logits[rows.index(victim)] = float("nan")
        return logits
    monkeypatch.setattr(runner, "execute", poisoned)
    got = {}
    for outs in stepping(engine):
        for o in outs:
            got.setdefault(o.request_id, []).append(o)
    assert check_text_once(got[victim], "error").error.startswith("the model produced non-finite logits")
    for rid, expected in zip((rids[0], rids[2]), (alone[0], alone[2])):
        assert check_text_once(got[rid], "stop", "length").text == expected
