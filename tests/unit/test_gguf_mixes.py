"""A GGUF file whose weights mix llama.cpp's block types, a scheme per tensor (issue 63): each of
the types lorafleet reads on some weight, as llama-quantize's mixes put Q6_K on the output and
half of attn_v / ffn_down beside Q4_K. Q8_0 and Q4_0 are served byte for byte; the other types are
dequantized exactly and requantized to int8 in groups of 32, each value within half a step of its
group's int8 grid of the file's value. The oracle is transformers on the same weights: the file's
values (`gguf.quants.dequantize`), requantized as stated where the type is converted; greedy tokens
equal and logits within 1e-4; against the file's own values, no further off than Q8_0 of every weight."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from lorafleet import Engine, SamplingParams
from lorafleet.model import quant
from lorafleet.model import gguf_weights
from lorafleet.model.gguf import AFFINE, CONVERTED, REQUANTIZED, GGUFFile
from lorafleet.store.pull import pull
from lorafleet.store.store import Store
from tests.engine.test_parity import engine_prefill_logits, hf_greedy, prompts_of_lengths
from tests.fixtures import build_model
from tests.unit.test_gguf import dequantized_hf, write_gguf

Q = gguf.GGMLQuantizationType
# hidden and intermediate sizes multiples of 256: every K-quant's blocks fit a row
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2}
MIX = {  # by HF name: every block type once at least (the rest Q4_K, the file's main type)
    "model.layers.0.self_attn.q_proj.weight": Q.Q4_0, "model.layers.0.self_attn.k_proj.weight": Q.Q8_0,
    "model.layers.0.self_attn.v_proj.weight": Q.Q6_K, "model.layers.0.self_attn.o_proj.weight": Q.Q4_1,
    "model.layers.0.mlp.gate_proj.weight": Q.Q5_0, "model.layers.0.mlp.up_proj.weight": Q.Q5_1,
    "model.layers.0.mlp.down_proj.weight": Q.Q5_K, "model.layers.1.mlp.down_proj.weight": Q.Q6_K,
    "model.layers.1.self_attn.v_proj.weight": Q.Q3_K, "model.layers.1.self_attn.o_proj.weight": Q.Q2_K,
    "model.layers.1.mlp.gate_proj.weight": Q.Q4_0, "model.layers.1.mlp.up_proj.weight": Q.Q4_0,
    "lm_head.weight": Q.Q6_K, "model.embed_tokens.weight": Q.Q4_K,
}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-mix")
    folder = build_model(root / "hf", "llama", **SHAPE)
    return folder, write_gguf(folder, root / "mix.gguf", Q.Q4_K, types=MIX), root


def served_values(t) -> torch.Tensor:
    """What lorafleet serves for a weight's GGUF tensor `t`, in the file's row order, fp32: the
    affine types from their codes, scales and offsets; the others requantized to int8."""
    if t.type in AFFINE:
        q, s, o = gguf_weights.affine(t, *AFFINE[t.type])
        return quant.dequantize(q, s, torch.float32, offsets=o)
    if t.type in REQUANTIZED:
        return quant.dequantize(*gguf_weights.requantized(t, 32), torch.float32)
    return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.type))).reshape(t.shape).float()


def requantized_hf(folder, path, every: bool = False):
    """transformers on the file's values as lorafleet serves them (`every`: every weight's requantized
    to int8 in groups of 32, Q8_0's error on the whole model, the yardstick)."""
    hf = dequantized_hf(folder, path)
    f = GGUFFile(path)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            t = f.tensors.get(name)
            if t is None or p.dim() != 2:
                continue
            if every:
                q, s = quant.quantize(p.detach().float(), "int8", 32)
                p.copy_(quant.dequantize(q, s, torch.float32))
            elif t.type in REQUANTIZED or (t.type in AFFINE and name != "model.embed_tokens.weight"):
                p.copy_(f._unpermute(name, served_values(t)))
            elif t.type in AFFINE:  # an embedding with offsets: requantized (only `rows` reads it)
                p.copy_(quant.dequantize(*gguf_weights.requantized(t, 32), torch.float32))
    return hf


