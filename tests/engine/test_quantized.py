"""Quantized bases (issue 51): the engine on an int8 or int4 base computes what `transformers`
(and PEFT, for adapters) compute on the same base dequantized, for every family, in one batch
that mixes adapters of different ranks; what lorafleet stores with `pull --quantize` serves what
quantizing at load serves; the refusals name their problem."""

from __future__ import annotations

import json

import pytest
import torch

from lorafleet import Engine, SamplingParams
from lorafleet.errors import LorafleetError, ModelLoadError, StoreError
from lorafleet.model import quant
from lorafleet.model.loader import load_model, quantized_names
from lorafleet.store.pull import pull
from lorafleet.store.store import Store
from tests.engine.test_parity import hf_greedy, prompts_of_lengths
from tests.fixtures import ADAPTER_VARIANTS, FAMILIES, build_adapter, build_model, load_hf, load_peft

SCHEMES = ("int8", "int4")
ADAPTERS = ("attn-r3", "mlp-r24", "all-r8")


def dequantized_(model: torch.nn.Module, scheme: str) -> torch.nn.Module:
    """A transformers model (or a PEFT model around one) whose quantized weights are replaced, in
    place, by the values lorafleet serves: each quantized and dequantized (the oracle)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = quantized_names(_cfg(base))
    with torch.no_grad():
        for name, p in base.named_parameters():
            hf = name.replace("base_layer.", "")
            if hf in names or (hf == "lm_head.weight" and "model.embed_tokens.weight" in names):
                p.copy_(quant.dequantize(*quant.quantize(p.detach(), scheme)))
    return model


def _cfg(hf):
    from lorafleet.model.config import ModelConfig

    return ModelConfig.from_dict(hf.config.to_dict())


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"quant-{request.param}")
    base = build_model(root / "base", request.param)
    adapters = {name: build_adapter(base, root / name, seed=i, **ADAPTER_VARIANTS[name])
                for i, name in enumerate(ADAPTERS)}
    return base, adapters


@pytest.mark.parametrize("scheme", SCHEMES)
def test_greedy_tokens_equal_peft_on_the_dequantized_base_in_one_mixed_batch(family, scheme):
    base, adapters = family
    engine = Engine(base, pool_bytes=8 << 20, quantize=scheme)
    stats = engine.stats()
    assert (stats["quantization"], stats["dtype"]) == (scheme, "float32")
    assert stats["weight_bytes"] < Engine(base, pool_bytes=4 << 20).stats()["weight_bytes"]
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    order = [None, *adapters]
    prompts = prompts_of_lengths([4, 9, 17, 6], seed=3)
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                           adapters=order)
    plain = dequantized_(load_hf(base), scheme)
    for prompt, adapter, out in zip(prompts, order, outs):
        ref_model = dequantized_(load_peft(base, adapters[adapter]), scheme) if adapter else plain
        assert out.token_ids == hf_greedy(ref_model, prompt, 12), (scheme, adapter)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_prefill_logits_equal_the_dequantized_base(family, scheme):
    base, _ = family
    engine = Engine(base, pool_bytes=4 << 20, quantize=scheme)
    hf = dequantized_(load_hf(base), scheme)
    from tests.engine.test_parity import engine_prefill_logits

    for ids in prompts_of_lengths([1, 7, 33]):
        ours = engine_prefill_logits(engine, ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (ours - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_quantized_weights_are_codes_and_scales_of_the_stated_sizes(family, variant):
    base, _ = family
    full = load_model(base, kernels="torch")  # [N, K] as stored (the CPU kernels may pack them into panels)
    for scheme, bits in (("int8", 8), ("int4", 4)):
        m = load_model(base, quantize=scheme)
        for name in ("layers.0.qkv", "layers.1.down", "lm_head"):
            q, s = m.w[name], m.w[name + "_s"]
            n, k = full.w[name].shape
            assert quant.scheme_of(q) == scheme and s.dtype == torch.float16
            assert q.numel() * q.element_size() * 8 == n * k * bits
            assert quant.group_of(q, s) == (k if scheme == "int8" else quant.INT4_GROUP)
        assert m.w["norm"].dtype == torch.float32 and "norm_s" not in m.w


def test_the_quantizer_round_trips_within_half_a_step_and_int4_matches_q4_0():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=g)
    w[3] = 0.0  # an all-zero row: scale 0, codes that dequantize to 0
    q8, s8 = quant.quantize(w, "int8")
    err = (quant.dequantize(q8, s8) - w).abs()
    assert (err <= s8.float().repeat_interleave(256, 1) / 2 + 1e-6).all()
    q4, s4 = quant.quantize(w, "int4")
    deq = quant.dequantize(q4, s4)
    assert (deq[3] == 0).all()
    # Q4_0: the element of largest magnitude in each block of 32 is exactly -8 steps
    blocks, dblocks = w.view(48, -1, 32), deq.view(48, -1, 32)
    idx = blocks.abs().argmax(-1, keepdim=True)
    steps = dblocks.gather(-1, idx).squeeze(-1) / s4.float()
    assert torch.allclose(steps[s4 != 0], torch.full_like(steps[s4 != 0], -8.0))
    # the nibble order: byte i of a run of 32 holds element i (low) and i + 16 (high)
    c = quant.codes(q4)[0, :32].int() + 8
    assert (q4[0, :16].int() == c[:16] | (c[16:] << 4)).all()


def test_a_weight_whose_width_is_not_a_multiple_of_32_is_refused(tmp_path):
    base = build_model(tmp_path / "odd", "llama", hidden_size=48, intermediate_size=96, num_attention_heads=4,
                       num_key_value_heads=2)
    with pytest.raises(ModelLoadError, match="multiple of 32"):
        load_model(base, quantize="int4")


# -- the store --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_base(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-store")
    return build_model(root / "base", "llama3")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_pull_quantize_stores_the_scheme_and_serves_what_load_time_quantization_serves(llama_base, tmp_path,
                                                                                        scheme):
    store = Store(tmp_path / "store")
    m = pull(str(llama_base), name="q", base=True, quantize=scheme, store=store)
    assert m["quantization"] == scheme
    folder = store.folder(store.get("models", "q"))
    assert quant.stored_scheme(folder) == scheme
    assert store.get("models", "q")["quantization"] == scheme and store.check(deep=True) == []
    full = sum(p.stat().st_size for p in llama_base.glob("*.safetensors"))
    stored = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert stored < (0.45 if scheme == "int8" else 0.35) * full  # tiny: norms and headers weigh
    prompt = [[5, 6, 7, 8, 9, 10]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    served = Engine(folder, pool_bytes=4 << 20)
    at_load = Engine(llama_base, pool_bytes=4 << 20, quantize=scheme)
    assert served.model.quantization == scheme
    assert served.generate(prompt, params)[0].token_ids == at_load.generate(prompt, params)[0].token_ids
    for name, t in at_load.model.w.items():
        assert torch.equal(served.model.w[name], t), name
    # an adapter is checked against the base's shapes whatever its scheme
    adapter = build_adapter(llama_base, tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj"])
    assert pull(str(adapter), name="a", store=store)["base"]["name"] == "q"
    other = build_model(tmp_path / "other", "llama", hidden_size=96, intermediate_size=192)
    wrong = build_adapter(other, tmp_path / "wrong", r=4, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(LorafleetError, match="shape|hidden|size"):
        pull(str(wrong), name="wrong", store=store, for_model="q")


def test_a_quantized_base_is_not_served_in_another_scheme_nor_quantized_twice(llama_base, tmp_path):
    store = Store(tmp_path / "store")
    pull(str(llama_base), name="q8", base=True, quantize="int8", store=store)
    folder = store.folder(store.get("models", "q8"))
    with pytest.raises(ModelLoadError, match="stored in int8"):
        load_model(folder, quantize="int4")
    assert load_model(folder, quantize="int8").quantization == "int8"
    with pytest.raises(LorafleetError, match="already quantized"):
        pull(str(folder), name="again", base=True, quantize="int4", store=store)
    with pytest.raises(StoreError, match="for a base"):
        pull(str(llama_base), name="x", quantize="int8", store=store)
    with pytest.raises(StoreError, match="int8 or int4"):
        pull(str(llama_base), name="x", base=True, quantize="int3", store=store)


def test_a_quantized_file_whose_shapes_do_not_match_its_config_is_refused(llama_base, tmp_path):
    store = Store(tmp_path / "store")
    pull(str(llama_base), name="q4", base=True, quantize="int4", store=store)
    broken = tmp_path / "broken"
    broken.mkdir()
    folder = store.folder(store.get("models", "q4"))
    for f in folder.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((broken / "config.json").read_text())
    cfg["intermediate_size"] = 2 * cfg["intermediate_size"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="gate_proj.qweight.*do not fit|mlp"):
        load_model(broken)


# `quantized_prefill="bfloat16"`: the stated tolerance (man lorafleet-serve, docs/engine.md), the
# self-check's for a quantized bf16 model: every prefill logit within 2^-4 of the largest of the
# dequantized base's (these models reach about 2^-6), the largest difference above 2^-12 of it
# (the bf16 GEMM really ran), short prompts as in fp32
PREFILL_TOL = 2 ** -4


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_bf16_prefill_stays_within_its_stated_tolerance_of_the_dequantized_base(family, scheme):
    base, _ = family
    engine = Engine(base, pool_bytes=4 << 20, quantize=scheme, quantized_prefill="bfloat16", self_check=True)
    assert engine.model.prefill_bf16 and engine.self_check["max_abs_diff"] <= engine.self_check["tolerance"]
    fp32 = Engine(base, pool_bytes=4 << 20, quantize=scheme)
    hf = dequantized_(load_hf(base), scheme)
    from tests.engine.test_parity import engine_prefill_logits

    from lorafleet.kernels import quant_cpu

    rows = quant_cpu.max_rows(torch.bfloat16)  # past these, bf16: the bf16 kernels' rows of the variant in use
    long_enough = 0
    for ids in prompts_of_lengths([1, 7, 33, 70]):
        ours, theirs = engine_prefill_logits(engine, ids), engine_prefill_logits(fp32, ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        scale = max(1.0, ref.abs().max().item())
        diff = (ours - ref).abs().max().item()
        assert diff <= PREFILL_TOL * scale, (len(ids), diff)
        if len(ids) <= rows:  # rows the decode kernels take: fp32 as before
            assert torch.equal(ours, theirs)
        else:
            long_enough += 1
            assert not torch.equal(ours, theirs)
            assert diff > 2 ** -12 * scale
    assert long_enough >= 1


def test_bf16_prefill_runs_past_the_decode_kernels_rows_only(variant):
    # the wrapper on every CPU variant: at or below the bf16 kernels' rows, the fp32 kernel's
    # result bit for bit; above, the bf16 path's: x and the weights in bf16, the bias in fp32
    from lorafleet.kernels import backend, quant_cpu, reference

    kernels = backend.cpu_kernels(torch.float32, variant)
    project = backend.bf16_prefill(kernels)
    q, scales = quant.quantize(torch.randn(48, 96), "int4")
    bias = torch.randn(48)
    rows = quant_cpu.max_rows(torch.bfloat16)
    for t, offsets in ((1, None), (rows, None), (rows + 1, None), (3 * rows, None), (3 * rows, torch.randn(48, 3))):
        x = torch.randn(t, 96)
        got = project(x, q, bias, scales, offsets)
        if t <= rows:
            assert torch.equal(got, kernels.linear(x, q, bias, scales, offsets))
        else:  # a GGUF file's affine types' offsets too
            want = reference.linear(x.bfloat16(), q, None, scales, offsets).float() + bias
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-2)
            assert not torch.equal(got, kernels.linear(x, q, bias, scales, offsets))
