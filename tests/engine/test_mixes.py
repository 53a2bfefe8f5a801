"""Mixes: one request on several adapters, each with its scale, batched with every other request.
A mix equals PEFT's `add_weighted_adapter(..., combination_type="cat")` on the same adapters and
weights (whose delta is exactly the weighted sum); bad mixes fail only themselves."""

from __future__ import annotations

import math

import pytest
import torch

from lorafleet import Engine, SamplingParams
from lorafleet.engine.policy import VTC, W_OUTPUT, charge
from lorafleet.engine.request import Request
from lorafleet.errors import AdapterNotFoundError, InvalidRequestError
from lorafleet.adapters.mix import MAX_ADAPTERS, Mix
from tests.engine.test_parity import hf_greedy, prompts_of_lengths
from tests.fixtures import ADAPTER_VARIANTS, build_adapter, build_model, load_hf, registered_fleet

# What PEFT's cat can merge: list-typed target_modules (it refuses to combine list- and
# string-typed ones), no rsLoRA (the merged adapter would take the first one's scaling rule), no
# rank patterns (it sums the configs' ranks) and no layers_to_transform (the merged adapter would
# take the first one's layers)
CAT_ABLE = {"attn-r3": ADAPTER_VARIANTS["attn-r3"], "mlp-r24": ADAPTER_VARIANTS["mlp-r24"],
            "down-r1": ADAPTER_VARIANTS["down-r1"],
            "qko-up-r6": dict(r=6, lora_alpha=12, target_modules=["q_proj", "k_proj", "o_proj", "up_proj"])}
MIXES = [{"attn-r3": 1.0, "mlp-r24": 0.5}, {"qko-up-r6": -1.5, "down-r1": 2.0, "attn-r3": 0.3},
         {"mlp-r24": 4.0, "down-r1": -4.0}]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def fleet(request, tmp_path_factory):
    return registered_fleet(tmp_path_factory.mktemp(f"mix-{request.param}"), request.param, CAT_ABLE)


def peft_cat(base, adapters, mix: dict[str, float]):
    """PEFT with the mix's adapters merged by `add_weighted_adapter(combination_type="cat")`."""
    import peft

    names = list(mix)
    model = peft.PeftModel.from_pretrained(load_hf(base), adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.add_weighted_adapter(names, [mix[n] for n in names], "merged", combination_type="cat")
    model.set_adapter("merged")
    return model.eval()


def test_a_mix_answers_as_pefts_cat_merge_of_the_same_adapters_and_weights(fleet):
    base, adapters, engine = fleet
    prompts = prompts_of_lengths([6, 11, 17], seed=5)
    # every mix, each beside the others, a single adapter and the base, in one run
    order = [Mix.of(m) for m in MIXES] + ["mlp-r24", None]
    outs = engine.generate([prompts[i % 3] for i in range(len(order))], GREEDY, adapters=order)
    plain = load_hf(base)
    for i, (mix, out) in enumerate(zip(MIXES, outs)):
        ref = hf_greedy(peft_cat(base, adapters, mix), prompts[i % 3], GREEDY.max_tokens)
        assert out.token_ids == ref, f"mix {mix}"
        assert ref != hf_greedy(plain, prompts[i % 3], GREEDY.max_tokens)  # the mix changes the model
    assert all(r["users"] == 0 and not r["pinned"] for r in engine.list_adapters())


def test_pefts_cat_merge_is_exactly_the_weighted_sum_of_the_deltas(fleet):
    # what the parity above rests on: B_cat A_cat s_cat = sum_i w_i s_i B_i A_i, module by module
    import peft

    base, adapters, _ = fleet
    mix = MIXES[1]
    model = peft_cat(base, adapters, mix)
    checked = 0
    for _, module in model.named_modules():
        if not isinstance(module, peft.tuners.lora.LoraLayer) or "merged" not in module.lora_A:
            continue
        def delta(name):
            return (module.lora_B[name].weight.double() @ module.lora_A[name].weight.double()) * module.scaling[name]
        want = sum(w * delta(n) for n, w in mix.items() if n in module.lora_A)
        if isinstance(want, int):
            continue
        assert torch.allclose(delta("merged"), want, atol=1e-6)
        checked += 1
    assert checked >= 4


def test_a_mix_of_one_adapter_at_scale_one_is_that_adapter(fleet):
    _, _, engine = fleet
    prompt = prompts_of_lengths([9], seed=3)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    alone, mixed, half = engine.generate([prompt] * 3, params,
                                         adapters=["mlp-r24", Mix.of({"mlp-r24": 1.0}), Mix.of({"mlp-r24": 0.5})])
    assert mixed.token_ids == alone.token_ids and mixed.logprobs == alone.logprobs  # the same kernels' path
    assert half.logprobs != alone.logprobs  # the scale is applied


def test_a_partner_at_scale_zero_changes_nothing(fleet):
    _, _, engine = fleet
    prompt = prompts_of_lengths([12], seed=4)[0]
    alone, paired = engine.generate([prompt] * 2, GREEDY,
                                    adapters=["attn-r3", Mix.of({"attn-r3": 1.0, "mlp-r24": 0.0})])
    assert paired.token_ids == alone.token_ids


def test_a_mix_holds_and_pins_each_of_its_adapters_until_it_ends(fleet):
    _, _, engine = fleet
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4), adapter=Mix.of(MIXES[1]))
    entries = {n: engine.adapters.get(n) for n in MIXES[1]}
    assert all(e.users == 1 for e in entries.values())
    engine.step()
    engine.step()
    assert all(e.ready and e.pins == 1 for e in entries.values())  # all of them, admitted together
    while engine.has_unfinished():
        engine.step()
    assert all(e.users == 0 and e.pins == 0 for e in entries.values())
    mixes = engine.stats()["mixes"]
    assert mixes["requests"] >= 1 and mixes["by_size"].get("3", 0) >= 1 and mixes["running"] == 0
    assert rid not in engine.requests


