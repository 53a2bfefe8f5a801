"""RequestOutput carries deltas: every output what its step added (`new_token_ids`, `new_text`,
`new_logprobs`), the final one also the whole answer (`token_ids`, `text`, `logprobs`). Checked
by counts, never by timing: a step that copied the answer so far would hand out about n^2/2 ids
over an n-token answer instead of n."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lorafleet import Engine, SamplingParams
from lorafleet.engine.output import OutputProcessor
from lorafleet.engine.request import Request
from tests.fixtures import build_chat_model, stepping

N = 64
PROMPTS = ("hello world", "the quick brown fox")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module", params=["off", "on"])
def engine(model, request):
    """Steps read at once, and one step late (`async_decode`): the same contract."""
    engine = Engine(model, pool_bytes=4 << 20, async_decode=request.param)
    yield engine
    engine.close()


def collect(engine, rids, abort_after: int | None = None) -> dict[str, list]:
    """Every output of each request in `rids`, stepping until all ended (the first aborted after
    `abort_after` outputs)."""
    got = {rid: [] for rid in rids}
    for outs in stepping(engine, timeout=120):
        for o in outs:
            got[o.request_id].append(o)
        first = got[rids[0]]
        if abort_after is not None and len(first) == abort_after and not first[-1].finished:
            first.append(engine.abort(rids[0]))
    return got


def joined(outs, field: str) -> list:
    return [x for o in outs for x in getattr(o, field)]


def test_a_long_answer_is_handed_out_once_in_deltas(engine):
    # a stop string that never comes: text is held back, then handed out, as it would be
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=2, stop=("never-seen",))
    rids = [engine.add_request(p, params) for p in PROMPTS]
    for rid, outs in collect(engine, rids).items():
        final, steps = outs[-1], outs[:-1]
        assert final.finished and final.finish_reason == "length" and not any(o.finished for o in steps)
        # one token per step, and never more: kept until the end, no output's lists grew later
        assert [len(o.new_token_ids) for o in outs] == [1] * N
        assert sum(len(o.new_token_ids) for o in steps) == N - 1  # not ~N^2/2: no step copied the answer
        assert sum(len(o.new_text) for o in steps) <= len(final.text)
        for o in steps:  # the whole answer only at the end
            assert o.token_ids is None and o.text is None and o.logprobs is None and o.metrics is None
        assert final.token_ids == joined(outs, "new_token_ids") and len(final.token_ids) == N
        assert "".join(o.new_text for o in outs) == final.text
        assert final.text == engine.tokenizer.decode(final.token_ids)
        assert all(len(o.new_logprobs) == len(o.new_token_ids) for o in outs)
        assert final.logprobs == joined(outs, "new_logprobs") and len(final.logprobs) == N
        assert all(t in lp for t, lp in zip(final.token_ids, final.logprobs))
        assert final.metrics is not None


def test_without_logprobs_asked_none_are_carried(engine):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (outs,) = collect(engine, [engine.add_request(PROMPTS[0], params)]).values()
    assert all(o.new_logprobs is None for o in outs) and outs[-1].logprobs is None
    assert len(outs[-1].token_ids) == 8


def test_an_aborted_request_ends_with_its_whole_answer(engine):
    params = SamplingParams(max_tokens=5000, temperature=0.0, ignore_eos=True, logprobs=0)
    rid = engine.add_request(PROMPTS[1], params)
    (outs,) = collect(engine, [rid], abort_after=6).values()
    final = outs[-1]
    assert final.finish_reason == "abort" and not any(o.finished for o in outs[:-1])
    assert final.token_ids == joined(outs, "new_token_ids") and len(final.token_ids) == 6
    assert final.logprobs == joined(outs, "new_logprobs") and len(final.logprobs) == 6
    assert final.text == "".join(o.new_text for o in outs)


def test_generate_returns_final_outputs_with_the_whole_answer(engine):
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = engine.generate(list(PROMPTS), params)
    assert all(o.finished and len(o.token_ids) == len(o.logprobs) == N for o in outs)
    assert [o.text for o in outs] == [engine.tokenizer.decode(o.token_ids) for o in outs]


class Chars:
    """A decoder stand-in: every token decodes to two characters."""

    def step(self, token: int) -> str:
        return "ab"

    def flush(self) -> str:
        return ""


def test_the_processor_hands_out_each_token_and_character_once():
    """The output processor alone, over a long answer: what all outputs carry, whole fields
    included, adds up to n ids, n logprobs and 2n characters (the final output's whole answer
    counted once more), however long the answer."""
    n = 2000
    processor = OutputProcessor(eos_token_ids=frozenset(), max_model_len=10 * n)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0))
    req.detokenizer = Chars()
    carried = SimpleNamespace(ids=0, lps=0, chars=0)
    for i in range(n):
        if processor.append(req, i, {i: -0.5}) is not None:
            req.finish_reason, req.finish_time = "length", req.arrival_time  # what Engine._finish records
            processor.close_text(req)
        out = processor.output(req)
        carried.ids += len(out.new_token_ids) + len(out.token_ids or ())
        carried.lps += len(out.new_logprobs) + len(out.logprobs or ())
        carried.chars += len(out.new_text) + len(out.text or "")
    assert out.finished and out.token_ids == list(range(n)) and len(out.logprobs) == n
    assert (carried.ids, carried.lps, carried.chars) == (2 * n, 2 * n, 4 * n)
