"""`async_decode`: each step's tokens read after the next step is launched (`Engine._launch`, `_settle`).
On the demo fleet, whose echo makes the texts known: every request gets what it gets with
steps read at once, token for token (adapters, stop strings and tokens, max_tokens, the context,
seeded sampling, logprobs, the prefix cache, preemption, the fixed-shape decode path), with the
engine's integrity checked after every step; a request that ends on a token read late had a row
in the step launched meanwhile, and that row's token is dropped."""

from __future__ import annotations

import pytest

from lorafleet import Engine, SamplingParams
from lorafleet.demo import default_fleet
from lorafleet.demo.evaluate import chat_prompt
from tests.fixtures import stepping


@pytest.fixture(scope="module")
def fleet():
    return default_fleet()


def workload(engine, names):
    prompts, adapters, params = [], [], []
    for i, (adapter, text) in enumerate((a, t) for a in [None, *names] for t in ("hello world", "the quick brown fox")):
        prompts.append(chat_prompt(engine, adapter, text))
        adapters.append(adapter)
        params.append(SamplingParams(
            max_tokens=4 + 3 * i, temperature=0.8 if i % 4 == 3 else 0.0, seed=i if i % 4 == 3 else None,
            top_p=0.9, stop=("o w", "ui") if i % 3 == 0 else (), logprobs=2 if i % 5 == 1 else None))
    return prompts, params, adapters


def workload_params(fleet):
    engine = Engine(fleet.model, pool_bytes=1 << 20)
    try:
        return workload(engine, list(fleet.adapters)[:3])[1]
    finally:
        engine.close()


def serve(fleet, mode: str, names, **options):
    engine = Engine(fleet.model, async_decode=mode, debug_checks=True, **{"pool_bytes": 8 << 20, **options})
    try:
        for name in names:
            engine.load_adapter(name, fleet.adapters[name])
        prompts, params, adapters = workload(engine, names)
        outs = engine.generate(prompts, params, adapters=adapters)
        got = [(o.token_ids, o.text, o.finish_reason, o.logprobs) for o in outs]
        rest = [o for step_outs in stepping(engine, timeout=30) for o in step_outs]  # a step still in flight
        assert rest == [] and engine.inflight is None
        return got, engine.stats(), engine
    finally:
        engine.close()


@pytest.mark.parametrize("options", [{}, {"decode_graphs": "fixed", "max_num_seqs": 16},
                                     {"max_model_len": 36}])
def test_reading_a_step_late_changes_no_token(fleet, options):
    """The same requests with steps read at once and one step late: the same tokens, texts, ends
    and logprobs. The second setting runs the fixed-shape decode steps CUDA graphs capture (the
    pending inputs filled in their buffer); the third a short context, where sequences end at it."""
    names = list(fleet.adapters)[:3]
    want, sync_stats, _ = serve(fleet, "off", names, **options)
    got, stats, engine = serve(fleet, "on", names, **options)
    assert got == want
    assert {f for _, _, f, _ in got} >= {"stop", "length"}
    assert sync_stats["num_discarded"] == 0
    assert stats["num_discarded"] >= 1  # stop strings and tokens are read late: their next row is dropped
    assert stats["num_discarded"] <= sum(f == "stop" for _, _, f, _ in got)  # max_tokens never takes a row
    if "max_model_len" in options:
        assert any(len(t) < p.max_tokens and f == "length" for (t, _, f, _), p in zip(got, workload_params(fleet)))
    if "decode_graphs" in options:
        assert stats["decode_graphs"]["replays"] > 0
    assert not engine.has_unfinished()