def test_an_unknown_adapter_in_a_mix_refuses_the_request_and_holds_nothing(fleet):
    _, _, engine = fleet
    before = {e["name"]: e["users"] for e in engine.list_adapters()}
    with pytest.raises(AdapterNotFoundError, match="nope"):
        engine.add_request([5, 6], GREEDY, adapter=Mix.of({"attn-r3": 1.0, "nope": 1.0}))
    assert {e["name"]: e["users"] for e in engine.list_adapters()} == before


@pytest.mark.parametrize("pairs, problem", [
    ([], "at least one adapter"),
    ([(f"a{i}", 1.0) for i in range(MAX_ADAPTERS + 1)], f"at most {MAX_ADAPTERS}"),
    ([("a", 1.0), ("a", 0.5)], "appears twice"),
    ([("a", 4.5)], r"adapters\[0\].scale must be a finite number in \[-4, 4\]"),
    ([("a", math.nan)], "finite number"),
    ([("a", math.inf)], "finite number"),
    ([("a", True)], "finite number"),
    ([("a", "1")], "finite number"),
    ([("", 1.0)], r"adapters\[0\].name"),
])
def test_bad_mixes_are_refused_naming_the_field(pairs, problem):
    with pytest.raises(InvalidRequestError, match=problem) as e:
        Mix.of(pairs)
    assert e.value.param == "adapters"


def test_mixes_are_canonical_and_parse_from_json_and_the_command_line():
    a = Mix.of({"sql": 1.0, "formal": 0.5})
    assert a == Mix.of([("formal", 0.5), ("sql", 1)]) == Mix.from_json([{"name": "formal", "scale": 0.5},
                                                                          {"name": "sql"}])
    assert a == Mix.parse_option(["sql", "formal:0.5"]) and a.label == "formal*0.5+sql"
    assert Mix.parse_option(["v:2:1", "x:y"]).members == (("v:2", 1.0), ("x:y", 1.0))  # names with ':'
    with pytest.raises(InvalidRequestError, match=r"adapters\[1\] has unknown field\(s\) 'weight'"):
        Mix.from_json([{"name": "a"}, {"name": "b", "weight": 2}])
    with pytest.raises(InvalidRequestError, match="must be a list"):
        Mix.from_json({"name": "a"})


