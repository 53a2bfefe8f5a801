"""Sampling filters and per-request generators."""

from __future__ import annotations

import torch

from lorafleet import SamplingParams
from lorafleet.engine.request import MIN_TEMPERATURE
from lorafleet.model.sampler import filter_top_k_top_p, sample


def test_top_k_keeps_exactly_k_tokens():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    kept = filter_top_k_top_p(logits, 2, 1.0).isfinite()
    assert kept.tolist() == [False, True, False, True, False]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = filter_top_k_top_p(probs.log(), 0, 0.75).isfinite()
    assert kept.tolist() == [True, True, False, False]
    kept = filter_top_k_top_p(probs.log(), 0, 0.8).isfinite()   # 0.5+0.3 reaches 0.8
    assert kept.tolist() == [True, True, False, False]
    kept = filter_top_k_top_p(probs.log(), 0, 0.1).isfinite()   # the top token always stays
    assert kept.tolist() == [True, False, False, False]


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