def test_a_sequence_preempted_with_its_token_in_flight_gets_it_back(fleet):
    """A pool of 6 pages for 6 sequences growing to 40 tokens: one is preempted while its newest
    token is drawn; the token is read into it while it waits, and its recomputation includes it."""
    prompts = ("hello world", "the quick brown fox", "abc def", "zzz top", "one two three", "xyz")
    got = {}
    for mode in ("off", "on"):
        engine = Engine(fleet.model, pool_bytes=6 << 15, async_decode=mode, debug_checks=True)
        try:
            outs = engine.generate([chat_prompt(engine, None, t) for t in prompts],
                                   SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
            got[mode] = [o.token_ids for o in outs]
            assert engine.stats()["num_preemptions"] >= 1
        finally:
            engine.close()
    assert got["on"] == got["off"] and all(len(t) == 40 for t in got["on"])


def test_an_abort_between_steps_drops_its_token_in_flight(fleet):
    """Aborted while its next token is drawn: it ends with the text it was handed, the drawn token
    dropped, and the others go on as if it had never been there."""
    engine = Engine(fleet.model, pool_bytes=8 << 20, async_decode="on", debug_checks=True)
    try:
        params = SamplingParams(max_tokens=5000, temperature=0, ignore_eos=True)
        victim = engine.add_request(chat_prompt(engine, None, "hello world"), params)
        other = engine.add_request(chat_prompt(engine, None, "the quick brown fox"),
                                   SamplingParams(max_tokens=12, temperature=0))
        outs = {victim: [], other: []}
        for step_outs in stepping(engine, timeout=60):
            for o in step_outs:
                outs[o.request_id].append(o)
            if len(outs[victim]) == 6 and not outs[victim][-1].finished:
                assert engine.requests[victim].num_pending == 1  # its seventh token is in flight
                outs[victim].append(engine.abort(victim))
        final = outs[victim][-1]
        assert final.finish_reason == "abort" and final.text == "hello " and len(final.token_ids) == 6
        assert engine.stats()["num_discarded"] >= 1
        alone = engine.generate([chat_prompt(engine, None, "the quick brown fox")],
                                SamplingParams(max_tokens=12, temperature=0))[0]
        assert outs[other][-1].token_ids == alone.token_ids
    finally:
        engine.close()


def test_outputs_come_one_step_late_and_the_last_step_is_read(fleet):
    """A step's tokens come out of the next `step()` call; with nothing left to schedule, the
    call reads the step in flight, and `has_unfinished` holds until then."""
    engine = Engine(fleet.model, pool_bytes=8 << 20, async_decode="on")
    try:
        engine.add_request(chat_prompt(engine, None, "hi"), SamplingParams(max_tokens=3, temperature=0))
        first = engine.step()   # the prompt's step launched, not read
        assert first == [] and engine.has_unfinished() and engine.inflight is not None
        seen = []
        for outs in stepping(engine, timeout=30):
            seen += outs
        assert [len(o.new_token_ids) for o in seen] == [1, 1, 1] and seen[-1].finished
        assert seen[-1].token_ids == [t for o in seen for t in o.new_token_ids]
        assert engine.inflight is None and len(engine.step_records()) == 3
    finally:
        engine.close()


def test_a_captured_step_never_reads_a_pending_id_in_its_padding(fleet):
    """The fixed-shape path: as requests end, steps shrink inside their bucket, and the rows
    past the batch keep whatever ids they held; none may be a pending row's -1 - j (a negative
    index into the embedding, which a GPU does not forgive)."""
    engine = Engine(fleet.model, pool_bytes=8 << 20, async_decode="on", decode_graphs="fixed", max_num_seqs=8)
    try:
        for i, text in enumerate(("hello world", "the quick brown fox", "abc", "one two three five")):
            engine.add_request(chat_prompt(engine, None, text), SamplingParams(max_tokens=3 + 4 * i, temperature=0,
                                                                              ignore_eos=True))
        sizes = set()
        graphs = engine.runner.graphs
        for _ in stepping(engine, timeout=60):
            step = engine.inflight
            if step is not None and all(c.num_tokens == 1 for c in step.chunks):  # the rows its graph read
                assert int(graphs.ids[:graphs.bucket(len(step.chunks))].min()) >= 0
                sizes.add(len(step.chunks))
        assert len(sizes) >= 3 and graphs.replays > 0  # the batch shrank within its bucket
    finally:
        engine.close()