def test_a_mix_the_pool_cannot_hold_at_once_is_refused_with_the_sizes(tmp_path):
    base = build_model(tmp_path / "base", "llama")
    big = build_adapter(base, tmp_path / "big", r=64, lora_alpha=64, target_modules="all-linear")
    other = build_adapter(base, tmp_path / "other", seed=1, r=64, lora_alpha=64, target_modules="all-linear")
    probe = Engine(base, pool_bytes=2 << 20)
    probe.register_adapter("big", big)
    need = probe.adapters.pages_needed(probe.adapters.get("big"))
    engine = Engine(base, pool_bytes=(need * 3 // 2) * probe.pool.page_bytes)  # room for one, with its KV
    engine.register_adapter("big", big)
    engine.register_adapter("other", other)
    assert need * 2 > engine.pool.num_pages >= need  # each fits alone, not both
    with pytest.raises(InvalidRequestError, match=r"mix 'big\+other' need \d+ pages together \(big [\d.]+ MiB, "
                                                  r"other [\d.]+ MiB\)"):
        engine.add_request([5, 6], GREEDY, adapter=Mix.of({"big": 1.0, "other": 1.0}))
    assert engine.adapters.get("big").users == 0
    assert engine.generate([[5, 6]], GREEDY, adapters=["big"])[0].finish_reason == "length"  # alone it serves


def test_the_prefix_cache_never_shares_blocks_across_mixes_scales_or_their_adapters_alone(tmp_path):
    base = build_model(tmp_path / "base", "llama")
    engine = Engine(base, pool_bytes=8 << 20, block_size=4, debug_checks=True)
    for i, name in enumerate(["a", "b"]):
        engine.register_adapter(name, build_adapter(base, tmp_path / name, seed=i, r=4, lora_alpha=8,
                                                    target_modules=["q_proj", "v_proj"]))
    prompt = list(range(3, 40))
    one = SamplingParams(max_tokens=1)

    def cached(adapter) -> int:
        rid = engine.add_request(prompt, one, adapter=adapter)
        req = engine.requests[rid]
        while engine.has_unfinished():
            engine.step()
        return req.num_cached_tokens

    assert cached("a") == 0
    assert cached(Mix.of({"a": 1.0, "b": 0.5})) == 0       # not a's blocks
    assert cached(Mix.of({"a": 1.0, "b": 0.5})) > 0        # its own
    assert cached(Mix.of({"b": 0.5, "a": 1.0})) > 0        # the same mix, named in another order
    assert cached(Mix.of({"a": 1.0, "b": 0.25})) == 0      # another scale
    assert cached(Mix.of({"a": 1.0})) > 0                  # a mix of one at scale 1 is a


def test_vtc_charges_a_mix_once_split_among_its_adapters():
    policy = VTC()
    params = SamplingParams(max_tokens=10)
    mix = Request("m", [1] * 6, params, mix=Mix.of({"a": 1.0, "b": 0.5}))
    single = Request("s", [1] * 6, params, "a")
    for r in (mix, single):
        policy.on_arrival(r, {})
        policy.on_admit(r)
    c = charge(mix)
    assert policy.counters == pytest.approx({"a": c / 2 + c, "b": c / 2})
    # the mix's queue is ranked by the mean of its adapters' counters
    assert policy.pick({"a+b*0.5": mix, "a": single}) == "a+b*0.5"
    mix.first_scheduled_time = 0.0
    policy.on_finish(mix)  # nothing generated: each adapter refunded its half of the unused output
    assert policy.counters["b"] == pytest.approx(c / 2 - W_OUTPUT * 10 / 2)


def test_an_embedding_lora_saved_with_pefts_defaults_mixes_a_trained_copy_serves_alone(fleet, tmp_path):
    """PEFT saves the embedding and LM head whole beside LoRA on them (`save_embedding_layers`):
    copies equal to the base's are dropped at load, so the adapter mixes as any LoRA (before its
    load too: the mix waits for it to land), as PEFT's cat merge; a trained copy serves alone."""
    base, adapters, engine = fleet
    lora = build_adapter(base, tmp_path / "defaults", seed=7, r=4, lora_alpha=8,
                         target_modules=["q_proj", "embed_tokens", "lm_head"])
    trained = build_adapter(base, tmp_path / "trained", seed=8, r=2, lora_alpha=4, target_modules=["q_proj"],
                            modules_to_save=["lm_head"])
    engine.register_adapter("defaults", lora)
    engine.register_adapter("trained", trained)
    mix = {"defaults": 1.5, "attn-r3": 0.5}
    prompt = prompts_of_lengths([7], seed=31)[0]
    model = peft_cat(base, {**adapters, "defaults": lora}, mix)
    assert model.base_model.model.model.embed_tokens.lora_embedding_A["merged"].abs().sum() > 0  # cat merges it
    ref = hf_greedy(model, prompt, GREEDY.max_tokens)
    assert ref != engine.generate([prompt], GREEDY, adapters=[Mix.of({"attn-r3": 0.5})])[0].token_ids
    before = engine.generate([prompt], GREEDY, adapters=[Mix.of(mix)])[0]  # not loaded yet
    after = engine.generate([prompt], GREEDY, adapters=[Mix.of(mix)])[0]
    assert before.token_ids == after.token_ids == ref
    assert engine.adapters.get("defaults").info()["saved_modules"] == []  # its copies were dropped
    rid = engine.add_request(prompt, GREEDY, adapter=Mix.of({"trained": 1.0, "attn-r3": 0.5}))
    ends = []
    while engine.has_unfinished():
        ends += [o for o in engine.step() if o.request_id == rid and o.finished]
    assert ends[0].finish_reason == "error" and "'trained' uses its own lm_head (saved whole: modules_to_save" \
        in ends[0].error
    with pytest.raises(InvalidRequestError, match="'trained' uses its own lm_head .*modules_to_save.*serves alone"):
        engine.add_request(prompt, GREEDY, adapter=Mix.of({"trained": 1.0, "defaults": 0.5}))  # loaded: at once
    assert engine.adapters.get("trained").info()["saved_modules"] == ["lm_head"]
