"""Parity of a registered fleet (`tests.fixtures.registered_fleet`) with PEFT, adapter by adapter,
all in one batch with a base request: greedy tokens through `generate`, and every row's logits of
one prefill step (fp32). test_variants and test_heads share them."""

from __future__ import annotations

import torch

from lorafleet import SamplingParams
from lorafleet.engine.request import Request
from lorafleet.engine.scheduler import Chunk
from tests.engine.test_parity import hf_greedy, prompts_of_lengths
from tests.fixtures import load_hf, load_peft


def prefill_logits(engine, reqs: list[Request]) -> tuple[list[Chunk], torch.Tensor]:
    """One prefill step of `reqs` whole, in the runner's order: its chunks and every row's logits
    (on the host), the requests' KV freed after."""
    chunks = engine.runner.order([Chunk(r, len(r.prompt_token_ids)) for r in reqs])
    for c in chunks:
        engine.kv.grow(c.request.request_id, c.num_tokens)
    try:
        return chunks, engine.runner.execute(chunks, engine.runner.lora_batch(chunks), all_logits=True).cpu()
    finally:
        for r in reqs:
            engine.kv.free(r.request_id)


def assert_one_batch_gives_peft_greedy_tokens(fleet, names, seed: int) -> None:
    base, adapters, engine = fleet
    order = [*names, None]
    prompts = prompts_of_lengths([5 + 2 * i for i in range(len(order))], seed=seed)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params, adapters=order)
    plain = load_hf(base)
    for name, prompt, out in zip(order, prompts, outs):
        ref_model = load_peft(base, adapters[name]) if name else plain
        assert out.token_ids == hf_greedy(ref_model, prompt, 24), f"adapter {name}"


def assert_one_prefill_gives_peft_logits(fleet, names, seed: int, changes=lambda name: True) -> None:
    """Each row within 1e-4 of PEFT's logits; an adapter for which `changes(name)` holds must also
    move them from the base's (by more than 1e-3: it is really applied)."""
    base, adapters, engine = fleet
    for name in names:
        engine.load_adapter(name, adapters[name])
    order = [*names, None]
    prompts = prompts_of_lengths([4 + 3 * i for i in range(len(order))], seed=seed)
    reqs = [Request(f"p{i}", p, SamplingParams(), a, loras=(engine.adapters.get(a),) if a else (),
                    scales=(1.0,) if a else ()) for i, (p, a) in enumerate(zip(prompts, order))]
    chunks, logits = prefill_logits(engine, reqs)
    row, plain = 0, load_hf(base)
    for c in chunks:
        ours = logits[row:row + c.num_tokens]
        row += c.num_tokens
        name = c.request.adapter
        with torch.no_grad():
            model = load_peft(base, adapters[name]) if name else plain
            ref = model(torch.tensor([c.request.prompt_token_ids])).logits[0]
            base_ref = plain(torch.tensor([c.request.prompt_token_ids])).logits[0]
        assert (ours - ref).abs().max().item() <= 1e-4, f"adapter {name}"
        if name and changes(name):
            assert (ours - base_ref).abs().max() > 1e-3, f"adapter {name} changes nothing"


# `--lora-dtype`: adapters held in 16 bits under an fp32 model. The stated tolerance (docs/engine.md):
# each row's logits within HELD_TOL of the adapter's own effect (PEFT's logits less the base's, at
# their largest) of PEFT's fp32 logits, plus 1e-4. Rounding A and scale * B^T to bf16 moves each
# weight by at most 2^-9 of itself, fp16 by 2^-12: the bound leaves each about 5x room on these models.
HELD_TOL = {"bfloat16": 2 ** -5, "float16": 2 ** -8}


def assert_held_prefill_within_tolerance(base, adapters: dict, held: str, seed: int = 7):
    """An engine on `base` holding `adapters` in `held`: one prefill of every adapter interleaved
    with base requests, each row within HELD_TOL of PEFT's fp32 logits. Returns the engine."""
    from lorafleet import Engine

    engine = Engine(base, pool_bytes=8 << 20, lora_dtype=held, debug_checks=True)
    assert engine.pool.adapter_dtype == getattr(torch, held) and engine.pool.tensor.dtype == torch.float32
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    order = [a for name in adapters for a in (name, None)]
    prompts = prompts_of_lengths([5 + 3 * i for i in range(len(order))], seed=seed)
    reqs = [Request(f"h{i}", p, SamplingParams(), a, loras=(engine.adapters.get(a),) if a else (),
                    scales=(1.0,) if a else ()) for i, (p, a) in enumerate(zip(prompts, order))]
    chunks, logits = prefill_logits(engine, reqs)
    row, plain, worst = 0, load_hf(base), 0.0
    for c in chunks:
        ours = logits[row:row + c.num_tokens]
        row += c.num_tokens
        ids = torch.tensor([c.request.prompt_token_ids])
        with torch.no_grad():
            base_ref = plain(ids).logits[0]
            ref = load_peft(base, adapters[c.request.adapter])(ids).logits[0] if c.request.adapter else base_ref
        effect = (ref - base_ref).abs().max().item()
        diff = (ours - ref).abs().max().item()
        assert diff <= HELD_TOL[held] * effect + 1e-4, f"adapter {c.request.adapter}: {diff} against effect {effect}"
        worst = max(worst, diff / max(effect, 1e-9)) if c.request.adapter else worst
    assert worst > 0  # the weights really were rounded (a float32 copy would give PEFT's logits exactly)
    return engine
