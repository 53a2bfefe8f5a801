"""One mixed batch, many adapters of different ranks and targets, plus requests without an
adapter: each request gets exactly what PEFT computes for its adapter alone (fp32)."""

from __future__ import annotations

import pytest
import torch

from lorafleet import Engine, SamplingParams
from lorafleet.engine.request import Request
from tests.engine.fleet_parity import HELD_TOL, assert_held_prefill_within_tolerance, prefill_logits
from tests.engine.test_parity import hf_greedy, prompts_of_lengths
from tests.fixtures import ADAPTER_VARIANTS, FAMILIES, build_adapter, build_model, load_hf, load_peft


@pytest.fixture(scope="module", params=FAMILIES)
def fleet(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"fleet-{request.param}")
    base = build_model(root / "base", request.param)
    adapters = {name: build_adapter(base, root / name, seed=i, **kw)
                for i, (name, kw) in enumerate(ADAPTER_VARIANTS.items())}
    engine = Engine(base, pool_bytes=8 << 20)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    return base, adapters, engine


def mixed_requests(adapters):
    """Adapters interleaved with no-adapter requests, prompts of different lengths."""
    names = list(adapters)
    order = [names[i // 2] if i % 2 == 0 else None for i in range(2 * len(names))]
    prompts = prompts_of_lengths([5 + 3 * i for i in range(len(order))], seed=7)
    return order, prompts


def test_mixed_batch_logits_match_peft_per_adapter(fleet):
    base, adapters, engine = fleet
    order, prompts = mixed_requests(adapters)
    reqs = [Request(f"r{i}", p, SamplingParams(), a,
                        loras=(engine.adapters.get(a),) if a else (), scales=(1.0,) if a else ())
            for i, (p, a) in enumerate(zip(prompts, order))]
    chunks, logits = prefill_logits(engine, reqs)
    assert len({c.request.adapter for c in chunks}) == len(adapters) + 1
    row = 0
    plain = load_hf(base)
    for c in chunks:
        ours = logits[row:row + c.num_tokens]
        row += c.num_tokens
        ref_model = load_peft(base, adapters[c.request.adapter]) if c.request.adapter else plain
        with torch.no_grad():
            ref = ref_model(torch.tensor([c.request.prompt_token_ids])).logits[0]
        diff = (ours - ref).abs().max().item()
        assert diff <= 1e-4, f"adapter {c.request.adapter}: max abs diff {diff}"


def test_mixed_batch_greedy_tokens_match_peft_per_adapter(fleet):
    base, adapters, engine = fleet
    order, prompts = mixed_requests(adapters)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params, adapters=order)
    plain = load_hf(base)
    differs_from_base = 0
    for prompt, name, out in zip(prompts, order, outs):
        ref_model = load_peft(base, adapters[name]) if name else plain
        ref = hf_greedy(ref_model, prompt, 32)
        assert out.token_ids == ref, f"adapter {name}"
        if name is not None:
            differs_from_base += ref != hf_greedy(plain, prompt, 32)
    assert differs_from_base >= len(adapters) // 2  # the adapters really change the model
    assert all(r["users"] == 0 and not r["pinned"] for r in engine.list_adapters())


@pytest.mark.parametrize("held", HELD_TOL)
def test_adapters_held_in_16_bits_stay_within_their_stated_tolerance_of_peft(fleet, held):
    base, adapters, fp32 = fleet
    engine = assert_held_prefill_within_tolerance(base, adapters, held)
    for name in adapters:  # the same adapter in about half the pages (the row tables' int64 words: the same bytes)
        ours, theirs = (e.adapters.pages_needed(e.adapters.get(name)) for e in (engine, fp32))
        assert ours <= theirs // 2 + 2, (name, ours, theirs)


def test_held_adapters_decode_as_the_torch_reference_reads_them(fleet):
    # the decode steps (the CPU's one-call decode driver) read the bf16 rows as the reference does
    base, adapters, _ = fleet
    names = [*list(adapters)[:4], None]
    prompts = prompts_of_lengths([4 + 3 * i for i in range(len(names))], seed=5)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = []
    for kernels in ("cpu", "torch"):
        engine = Engine(base, pool_bytes=8 << 20, lora_dtype="bfloat16", kernels=kernels)
        for name in names[:-1]:
            engine.load_adapter(name, adapters[name])
        outs.append([o.token_ids for o in engine.generate(prompts, params, adapters=names)])
    assert outs[0] == outs[1]
