"""Sampling: the batched filters against a row-by-row oracle, the draws' distribution, and
per-request generators."""

from __future__ import annotations

import pytest
import torch

from lorafleet import SamplingParams
from lorafleet.engine.request import MIN_TEMPERATURE
from lorafleet.model import sampler
from lorafleet.model.sampler import sample

pytestmark = pytest.mark.unit

NEG_INF = float("-inf")


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """The oracle, one row [V] at a time over the whole vocabulary: vLLM's order (top-k, top-p
    over what top-k kept, min-p), the most likely token always kept; dropped tokens at -inf."""
    if 0 < top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], NEG_INF)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, stable=True)
        probs = sorted_logits.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), NEG_INF)
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), NEG_INF)
    return logits


def batched_kept(x: torch.Tensor, params: list, whole: bool) -> torch.Tensor:
    """Which tokens the batched filter keeps [R, V] (x already divided by the temperatures), among
    `sampler.CANDIDATES` (and a top-k's k and one more) or the whole row."""
    V = x.shape[1]
    k = torch.tensor([p.top_k if 0 < p.top_k < V else 0 for p in params])
    K = V if whole else min(V, max(sampler.CANDIDATES, int(k.max()) + 1))
    probs, ids, complete = sampler._filtered(x, k, torch.tensor([p.top_p if p.top_p < 1 else float("inf")
                                                                 for p in params]),
                                             torch.tensor([p.min_p for p in params]), K)
    kept = torch.zeros_like(x, dtype=torch.bool).scatter(1, ids, probs > 0)
    return kept, complete


def test_top_k_keeps_exactly_k_tokens():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    for whole in (False, True):
        kept, complete = batched_kept(logits, [SamplingParams(top_k=2)], whole)
        assert kept.tolist() == [[False, True, False, True, False]] and complete.all()


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    for top_p, want in ((0.75, [True, True, False, False]), (0.8, [True, True, False, False]),  # 0.5+0.3 reaches 0.8
                        (0.1, [True, False, False, False])):                                  # the top token stays
        assert batched_kept(logits, [SamplingParams(top_p=top_p)], whole=True)[0].tolist() == [want]
        assert filter_top_k_top_p(logits[0], 0, top_p).isfinite().tolist() == want


SETTINGS = [dict(top_k=5), dict(top_k=40, top_p=0.9), dict(top_p=0.5), dict(top_p=0.95, min_p=0.05),
            dict(min_p=0.2), dict(top_k=3000, top_p=0.9), dict(top_p=0.99), dict(top_k=1)]


@pytest.mark.parametrize("vocab", [50, 3000])
def test_the_batched_filters_keep_what_the_row_by_row_oracle_keeps(vocab, monkeypatch):
    """Every setting side by side in one batch, over few candidates (most rows redone over their
    whole row) and over many: the kept tokens are the oracle's, row by row."""
    torch.manual_seed(0)
    params = [SamplingParams(temperature=1.0, **s) for s in SETTINGS] * 2
    x = torch.randn(len(params), vocab) * torch.linspace(0.5, 6, len(params))[:, None]
    want = torch.stack([filter_top_k_top_p(x[i], p.top_k, p.top_p, p.min_p).isfinite()
                        for i, p in enumerate(params)])
    for candidates in (8, 1024):
        monkeypatch.setattr(sampler, "CANDIDATES", candidates)
        filtered = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1]
        kept, complete = batched_kept(x[filtered], [params[i] for i in filtered], whole=False)
        for j, i in enumerate(filtered):
            if complete[j]:
                assert torch.equal(kept[j], want[i]), (candidates, params[i])
        if candidates == 8 and vocab == 3000:
            assert not complete.all()        # the wide nuclei are seen to need their whole row
        kept, complete = batched_kept(x[filtered], [params[i] for i in filtered], whole=True)
        assert complete.all() and torch.equal(kept, want[filtered])


def test_a_tie_at_the_kth_value_is_redone_over_the_whole_row(monkeypatch):
    monkeypatch.setattr(sampler, "CANDIDATES", 2)
    x = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]])
    p = SamplingParams(temperature=1.0, top_k=2)
    _, complete = batched_kept(x, [p], whole=False)
    assert not complete.any()
    assert filter_top_k_top_p(x[0], 2, 1.0).isfinite().tolist() == [True, True, True, True, False]
    assert batched_kept(x, [p], whole=True)[0].tolist() == [[True, True, True, True, False]]


@pytest.mark.parametrize("candidates", [1024, 1])
@pytest.mark.parametrize("setting", [dict(), dict(top_p=0.8), dict(top_k=2, min_p=0.1)])
def test_rows_drawn_together_follow_their_filtered_distribution(setting, candidates, monkeypatch):
    """64 rows from the shared generator, one batch: each token's frequency is its probability
    under the oracle's filtered distribution (a fixed seed: the counts are deterministic). With
    one candidate, the top-p rows are drawn again over their whole rows."""
    monkeypatch.setattr(sampler, "CANDIDATES", candidates)
    logits = torch.tensor([0.0, 2.0, -1.0, 1.0]).log_softmax(-1)
    p = SamplingParams(temperature=0.8, **setting)
    want = filter_top_k_top_p(logits / 0.8, p.top_k, p.top_p, p.min_p).softmax(-1)
    counts, shared, n = torch.zeros(4), torch.Generator().manual_seed(0), 0
    for _ in range(50):
        tokens, _, errors = sample(logits.expand(64, 4).clone(), [p] * 64, [None] * 64, shared=shared)
        assert not errors
        counts += torch.bincount(torch.tensor(tokens), minlength=4)
        n += 64
    assert ((counts / n - want).abs() < 0.02).all(), (counts / n, want)
    assert (counts[want == 0] == 0).all()