def test_each_converted_weight_is_within_its_bound_of_the_files_values(mixed):
    """Requantized: half an int8 step of its group; affine: the float16 rounding of its scale."""
    _, path, _ = mixed
    for t in GGUFFile(path).tensors.values():
        if t.type not in CONVERTED:
            continue
        want = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.type))).reshape(t.shape)
        got = served_values(t)
        if t.type in REQUANTIZED:
            bound = gguf_weights.requantized(t, 32)[1].float().repeat_interleave(32, dim=1) / 2 * (1 + 1e-3) + 1e-7
        else:
            bound = want.abs().view(t.shape[0], -1, 32).amax(-1).repeat_interleave(32, dim=1) * 2 ** -10 + 1e-7
        assert ((got - want).abs() <= bound).all(), t.gguf_name


def test_a_file_mixing_every_type_serves_transformers_greedy_tokens_on_its_weights(mixed):
    folder, path, _ = mixed
    engine = Engine(path, pool_bytes=4 << 20)
    w = engine.model.w
    assert engine.model.quantization == "mixed"
    assert w["layers.0.qkv"].dtype == torch.int8 and w["lm_head"].dtype == torch.int8  # Q4_0 fused with others: int8
    assert w["layers.1.gate_up"].dtype == torch.uint8  # both Q4_0: int4, byte for byte
    assert w["layers.1.qkv"].dtype == torch.int8 and "layers.1.qkv_o" in w  # Q4_K, Q4_K, Q3_K: int8, offsets
    assert w["layers.0.o"].dtype == torch.uint8 and "layers.0.o_o" in w  # Q4_1: int4 with offsets
    assert "layers.1.gate_up_o" not in w and "lm_head_o" not in w  # Q4_0; Q6_K requantized
    hf, exact, q8 = requantized_hf(folder, path), dequantized_hf(folder, path), requantized_hf(folder, path, True)
    for prompt in prompts_of_lengths([1, 9, 30], seed=7):
        ours = engine_prefill_logits(engine, prompt)
        with torch.no_grad():
            ref, raw, yard = (m(torch.tensor([prompt])).logits[0] for m in (hf, exact, q8))
        assert (ours - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
        # against the file's own values: no further off than Q8_0 of every weight would be
        assert (ours - raw).abs().max().item() <= 1.5 * (yard - raw).abs().max().item()
    prompts = prompts_of_lengths([4, 13], seed=8)
    outs = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 10)


def test_pull_stores_the_mix_and_names_it(mixed):
    _, path, root = mixed
    store = Store(root / "store")
    m = pull(str(path), base=True, store=store)
    assert m["quantization"] == "Q4_K_M" and quant.stored_scheme(store.folder(m)) == "mixed"
    prompts = prompts_of_lengths([6], seed=9)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert Engine(store.folder(m), pool_bytes=4 << 20).generate(prompts, params)[0].token_ids == \
        Engine(path, pool_bytes=4 << 20).generate(prompts, params)[0].token_ids


# -- llama.cpp's own mixes (heavy: its converter and llama-quantize) -----------------------------

@pytest.mark.heavy
@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q4_1"])
def test_llama_quantizes_mixes_serve_transformers_greedy_tokens_on_their_weights(tmp_path, mix):
    """convert_hf_to_gguf.py to f32, then llama-quantize to `mix` as a user runs it (no --pure: its
    own choice of type per tensor)."""
    import subprocess

    from lorafleet.bench import llamacpp_build as lb, llamacpp_convert as lc
    from tests.fixtures import build_model as build

    folder = build(tmp_path / "hf", "llama", **SHAPE)
    try:
        conv, binary = lb.converters(), lb.quantize_binary()
    except lb.LlamaCppUnavailable as e:
        pytest.skip(f"llama.cpp's tools: {e}")
    stage = lc._stage(folder, tmp_path / "stage")
    lc._convert([conv / "convert_hf_to_gguf.py", stage, "--outtype", "f32", "--outfile", tmp_path / "f32.gguf"],
                "converting")
    out = tmp_path / f"model-{mix}.gguf"
    subprocess.run([str(binary), str(tmp_path / "f32.gguf"), str(out), mix], check=True, capture_output=True)
    f = GGUFFile(out)
    assert f.file_type == mix
    engine = Engine(out, pool_bytes=4 << 20)
    hf, exact = requantized_hf(folder, out), dequantized_hf(folder, out)
    same = 0
    for prompt in prompts_of_lengths([3, 11, 20], seed=5):
        ours = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
        assert ours == hf_greedy(hf, prompt, 12)
        same += ours == hf_greedy(exact, prompt, 12)
    print(f"{mix}: greedy tokens equal to the file's exact values in {same} of 3 prompts")
