"""The engine computes what `transformers` computes, for every supported family (fp32)."""

from __future__ import annotations

import pytest
import torch

from lorafleet import Engine, SamplingParams
from lorafleet.engine.request import Request
from lorafleet.engine.scheduler import Chunk
from tests.fixtures import FAMILIES, build_model, load_hf


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    folder = build_model(tmp_path_factory.mktemp(request.param), request.param)
    return folder, load_hf(folder)


def prompts_of_lengths(lengths, vocab=160, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def engine_prefill_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    req = Request("parity", ids, SamplingParams())
    engine.kv.grow(req.request_id, len(ids))
    try:
        return engine.runner.execute([Chunk(req, len(ids))], all_logits=True).cpu()
    finally:
        engine.kv.free(req.request_id)


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding with the reference model, no logits processors (EOS allowed)."""
    seq = torch.tensor([ids])
    with torch.no_grad():
        out = hf(seq, use_cache=True)
        for _ in range(n):
            nxt = out.logits[0, -1].argmax().view(1, 1)
            seq = torch.cat([seq, nxt], dim=1)
            out = hf(nxt, past_key_values=out.past_key_values, use_cache=True)
    return seq[0, len(ids):].tolist()


def test_prefill_logits_match_transformers(family_model):
    folder, hf = family_model
    engine = Engine(folder, pool_bytes=4 << 20)
    for ids in prompts_of_lengths([1, 7, 33, 70]):
        ours = engine_prefill_logits(engine, ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() <= 1e-4


def test_batched_greedy_tokens_match_transformers(family_model):
    folder, hf = family_model
    engine = Engine(folder, pool_bytes=4 << 20)
    prompts = prompts_of_lengths([3, 11, 26, 40, 64])
    outs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, ids, 32)
        assert out.finish_reason == "length"
    engine.reset_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_pages


def test_chunked_prefill_gives_the_same_tokens(family_model):
    folder, _ = family_model
    prompts = prompts_of_lengths([50, 75, 9])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    whole = Engine(folder, pool_bytes=4 << 20).generate(prompts, params)
    chunked = Engine(folder, pool_bytes=4 << 20, max_num_batched_tokens=16).generate(prompts, params)
    assert [o.token_ids for o in whole] == [o.token_ids for o in chunked]


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_load_and_match_transformers(tmp_path, stored):
    folder = build_model(tmp_path / "half", "llama", dtype=stored)
    hf = load_hf(folder)  # upcast to fp32, as lorafleet does on the CPU by default
    engine = Engine(folder, pool_bytes=4 << 20, dtype="float32")
    if Engine(folder, pool_bytes=1 << 20).device.type == "cpu":
        assert Engine(folder, pool_bytes=1 << 20).model.dtype == torch.float32  # the CPU default
    ids = prompts_of_lengths([20])[0]
    assert engine.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].token_ids \
        == hf_greedy(hf, ids, 16)
    half = Engine(folder, pool_bytes=4 << 20, dtype="bf16")
    assert half.pool.tensor.dtype == torch.bfloat16
    ours = engine_prefill_logits(half, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 0.1  # bf16 activations: close, not exact
