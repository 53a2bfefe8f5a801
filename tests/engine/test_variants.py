"""LoRA variants PEFT trains beside plain LoRA: DoRA (`use_dora`), `lora_bias` and rsLoRA, alone and
in one batch with plain adapters of other ranks and base requests: greedy tokens and logits as
PEFT computes them (fp32)."""

from __future__ import annotations

import pytest

from lorafleet import Engine, Mix, SamplingParams
from lorafleet.errors import InvalidRequestError
from tests.engine.fleet_parity import assert_one_batch_gives_peft_greedy_tokens, assert_one_prefill_gives_peft_logits
from tests.engine.test_parity import hf_greedy, prompts_of_lengths
from tests.fixtures import ALL7, build_adapter, build_model, load_peft, registered_fleet

VARIANTS = {
    "dora-r8": dict(r=8, lora_alpha=16, use_dora=True, target_modules=ALL7),
    "dora-attn-r4": dict(r=4, lora_alpha=4, use_dora=True, target_modules=["q_proj", "k_proj", "v_proj"]),
    "dora-rslora-r16": dict(r=16, lora_alpha=8, use_dora=True, use_rslora=True, target_modules=["o_proj", "down_proj"]),
    "bias-r6": dict(r=6, lora_alpha=12, lora_bias=True, target_modules=["q_proj", "v_proj", "up_proj"]),
    "plain-r24": dict(r=24, lora_alpha=16, target_modules=ALL7),
    "plain-r3": dict(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"]),
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # qwen2: q, k and v have a bias DoRA keeps
def fleet(request, tmp_path_factory):
    return registered_fleet(tmp_path_factory.mktemp(f"variants-{request.param}"), request.param, VARIANTS)


def test_every_variant_in_one_batch_gives_peft_greedy_tokens(fleet):
    assert_one_batch_gives_peft_greedy_tokens(fleet, VARIANTS, seed=11)


def test_every_variant_in_one_prefill_gives_peft_logits(fleet):
    assert_one_prefill_gives_peft_logits(fleet, VARIANTS, seed=12, changes=lambda name: name.startswith("dora"))


def test_dora_and_lora_bias_adapters_serve_alone_not_in_a_mix(fleet):
    _, _, engine = fleet
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=1), adapters=["dora-r8"])  # loaded: its kind is known
    with pytest.raises(InvalidRequestError, match="'dora-r8' uses DoRA, which serves alone"):
        engine.add_request([5, 6], SamplingParams(max_tokens=1), adapter=Mix.of({"dora-r8": 1.0, "plain-r3": 1.0}))
    with pytest.raises(InvalidRequestError, match="cannot be mixed or scaled"):
        engine.add_request([5, 6], SamplingParams(max_tokens=1), adapter=Mix.of({"dora-r8": 0.5}))
    # alone at scale 1, or at scale 0 beside others (it then contributes nothing), it serves
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    ways = ["dora-r8", Mix.of({"dora-r8": 1.0}), Mix.of({"dora-r8": 1.0, "plain-r3": 0.0}),
            Mix.of({"plain-r3": 1.0, "dora-r8": 0.0})]
    alone, mix_of_one, beside, off = engine.generate([[5, 6, 7]] * 4, params, adapters=ways)
    assert alone.logprobs == mix_of_one.logprobs == beside.logprobs
    # plain-r3 alone, in a batch of the same shape: a step of 4 rows against one of 1 may sum the
    # base's matmuls in another order (the kernels' tiles differ by rows: AMD's layout does)
    plain = engine.generate([[5, 6, 7]] * 4, params, adapters=[*ways[:3], "plain-r3"])[3]
    assert off.logprobs == plain.logprobs
    assert engine.adapters.get("dora-r8").users == 0
    kinds = {a["name"]: a["variant"] for a in engine.list_adapters()}
    assert kinds["dora-r8"] == "dora" and kinds["plain-r3"] == "lora"


def test_a_mix_naming_an_adapter_not_loaded_yet_fails_when_it_lands(tmp_path):
    base = build_model(tmp_path / "base", "llama")
    engine = Engine(base, pool_bytes=8 << 20, debug_checks=True)
    engine.register_adapter("bias", build_adapter(base, tmp_path / "bias", **VARIANTS["bias-r6"]))
    engine.register_adapter("plain", build_adapter(base, tmp_path / "plain", seed=1, **VARIANTS["plain-r3"]))
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4), adapter=Mix.of({"bias": 1.0, "plain": 0.5}))
    ends = []
    while engine.has_unfinished():
        ends += [o for o in engine.step() if o.request_id == rid and o.finished]
    assert ends[0].finish_reason == "error" and "'bias' uses lora_bias" in ends[0].error
    assert all(e["users"] == 0 for e in engine.list_adapters())


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_dora_on_a_quantized_base_takes_its_norms_from_the_dequantized_weights(tmp_path, scheme):
    from tests.engine.test_quantized import dequantized_

    base = build_model(tmp_path / "base", "qwen2")
    dora = build_adapter(base, tmp_path / "dora", **VARIANTS["dora-r8"])
    engine = Engine(base, pool_bytes=8 << 20, quantize=scheme)
    prompt = prompts_of_lengths([9], seed=13)[0]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine.register_adapter("dora", dora)
    out = engine.generate([prompt], params, adapters=["dora"])[0]
    # PEFT computes DoRA's norms from the base it wraps: here the dequantized one, as lorafleet serves
    assert out.token_ids == hf_greedy(dequantized_(load_peft(base, dora), scheme), prompt, 16)