def test_a_mixed_batch_gives_each_row_what_it_would_get_alone():
    """Greedy, sampled, filtered and seeded rows, some with logprobs, in one call: greedy rows take
    the argmax, seeded rows their tokens alone, every logprob is the raw distribution's."""
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=5, logprobs=2)
    params = [SamplingParams(temperature=0, logprobs=1), SamplingParams(temperature=1.0),
              seeded, SamplingParams(temperature=0.5, top_k=3, logprobs=0),
              SamplingParams(temperature=0), SamplingParams(temperature=0.9, min_p=0.2)]
    gens = [None, None, torch.Generator().manual_seed(5), None, None, None]
    tokens, lps, errors = sample(logits, params, gens, shared=torch.Generator().manual_seed(1))
    assert not errors and all(t is not None for t in tokens)
    assert tokens[0] == int(logits[0].argmax()) and tokens[4] == int(logits[4].argmax())
    assert tokens[2] == sample(logits[2:3], [seeded], [torch.Generator().manual_seed(5)])[0][0]
    assert tokens[3] in logits[3].topk(3).indices.tolist()
    raw = logits.log_softmax(-1)
    for i in (0, 2, 3):
        assert lps[i][tokens[i]] == pytest.approx(raw[i, tokens[i]].item())
        assert len(lps[i]) <= params[i].logprobs + 1
    assert lps[1] is None and lps[5] is None


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 2.0, -1.0]]).log_softmax(-1)
    gen = torch.Generator().manual_seed(0)
    p = SamplingParams(temperature=1.0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(logits, [p], [gen])[0][0]] += 1
    expected = logits.softmax(-1)[0] * 3000
    assert ((counts - expected).abs() < 0.1 * 3000).all()


def test_a_row_with_a_seed_does_not_depend_on_other_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    p = SamplingParams(temperature=1.0, seed=7)
    alone = sample(logits[:1], [p], [torch.Generator().manual_seed(7)])[0][0]
    other = SamplingParams(temperature=1.0)
    shared = torch.Generator().manual_seed(1)
    batch = sample(logits, [other, p, other, other],
                   [shared, torch.Generator().manual_seed(7), shared, shared])[0]
    logits2 = torch.cat([logits[1:2], logits[:1]])
    assert sample(logits2, [other, p], [shared, torch.Generator().manual_seed(7)])[0][1] == alone
    assert batch[1] == sample(logits[1:2], [p], [torch.Generator().manual_seed(7)])[0][0]


def test_greedy_takes_the_argmax_and_logprobs_are_raw():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    tokens, lps, errors = sample(logits, [SamplingParams(temperature=0, logprobs=2)], [None])
    assert tokens == [1] and not errors
    ref = logits.log_softmax(-1)[0]
    assert lps[0] == {1: ref[1].item(), 2: ref[2].item()}


def test_temperatures_below_the_floor_are_greedy_not_an_overflow():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 30
    tiny = [SamplingParams(temperature=t, seed=1) for t in (1e-38, 1e-300, 5e-324, MIN_TEMPERATURE / 2)]
    assert all(p.greedy for p in tiny) and not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    tokens, _, errors = sample(logits, tiny, [torch.Generator().manual_seed(1)] * 4)
    assert not errors and tokens == logits.argmax(-1).tolist()


def test_a_row_whose_logits_overflow_at_its_temperature_fails_alone():
    logits = torch.tensor([[1.0, 2.0, 3.0], [3e38, 1.0, 2.0]])
    params = [SamplingParams(temperature=0.5)] * 2
    tokens, _, errors = sample(logits, params, [None, None], shared=torch.Generator().manual_seed(0))
    assert set(errors) == {1} and tokens[1] is None and tokens[0] in (0, 1, 2)


def test_a_row_that_cannot_be_sampled_fails_alone():
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    logits[1, 3] = float("nan")
    params = [SamplingParams(temperature=0.7, logprobs=1), SamplingParams(temperature=0.7, logprobs=1),
              SamplingParams(temperature=0)]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    tokens, lps, errors = sample(logits, params, gens)
    assert set(errors) == {1} and "non-finite" in errors[1]
    assert tokens[1] is None and lps[1] is None
    assert tokens[2] == int(logits[2].argmax())
    alone = sample(logits[:1], params[:1], [torch.Generator().manual_seed(0)])[0][0]
    assert tokens[0] == alone                           # the failed row changed nothing for the others


def test_more_logprobs_than_the_vocabulary_returns_the_whole_vocabulary():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    tokens, lps, _ = sample(logits, [SamplingParams(temperature=0, logprobs=20)], [None])
    assert set(lps[0]) == {0, 1, 2}


def test_a_token_drawn_again_over_its_whole_row_has_its_own_logprob(monkeypatch):
    """One candidate: every top-p row is drawn again after the read, and the logprob it reports
    is that of the token it ends with."""
    monkeypatch.setattr(sampler, "CANDIDATES", 1)
    torch.manual_seed(0)
    logits = torch.randn(8, 30)
    params = [SamplingParams(temperature=1.0, top_p=0.95, logprobs=1)] * 8
    tokens, lps, errors = sample(logits, params, [None] * 8, shared=torch.Generator().manual_seed(2))
    raw = logits.log_softmax(-1)
    assert not errors and len(set(tokens)) > 1
    for i, t in enumerate(tokens):
        assert lps[i][t] == pytest.approx(raw[i, t].item())
