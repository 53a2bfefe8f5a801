"""Continuous batching: a request's output does not depend on its company, on chunking, or on
being preempted; every page comes back."""

from __future__ import annotations

import pytest
import torch

from lorafleet import Engine, SamplingParams
from lorafleet.errors import RequestNotFoundError
from tests.fixtures import stepping


def random_prompts(n, lo=4, hi=40, vocab=160, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_output_is_the_same_alone_or_in_a_batch_of_16(llama_dir, params):
    engine = Engine(llama_dir, pool_bytes=4 << 20)
    target = random_prompts(1, seed=99)[0]
    alone = engine.generate([target], params)[0]
    others = random_prompts(15)
    mixed_params = [params] + [SamplingParams(max_tokens=n, temperature=t, seed=s, ignore_eos=True)
                               for n, t, s in zip(range(5, 35, 2), [0.0, 0.7, 1.3] * 5, range(15))]
    batch = engine.generate([target] + others, mixed_params)
    assert batch[0].token_ids == alone.token_ids
    assert len(alone.token_ids) == 24
    engine.reset_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_pages


def test_seeded_sampling_is_reproducible_and_seed_dependent(llama_dir):
    engine = Engine(llama_dir, pool_bytes=4 << 20)
    prompt = random_prompts(1)[0]
    a, b = engine.generate([prompt, prompt], [SEEDED, SEEDED])
    c = engine.generate([prompt], SamplingParams(**{**SEEDED.__dict__, "seed": 4321}))[0]
    assert a.token_ids == b.token_ids
    assert c.token_ids != a.token_ids


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_preempted_requests_finish_with_the_same_output(llama_dir, params):
    prompts = random_prompts(12, lo=20, hi=40)
    roomy = Engine(llama_dir, pool_bytes=4 << 20)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    assert roomy.stats()["num_preemptions"] == 0
    # 20 pages of 16 tokens cannot hold 12 sequences of ~55 tokens: the engine must preempt
    page_bytes = roomy.pool.page_bytes
    tight = Engine(llama_dir, pool_bytes=20 * page_bytes)
    got = [o.token_ids for o in tight.generate(prompts, params)]
    assert tight.stats()["num_preemptions"] > 0
    assert got == expected
    tight.reset_prefix_cache()
    assert tight.pool.num_free == tight.pool.num_pages


def test_abort_frees_pages_at_any_time(llama_dir):
    engine = Engine(llama_dir, pool_bytes=4 << 20)
    ids = [engine.add_request(p, GREEDY) for p in random_prompts(6)]
    engine.abort(ids[0])  # still waiting
    engine.step()
    engine.step()
    assert engine.pool.num_kv > 0
    engine.abort(ids[1])  # running
    finished = {}
    for outs in stepping(engine):
        for out in outs:
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == set(ids[2:])
    engine.reset_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_pages
    assert engine.stats()["num_requests_aborted"] == 2
    with pytest.raises(RequestNotFoundError, match="req-0"):
        engine.abort(ids[0])


def test_streaming_form_yields_one_token_per_step_per_running_request(llama_dir):
    engine = Engine(llama_dir, pool_bytes=4 << 20)
    rid = engine.add_request(random_prompts(1)[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    seen = []
    for outs in stepping(engine):
        for out in outs:
            assert out.request_id == rid
            seen.extend(out.new_token_ids)
            last = out
    assert last.finished and last.finish_reason == "length"
    assert seen == last.token_ids and len(seen) == 5


def test_per_request_max_tokens_and_stop_token_ids(llama_dir):
    engine = Engine(llama_dir, pool_bytes=4 << 20)
    prompt = random_prompts(1)[0]
    free_run = engine.generate([prompt], GREEDY)[0].token_ids
    stop_at = free_run[5]
    first = free_run.index(stop_at)
    outs = engine.generate([prompt, prompt], [
        SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stop_at])])
    assert outs[0].token_ids == free_run[:3] and outs[0].finish_reason == "length"
    assert outs[1].token_ids == free_run[:first + 1] and outs[1].finish_reason == "stop"


def test_eos_ends_a_request_unless_ignored(llama_dir):
    engine = Engine(llama_dir, pool_bytes=4 << 20)
    prompt = random_prompts(1)[0]
    free_run = engine.generate([prompt], GREEDY)[0].token_ids
    engine.outputs.eos_token_ids = frozenset({free_run[2]})
    out = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    assert out.token_ids == free_run[:free_run.index(free_run[2]) + 1] and out.finish_reason == "stop"
    assert engine.generate([prompt], GREEDY)[0].token_ids == free_run


def test_logprobs_report_the_chosen_token_and_the_top_n(llama_dir):
    engine = Engine(llama_dir, pool_bytes=4 << 20)
    out = engine.generate([random_prompts(1)[0]],
                          SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) == 3  # greedy: the chosen token is the top one
        assert max(lp.values()) == lp[tok] <= 0.0
        probs = torch.tensor(list(lp.values())).exp()
        assert probs.sum() <= 1.0 + 1e-5


def test_context_limit_ends_generation_with_length(llama_dir):
    engine = Engine(llama_dir, pool_bytes=4 << 20, max_model_len=40)
    out = engine.generate([list(range(3, 33))], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_stats_report_pages_by_owner_and_queues(llama_dir):
    engine = Engine(llama_dir, pool_bytes=4 << 20)
    for p in random_prompts(3):
        engine.add_request(p, GREEDY)
    assert engine.stats()["num_waiting"] == 3
    engine.step()
    stats = engine.stats()
    assert stats["num_running"] == 3 and stats["num_waiting"] == 0
    pool = stats["pool"]
    assert pool["kv_pages"] > 0
    assert pool["free_pages"] + pool["kv_pages"] + pool["adapter_pages"] == pool["total_pages"]
