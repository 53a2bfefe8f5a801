"""GGUF LoRA adapters (issue 63, `adapters/gguf.py`): a file as llama.cpp's
`convert_lora_to_gguf.py` writes it (written here with the `gguf` package as the converter does:
its Q/K row permutation of lora_b for llama, alpha in the metadata; in the heavy tier by the
converter itself) serves what the same adapter does as a PEFT folder, token for token and within
1e-4 in logits, from the engine, `pull` and the load route; other adapter kinds and tensors are
refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from lorafleet import Engine, SamplingParams
from lorafleet.engine import verify
from lorafleet.errors import AdapterError
from lorafleet.adapters import gguf as gguf_adapter
from lorafleet.store.pull import pull
from lorafleet.store.store import Store
from tests.engine.test_parity import prompts_of_lengths
from tests.fixtures import build_adapter, build_model, load_peft
from tests.unit.test_gguf import gguf_name, llamacpp_permute, write_gguf

Q = gguf.GGMLQuantizationType
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_gguf_adapter(peft_folder: Path, out: Path, arch: str, heads: tuple[int, int], qtype=Q.F32,
                       meta: dict | None = None, extra: dict | None = None, invocation: list | None = None) -> Path:
    """The PEFT adapter in `peft_folder` as convert_lora_to_gguf.py writes it (an aLoRA's
    invocation tokens from its config, or `invocation`)."""
    cfg = json.loads((peft_folder / "adapter_config.json").read_text())
    w = gguf.GGUFWriter(out, arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(cfg["lora_alpha"]))
    invocation = invocation if invocation is not None else cfg.get("alora_invocation_tokens")
    if invocation:
        w.add_key_value(gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS, invocation, gguf.GGUFValueType.ARRAY,
                        gguf.GGUFValueType.UINT32)
    for key, value in (meta or {}).items():
        w.add_string(key, value) if isinstance(value, str) else w.add_uint32(key, value)
    for name, t in sorted(load_file(peft_folder / "adapter_model.safetensors").items()):
        module, part = name.removeprefix("base_model.model.").split(".lora_")
        a = t.float().numpy()
        if arch == "llama" and part == "B.weight" and module.endswith(("q_proj", "k_proj")):
            a = llamacpp_permute(a, heads[0] if module.endswith("q_proj") else heads[1])
        gname = gguf_name(module + ".weight") + (".lora_a" if part == "A.weight" else ".lora_b")
        if qtype == Q.F32 or a.shape[-1] % 32:  # as the converter: rows too short for blocks stay float
            w.add_tensor(gname, a)
        else:
            w.add_tensor(gname, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def fleet(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"gguf-adapter-{request.param}")
    base = build_model(root / "base", request.param)
    cfg = json.loads((base / "config.json").read_text())
    heads = (cfg["num_attention_heads"], cfg["num_key_value_heads"])
    peft = build_adapter(base, root / "peft", r=8, lora_alpha=16, target_modules=TARGETS,
                         rank_pattern={"model.layers.1.mlp.down_proj": 4})
    arch = "llama" if request.param == "llama" else "qwen2"
    return base, peft, write_gguf_adapter(peft, root / "adapter.gguf", arch, heads), root, heads, arch


def test_a_gguf_adapter_serves_what_its_peft_folder_does(fleet, monkeypatch, tmp_path):
    base, peft, path, root, _, _ = fleet
    monkeypatch.setenv("LORAFLEET_HOME", str(tmp_path / "home"))
    engine = Engine(base, pool_bytes=8 << 20)
    engine.load_adapter("peft", peft)
    engine.load_adapter("gguf", path)
    folder = engine.adapter_path("gguf")
    assert folder.parent.name == gguf_adapter.CACHE and engine.adapter_folder(path) == folder  # converted once
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert cfg["rank_pattern"] == {"model.layers.1.mlp.down_proj": 4} and cfg["lora_alpha"] == 16
    peft_model = load_peft(base, peft)
    for prompt in prompts_of_lengths([3, 17], seed=11):
        ours = verify.prefill_logits(engine, prompt, "gguf")
        with torch.no_grad():
            ref = peft_model(torch.tensor([prompt])).logits[0]
        assert (ours - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = prompts_of_lengths([5, 9], seed=12)
    assert [o.token_ids for o in engine.generate(prompts, params, adapters=["gguf"] * 2)] == \
        [o.token_ids for o in engine.generate(prompts, params, adapters=["peft"] * 2)]


@pytest.mark.unit
def test_pull_stores_a_gguf_adapter_as_a_peft_folder(fleet, tmp_path):
    base, peft, path, _, _, _ = fleet
    store = Store(tmp_path / "store")
    pull(str(base), base=True, name="base", store=store)
    m = pull(str(path), name="tuned", store=store)
    assert m["base"]["name"] == "base" and m["ranks"] == pull(str(peft), name="same", store=store)["ranks"]
    assert m["format"] == "gguf" and m["source"] == str(path.resolve())
    ours, theirs = (load_file(store.folder(x) / "adapter_model.safetensors") for x in (m, store.get("adapters", "same")))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k].float()) for k in ours)


@pytest.mark.unit
def test_q8_0_adapter_tensors_are_dequantized(fleet, tmp_path):
    base, peft, _, root, heads, arch = fleet
    path = write_gguf_adapter(peft, tmp_path / "q8.gguf", arch, heads, qtype=Q.Q8_0)
    gguf_adapter.convert(path, tmp_path / "out", heads)
    got, want = load_file(tmp_path / "out" / "adapter_model.safetensors"), load_file(peft / "adapter_model.safetensors")
    for name, t in want.items():
        assert (got[name] - t.float()).abs().max() <= t.abs().max() / 100, name  # Q8_0's rounding


@pytest.mark.parametrize("change, words", [
    ({"meta": {"adapter.type": "control_vector"}}, "of type 'control_vector'"),
    ({"extra": {"token_embd.weight.lora_a": np.zeros((8, 4), np.float32)}}, "token_embd.weight.lora_a is not"),
    ({"extra": {"blk.0.attn_norm.weight": np.ones(4, np.float32)}}, "blk.0.attn_norm.weight is not"),
])
@pytest.mark.unit
def test_other_adapter_kinds_and_tensors_are_refused_by_name(fleet, tmp_path, change, words):
    base, peft, _, _, heads, arch = fleet
    path = write_gguf_adapter(peft, tmp_path / "odd.gguf", arch, heads, **change)
    with pytest.raises(AdapterError, match=words):
        gguf_adapter.convert(path, tmp_path / "out", heads)


def test_a_gguf_alora_serves_what_its_peft_folder_does(fleet, tmp_path):
    """`adapter.alora.invocation_tokens` (as llama.cpp's converter writes PEFT's field): the same
    greedy tokens as the PEFT aLoRA folder, and as PEFT's own generate; the sequence's bounds apply."""
    from tests.engine.test_alora import peft_greedy

    base, _, _, _, heads, arch = fleet
    inv = [7, 8, 9]
    peft = build_adapter(base, tmp_path / "alora", seed=3, r=4, lora_alpha=8, target_modules=TARGETS,
                         alora_invocation_tokens=inv)
    path = write_gguf_adapter(peft, tmp_path / "alora.gguf", arch, heads)
    engine = Engine(base, pool_bytes=8 << 20)
    engine.load_adapter("gguf", path)
    engine.load_adapter("peft", peft)
    assert engine.adapters.get("gguf").invocation == tuple(inv)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompt = [20, 21, 22, 23, 24, *inv, 30, 31]
    got = engine.generate([prompt, prompt], params, adapters=["gguf", "peft"])
    assert got[0].token_ids == got[1].token_ids == peft_greedy(load_peft(base, peft), prompt, 10)
    for bad, words in (([1] * 257, "holds 257 tokens; at most 256"), ([10 ** 6], "alora_invocation_tokens")):
        odd = write_gguf_adapter(peft, tmp_path / f"odd{len(bad)}.gguf", arch, heads, invocation=bad)
        with pytest.raises(AdapterError, match=words):
            engine.load_adapter(f"odd{len(bad)}", odd)


@pytest.mark.unit
def test_a_gguf_model_is_not_taken_for_an_adapter(fleet, tmp_path):
    base, *_ = fleet
    model = write_gguf(base, tmp_path / "model.gguf")
    assert not gguf_adapter.is_adapter(model)
    with pytest.raises(AdapterError, match="a GGUF model, not an adapter"):
        gguf_adapter.convert(model, tmp_path / "out", (4, 2))


@pytest.mark.heavy
@pytest.mark.parametrize("outtype,alora", [("f32", False), ("q8_0", False), ("f32", True)])
def test_llama_cpps_converter_writes_adapters_that_serve_as_their_peft_folder(tmp_path, monkeypatch, outtype, alora):
    """Plain, and an aLoRA (the converter writes adapter.alora.invocation_tokens from PEFT's field)."""
    from lorafleet.bench import llamacpp_build as lb, llamacpp_convert as lc

    monkeypatch.setenv("LORAFLEET_HOME", str(tmp_path / "home"))
    base = build_model(tmp_path / "base", "llama")
    inv = [7, 8, 9]
    peft = build_adapter(base, tmp_path / "peft", r=8, lora_alpha=16, target_modules=TARGETS,
                         **({"alora_invocation_tokens": inv} if alora else {}))
    try:
        conv = lb.converters()
    except lb.LlamaCppUnavailable as e:
        pytest.skip(f"llama.cpp's converters: {e}")
    stage = lc._stage(base, tmp_path / "stage")
    out = tmp_path / "adapter.gguf"
    lc._convert([conv / "convert_lora_to_gguf.py", "--base", stage, "--outtype", outtype, "--outfile", out, peft],
                "converting the adapter")
    engine = Engine(base, pool_bytes=8 << 20)
    engine.load_adapter("gguf", out)
    assert engine.adapters.get("gguf").invocation == (tuple(inv) if alora else None)
    peft_model = load_peft(base, peft)
    for prompt in prompts_of_lengths([4, 15], seed=13):
        prompt = prompt[:2] + inv + prompt[2:] if alora else prompt
        ours = verify.prefill_logits(engine, prompt, "gguf")
        with torch.no_grad():
            ref = peft_model(torch.tensor([prompt])).logits[0]
        tol = 1e-4 if outtype == "f32" else 2e-2  # Q8_0's rounding of A and B
        assert (ours - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def test_the_daemon_serves_gguf_adapters_from_the_command_line_and_the_load_route(fleet, tmp_path):
    from tests.daemons import Daemon

    base, peft, path, *_ = fleet
    daemon = Daemon.start(tmp_path / "d", "-a", f"cli={path}", "-a", f"peft={peft}", model=base)
    try:
        with daemon.http() as c:
            r = c.post("/v1/load_lora_adapter", json={"lora_name": "route", "lora_path": str(path)})
            assert r.status_code == 200, r.text
            bad = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(write_gguf(
                base, tmp_path / "model.gguf"))})
            assert bad.status_code == 400 and "a GGUF model, not an adapter" in bad.json()["error"]["message"]
            texts = {name: c.post("/v1/completions", json={"model": name, "prompt": [5, 6, 7, 8], "max_tokens": 8,
                                                           "temperature": 0, "ignore_eos": True}).json()
                     ["choices"][0]["text"] for name in ("cli", "route", "peft")}
        assert texts["cli"] == texts["route"] == texts["peft"]
    finally:
        daemon.kill()
