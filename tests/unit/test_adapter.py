"""lorafleet.adapters.adapter against adapters written by PEFT itself (tiny random Llama, built here)."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorafleet.errors import AdapterError, LorafleetError
from lorafleet.adapters import peft_config
from lorafleet.adapters.adapter import (
    MODULES,
    BaseShapes,
    LoraAdapter,
    load_adapter,
    read_adapter_config,
)
from lorafleet.adapters.weights_file import read_plan

pytestmark = pytest.mark.unit

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LLAMA = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, vocab_size=64, head_dim=8)
BLOCK = {m: ("self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp") for m in MODULES}
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

VARIANTS = {
    "attn_r3": dict(r=3, lora_alpha=6, target_modules=ATTN),
    "mlp_r24": dict(r=24, lora_alpha=16, target_modules=MLP),
    "all_linear": dict(r=4, lora_alpha=8, target_modules="all-linear"),
    "regex": dict(r=2, lora_alpha=4, target_modules=r".*\.layers\.1\.(self_attn\.(q|v)|mlp\.down)_proj"),
    "rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "patterns": dict(r=4, lora_alpha=8, target_modules=list(MODULES),
                     rank_pattern={"layers.0.self_attn.q_proj": 2, "down_proj": 6},
                     alpha_pattern={"v_proj": 3, r"layers\.1\.mlp\.up_proj": 20}),
    "layers_list": dict(r=2, lora_alpha=2, target_modules=["q_proj", "down_proj"],
                        layers_to_transform=[1], layers_pattern="layers"),
    "layers_int": dict(r=5, lora_alpha=7, target_modules=["k_proj", "up_proj"], layers_to_transform=0),
    "exclude": dict(r=2, lora_alpha=3, target_modules=list(MODULES), exclude_modules=["k_proj", "mlp.up_proj"]),
    "exclude_regex": dict(r=2, lora_alpha=3, target_modules=ATTN, exclude_modules=r".*layers\.0\..*"),
}


# ---------------------------------------------------------------------------------------------
# Building adapters with PEFT
# ---------------------------------------------------------------------------------------------


def make_base_model(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**LLAMA)
    return transformers.LlamaForCausalLM(cfg).eval()


def base_shapes_of(model) -> BaseShapes:
    layers = model.model.layers
    features = {m: (getattr(getattr(layers[0], BLOCK[m]), m).in_features,
                    getattr(getattr(layers[0], BLOCK[m]), m).out_features) for m in MODULES}
    return BaseShapes(num_layers=len(layers), features=features)


def lora_modules(peft_model) -> dict[tuple[int, str], torch.nn.Module]:
    out = {}
    for i, layer in enumerate(peft_model.base_model.model.model.layers):
        for m in MODULES:
            mod = getattr(getattr(layer, BLOCK[m]), m)
            if hasattr(mod, "lora_A") and "default" in mod.lora_A:
                out[(i, m)] = mod
    return out


def make_peft(seed: int, **lora_kwargs):
    model = make_base_model()
    pm = peft.get_peft_model(model, peft.LoraConfig(**lora_kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in lora_modules(pm).values():  # PEFT starts B at zero: make every delta non-trivial
            for p in (mod.lora_A["default"].weight, mod.lora_B["default"].weight):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return pm.eval()


@pytest.fixture(scope="module")
def base() -> BaseShapes:
    return base_shapes_of(make_base_model())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """variant name -> (folder, peft model); built once per module, lazily."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            pm = make_peft(len(cache) + 1, **VARIANTS[name])
            folder = tmp_path_factory.mktemp(name)
            pm.save_pretrained(str(folder))
            cache[name] = (folder, pm)
        return cache[name]

    return get


@pytest.fixture
def good(saved, tmp_path) -> Path:
    """A private copy of the rank-3 attention adapter, free to break."""
    folder = tmp_path / "adapter"
    shutil.copytree(saved("attn_r3")[0], folder)
    return folder


def edit_config(folder: Path, **changes) -> None:
    p = folder / "adapter_config.json"
    cfg = json.loads(p.read_text())
    cfg.update(changes)
    p.write_text(json.dumps(cfg))


def edit_tensors(folder: Path, fn) -> None:
    p = folder / "adapter_model.safetensors"
    tensors = load_file(str(p))
    fn(tensors)
    save_file(tensors, str(p), metadata={"format": "pt"})


def refused(folder, base, *needles, **kw) -> str:
    with pytest.raises(AdapterError) as ei:
        load_adapter(folder, base, **kw)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


KQ0 = "base_model.model.model.layers.0.self_attn.q_proj"


# ---------------------------------------------------------------------------------------------
# Loading agrees with PEFT
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_peft(variant, saved, base):
    folder, pm = saved(variant)
    ad = load_adapter(folder, base)
    assert isinstance(ad, LoraAdapter) and ad.path == Path(folder)
    ref = lora_modules(pm)
    assert ref, "PEFT targeted nothing: bad test variant"
    assert set(ad.weights) == set(ref)
    for key, mod in ref.items():
        w = ad.weights[key]
        a_ref, b_ref = mod.lora_A["default"].weight, mod.lora_B["default"].weight
        assert w.rank == a_ref.shape[0] == mod.r["default"]
        assert w.scale == pytest.approx(mod.scaling["default"], rel=1e-12)
        assert w.a.dtype == torch.float32 and w.a.is_contiguous() and w.b.is_contiguous()
        assert torch.equal(w.a, a_ref.detach()) and torch.equal(w.b, b_ref.detach())
    n = sum(m.lora_A["default"].weight.numel() + m.lora_B["default"].weight.numel() for m in ref.values())
    assert ad.num_params == n
    assert read_adapter_config(folder, base) == ad.config == json.loads((folder / "adapter_config.json").read_text())


def test_variant_details(saved, base):
    pat = load_adapter(saved("patterns")[0], base).weights
    assert pat[(0, "q_proj")].rank == 2 and pat[(1, "q_proj")].rank == 4
    assert pat[(0, "down_proj")].rank == 6 and pat[(0, "down_proj")].scale == 8 / 6
    assert pat[(0, "v_proj")].scale == 3 / 4 and pat[(1, "up_proj")].scale == 20 / 4
    assert pat[(0, "up_proj")].scale == 8 / 4
    rs = load_adapter(saved("rslora")[0], base).weights
    assert rs[(0, "q_proj")].scale == 8 / 2.0
    assert set(load_adapter(saved("layers_list")[0], base).weights) == {(1, "q_proj"), (1, "down_proj")}
    assert set(load_adapter(saved("regex")[0], base).weights) == {(1, "q_proj"), (1, "v_proj"), (1, "down_proj")}
    assert len(load_adapter(saved("all_linear")[0], base).weights) == 2 * len(MODULES)
    assert {w.rank for w in load_adapter(saved("mlp_r24")[0], base).weights.values()} == {24}


def test_delta_equals_peft_output(saved, base):
    folder, pm = saved("patterns")
    ad = load_adapter(folder, base)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for (layer, m), mod in lora_modules(pm).items():
            x = torch.randn(5, base.features[m][0], generator=gen)
            expected = mod(x) - mod.base_layer(x)
            w = ad.weights[(layer, m)]
            got = w.scale * (x @ w.a.T) @ w.b.T
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_dtype(saved, base):
    folder, pm = saved("attn_r3")
    ad = load_adapter(folder, base, dtype=torch.bfloat16)
    w = ad.weights[(0, "q_proj")]
    assert w.a.dtype == w.b.dtype == torch.bfloat16 and w.a.is_contiguous()
    ref = lora_modules(pm)[(0, "q_proj")].lora_A["default"].weight.detach()
    assert torch.equal(w.a, ref.to(torch.bfloat16))
    assert all(w.b.dtype == torch.bfloat16 for w in ad.weights.values())
    assert ad.digest == load_adapter(folder, base).digest  # the digest is of the files
    with pytest.raises(ValueError):
        load_adapter(folder, base, dtype=torch.int8)


def test_loaded_tensors_do_not_alias_the_file(good, base):
    ad = load_adapter(good, base)
    before = ad.weights[(0, "q_proj")].a.clone()
    edit_tensors(good, lambda t: t[KQ0 + ".lora_A.weight"].zero_())
    assert torch.equal(ad.weights[(0, "q_proj")].a, before)


def test_adapter_name_in_keys(good, base):
    ref = load_adapter(good, base)

    def rename(t):
        for k in list(t):
            t[k.replace(".weight", ".default.weight")] = t.pop(k)
    edit_tensors(good, rename)
    ad = load_adapter(good, base)
    assert set(ad.weights) == set(ref.weights)
    assert all(torch.equal(ad.weights[k].b, ref.weights[k].b) for k in ref.weights)


def test_fan_in_fan_out_is_ignored_for_linear(good, base):
    # PEFT keeps lora_A/B in nn.Linear layout whatever the flag (it concerns Conv1D bases) and resets
    # it to False for a Llama; a hand-edited true changes nothing.
    ref = load_adapter(good, base)
    edit_config(good, fan_in_fan_out=True)
    ad = load_adapter(good, base)
    assert all(torch.equal(ad.weights[k].a, ref.weights[k].a) for k in ref.weights)


def test_base_shapes_from_model_config(base):
    from lorafleet.model.config import ModelConfig

    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
                                 "num_key_value_heads": 2, "rms_norm_eps": 1e-5, **LLAMA})
    assert BaseShapes.from_model_config(cfg) == BaseShapes(base.num_layers, base.features, cfg.vocab_size,
                                                           cfg.hidden_size)


# Our matching helpers against PEFT's own, on every projection name of the base.
MATCH_CASES = [
    dict(target_modules=["q_proj", "mlp.down_proj"]),
    dict(target_modules=["model.layers.1.self_attn.q_proj", "v_proj"]),
    dict(target_modules=["q_proj", "model.layers.0.self_attn.k_proj", "k_proj"], layers_to_transform=[1]),
    dict(target_modules=["q_proj", "up_proj"], layers_to_transform=1, layers_pattern=["h", "layers"]),
    dict(target_modules=["q_proj"], layers_to_transform=[0], layers_pattern="h"),
    dict(target_modules=["q_proj"], layers_to_transform=[]),
    dict(target_modules=r".*(q|k)_proj", layers_to_transform=[1]),
    dict(target_modules=r"model\.layers\.0\.mlp\..*", exclude_modules=r".*gate_proj"),
    dict(target_modules=list(MODULES), exclude_modules=["self_attn.o_proj", "model.layers.1.mlp.up_proj"]),
]


@pytest.mark.parametrize("case", MATCH_CASES)
def test_target_matching_mirrors_peft(case, base):
    from peft.tuners.tuners_utils import check_target_module_exists

    from types import SimpleNamespace

    fields = dict(target_modules=None, exclude_modules=None, modules_to_save=None, target_parameters=None,
                  layers_to_transform=None, layers_pattern=None)
    cfg = SimpleNamespace(**{**fields, **case})  # LoraConfig itself refuses some combinations
    ours = dict(case)
    for name in base.module_names():
        match = peft_config.Matcher(Path("adapter_config.json"))
        assert bool(peft_config._is_target(ours, name, match)) == bool(check_target_module_exists(cfg, name)), name


def test_pattern_key_mirrors_peft(base):
    from peft.utils.other import get_pattern_key

    patterns = {"layers.0.self_attn.q_proj": 1, "proj": 2, r"layers\.1\..*_proj": 3, "q_proj": 4,
                "o_pro": 5, "mlp.up_proj": 6}
    for keys in (list(patterns), list(reversed(patterns)), ["q_proj", "o_pro"]):
        d = {k: patterns[k] for k in keys}
        for name in base.module_names():
            theirs = get_pattern_key(list(d), name)
            ours = peft_config.pattern_key(d, name, peft_config.Matcher(Path("adapter_config.json")))
            assert (ours if ours is not None else name) == theirs, (keys, name)


# ---------------------------------------------------------------------------------------------
# Refusals: config
# ---------------------------------------------------------------------------------------------

CONFIG_REFUSALS = [
    ({"peft_type": "LOHA"}, "peft_type"),
    ({"use_dora": True, "lora_bias": True}, "DoRA with lora_bias is not supported"),
    ({"bias": "all"}, "bias"),
    ({"bias": "lora_only"}, "bias"),
    ({"modules_to_save": ["score"]}, "modules_to_save: an entry names no module the base has"),
    ({"modules_to_save": "lm_head"}, "modules_to_save"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
    ({"target_modules": ["lm_head"]}, "'lm_head', which this base does not offer"),
    ({"target_modules": ["q_proj", "no_such_proj"]}, "target_modules has an entry"),
    ({"target_modules": ["model.layers.7.self_attn.q_proj"]}, "target_modules has an entry"),
    ({"target_modules": r".*nothing.*"}, "target_modules"),
    ({"target_modules": r".*(q_proj|lm_head)"}, "lm_head"),
    ({"target_modules": r".*(q_proj|embed_tokens)"}, "embed_tokens"),
    ({"target_modules": "(unclosed"}, "target_modules"),
    ({"target_modules": None}, "target_modules"),
    ({"target_modules": []}, "target_modules"),
    ({"layers_to_transform": [5]}, "target_modules"),
    ({"layers_to_transform": "0"}, "layers_to_transform"),
    ({"r": 0}, ": r: "),
    ({"r": -3}, ": r: "),
    ({"r": 3.0}, ": r: "),
    ({"r": True}, ": r: "),
    ({"rank_pattern": {"q_proj": 0}}, "rank_pattern"),
    ({"rank_pattern": {"(bad": 2}}, "rank_pattern"),
    ({"alpha_pattern": {"q_proj": "x"}}, "alpha_pattern"),
    ({"lora_alpha": "6"}, "lora_alpha"),
    ({"use_rslora": "yes"}, "use_rslora"),
    ({"layer_replication": [[0, 2], [0, 2]]}, "layer_replication"),
    ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters"),
    ({"use_qalora": True}, "use_qalora"),
    ({"lora_bias": 1}, "lora_bias: must be true or false"),
    ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
    ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
    ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights"),
]


@pytest.mark.parametrize("changes,needle", CONFIG_REFUSALS, ids=[str(c) for c, _ in CONFIG_REFUSALS])
def test_config_refusals(good, base, changes, needle):
    edit_config(good, **changes)
    msg = refused(good, base, needle)
    assert "adapter_config.json" in msg
    with pytest.raises(AdapterError):
        read_adapter_config(good, base)


def test_peft_type_missing(good, base):
    cfg = json.loads((good / "adapter_config.json").read_text())
    del cfg["peft_type"]
    (good / "adapter_config.json").write_text(json.dumps(cfg))
    refused(good, base, "peft_type")


def test_config_rank_disagrees_with_tensors(good, base):
    edit_config(good, r=4)
    refused(good, base, KQ0 + ".lora_A.weight", "adapter_config.json's r")


def test_rank_pattern_disagrees_with_tensors(good, base):
    edit_config(good, rank_pattern={"v_proj": 5})
    refused(good, base, "v_proj.lora_A.weight", "rank_pattern entry matching 'model.layers.0.self_attn.v_proj'")


def test_tensor_for_untargeted_module(good, base):
    edit_config(good, target_modules=["q_proj", "v_proj"])
    refused(good, base, "k_proj.lora_A.weight", "does not target")


def test_targeted_module_without_tensors(good, base):
    edit_config(good, target_modules=ATTN + ["down_proj"])
    refused(good, base, "model.layers.0.mlp.down_proj", "no lora_A/lora_B")


def test_config_file_problems(good, base, tmp_path):
    p = good / "adapter_config.json"
    p.write_text("{not json")
    refused(good, base, "adapter_config.json", "not valid JSON")
    p.write_text("[1, 2]")
    refused(good, base, "adapter_config.json", "JSON object")
    p.write_text('{"peft_type": "LORA", "peft_type": "LORA"}')
    refused(good, base, "adapter_config.json", "duplicate key")
    p.write_bytes(b"\xff\xfe\x00")
    refused(good, base, "adapter_config.json")
    p.unlink()
    refused(good, base, "adapter_config.json", "missing")
    with pytest.raises(AdapterError, match="adapter_config.json"):
        read_adapter_config(good)


def test_hostile_json_is_refused_cleanly(good, base):
    # Each of these made json.loads raise something other than JSONDecodeError.
    p = good / "adapter_config.json"
    for text in ("[" * 100_000 + "]" * 100_000, '{"r": ' + "1" * 5000 + "}"):
        p.write_text(text)
        refused(good, base, "adapter_config.json", "not valid JSON")
    p.write_text(json.dumps({"peft_type": "LORA", "r": 3, "target_modules": "(" * 5000 + ")" * 5000}))
    refused(good, base, "target_modules", "regular expression")


# The caller of the daemon chooses the adapter path: refusals must not echo what the files hold.
SECRET = "TOPSECRET"
SECRET_CONFIGS = [
    ({"r": SECRET}, "r: must be a positive integer"),
    ({"lora_alpha": SECRET}, "lora_alpha: must be a finite number"),
    ({"peft_type": SECRET}, "peft_type"),
    ({"bias": SECRET}, "bias"),
    ({"use_rslora": SECRET}, "use_rslora"),
    ({"use_dora": SECRET}, "use_dora"),
    ({"modules_to_save": [SECRET]}, "modules_to_save"),
    ({"init_lora_weights": "pissa_" + SECRET}, "init_lora_weights"),
    ({"target_modules": [SECRET]}, "target_modules"),
    ({"target_modules": ["q_proj", 7, SECRET]}, "target_modules"),
    ({"target_modules": SECRET}, "target_modules"),
    ({"target_modules": SECRET + "("}, "target_modules: not a valid regular expression"),
    ({"exclude_modules": SECRET + "("}, "exclude_modules"),
    ({"rank_pattern": {SECRET + "(": 2}}, "rank_pattern"),
    ({"rank_pattern": {"q_proj": SECRET}}, "rank_pattern"),
    ({"rank_pattern": {SECRET: 2, "q_proj": 5}}, "rank_pattern"),
    ({"rank_pattern": SECRET}, "rank_pattern"),
    ({"alpha_pattern": {SECRET: SECRET}}, "alpha_pattern"),
    ({"layers_pattern": SECRET + "("}, "layers_pattern"),
    ({"layers_pattern": [SECRET, 3]}, "layers_pattern"),
    ({"layers_pattern": SECRET, "layers_to_transform": [0]}, "target_modules"),
    ({"layers_to_transform": SECRET}, "layers_to_transform"),
]


def secret_free(msg: str, *paths: Path) -> str:
    for path in paths:  # the caller's own path may be quoted
        msg = msg.replace(str(path), "<path>")
    assert SECRET not in msg, msg
    return msg


@pytest.mark.parametrize("changes,needle", SECRET_CONFIGS, ids=[",".join(c) for c, _ in SECRET_CONFIGS])
def test_config_refusals_name_the_field_not_its_value(good, base, changes, needle):
    edit_config(good, **changes)
    secret_free(refused(good, base, needle, "adapter_config.json"), good)
    try:
        read_adapter_config(good, base)  # does not see the tensors, so may accept some of these
    except AdapterError as e:
        secret_free(str(e), good)


@pytest.mark.parametrize("text,needle", [
    ('{"peft_type": "LORA", "TOPSECRET": 1, "TOPSECRET": 2}', "duplicate key in a JSON object"),
    ('{"rank_pattern": {"TOPSECRET": 1, "TOPSECRET": 2}}', "duplicate key in a JSON object"),
    ('{"r": 1, "r": 2}', "duplicate key 'r'"),  # a PEFT field name may be named
    ('{"TOPSECRET": ', "not valid JSON"),
    ('"TOPSECRET"', "not a JSON object"),
    ("TOPSECRET", "not valid JSON"),
    (b"TOPSECRET\xff", "not valid JSON"),
], ids=["dup-unknown", "dup-nested", "dup-field", "truncated", "string", "garbage", "not-utf8"])
def test_config_file_refusals_quote_nothing_from_it(good, base, text, needle):
    p = good / "adapter_config.json"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    secret_free(refused(good, base, "adapter_config.json", needle), good)


def test_tensor_refusals_quote_no_names_or_dtypes_from_the_file(good, base):
    edit_tensors(good, lambda t: t.__setitem__(SECRET, torch.ones(3)))
    secret_free(refused(good, base, "a tensor whose name is not a LoRA weight of a supported module",
                        "lora_A.weight"), good)

    def rename(t):  # an adapter name is text from the file too: left out, the key's structure named
        del t[SECRET]
        for k in list(t):
            t[k.replace(".weight", f".{SECRET}.weight")] = t.pop(k)
    edit_tensors(good, rename)
    edit_config(good, target_modules=["q_proj"])
    secret_free(refused(good, base, "k_proj.lora_A.<adapter name>.weight", "does not target"), good)

    p = good / "adapter_model.safetensors"
    for hdr, needle in [
        ({KQ0 + ".lora_A.weight": {"dtype": SECRET, "shape": [2], "data_offsets": [0, 8]}}, "unknown dtype"),
        ({KQ0 + ".lora_A.weight": {"dtype": [SECRET], "shape": [2], "data_offsets": [0, 8]}}, "unknown dtype"),
        ({SECRET: {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "byte range"),
        ({SECRET: SECRET}, "malformed header entry"),
        ({SECRET: {"dtype": "F32", "shape": [2], "data_offsets": [0, 80]}}, "past the end"),
    ]:
        raw = json.dumps(hdr).encode()
        p.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x00" * 8)
        secret_free(refused(good, base, "adapter_model.safetensors", needle), good)
        with pytest.raises(AdapterError) as ei:
            read_plan(good, base)
        secret_free(str(ei.value), good)
    raw = b'{"TOPSECRET": '
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x00" * 8)
    secret_free(refused(good, base, "malformed safetensors header"), good)


def test_tensor_shape_refusals_name_the_files_shape_beside_the_base_form(good, base):
    key = KQ0 + ".lora_A.weight"
    edit_tensors(good, lambda t: t.__setitem__(key, torch.ones((3, 77))))
    refused(good, base, key, "its shape is [3, 77], expected [r, 32]")
    edit_tensors(good, lambda t: t.__setitem__(key, torch.ones((3, 32, 77))))
    assert "77" not in refused(good, base, key, "2-D").replace(str(good), "")


def _unreadable_case(kind: str, good: Path, tmp_path: Path) -> Path:
    if kind == "missing folder":
        return tmp_path / "nope"
    if kind == "path is a file":
        (tmp_path / "file").write_text("{}")
        return tmp_path / "file"
    if kind == "NUL in path":
        return Path(f"{tmp_path}/a\0b")
    cfg = good / "adapter_config.json"
    if kind == "no config":
        cfg.unlink()
    elif kind == "config is a folder":
        cfg.unlink()
        cfg.mkdir()
    elif kind == "config is a dangling link":
        cfg.unlink()
        cfg.symlink_to(tmp_path / "gone")
    return good


def _unreadable_message(path: Path, base) -> str:
    with pytest.raises(AdapterError) as ei:
        load_adapter(path, base)
    with pytest.raises(AdapterError) as ei2:
        read_adapter_config(path, base)
    msg = str(ei.value)
    assert str(ei2.value) == msg
    for word in ("No such file", "Permission denied", "does not exist", "not a folder", "Errno"):
        assert word not in msg, msg
    return msg.replace(str(path), "<path>")


UNREADABLE = ["missing folder", "path is a file", "NUL in path", "no config", "config is a folder",
              "config is a dangling link"]


def test_missing_and_unreadable_adapters_get_one_message(good, base, tmp_path):
    messages = {}
    for kind in UNREADABLE:
        folder = tmp_path / kind.replace(" ", "_")
        shutil.copytree(good, folder)
        messages[kind] = _unreadable_message(_unreadable_case(kind, folder, tmp_path), base)
    assert len(set(messages.values())) == 1, messages
    assert messages["missing folder"] == ("<path>/adapter_config.json: missing or unreadable (an adapter "
                                          "is a folder holding adapter_config.json and adapter_model.safetensors)")
    assert issubclass(AdapterError, LorafleetError)


def test_an_unreadable_config_reads_as_missing(good, base, tmp_path, monkeypatch):
    cfg = good / "adapter_config.json"
    cfg.chmod(0)
    if os.access(cfg, os.R_OK):  # root reads through chmod 000: refuse the read the way the OS would
        def denied(path, *a, **k):
            raise PermissionError(13, "Permission denied", str(path))
        monkeypatch.setattr(peft_config, "open", denied, raising=False)
    try:
        assert _unreadable_message(good, base) == _unreadable_message(tmp_path / "nope", base)
    finally:
        cfg.chmod(0o644)


def test_missing_and_unreadable_weights_get_one_message(good, base):
    st = good / "adapter_model.safetensors"
    st.unlink()
    msg = refused(good, base, "adapter_model.safetensors: missing or unreadable")
    st.mkdir()
    assert refused(good, base) == msg
    with pytest.raises(AdapterError) as ei:
        read_plan(good, base)
    assert str(ei.value) == msg


class _Marker:
    """Unpickling this creates a file: proof that a pickle was loaded."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_bin_is_never_loaded(good, base, tmp_path, monkeypatch):
    marker = tmp_path / "UNPICKLED"
    (good / "adapter_model.safetensors").unlink()
    (good / "adapter_model.bin").write_bytes(pickle.dumps({"weights": _Marker(str(marker))}))

    def boom(*a, **k):
        raise AssertionError("a pickle loader was called")
    monkeypatch.setattr(torch, "load", boom)
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "loads", boom)
    refused(good, base, "adapter_model.bin", "pickle")
    with pytest.raises(AdapterError, match="adapter_model.bin"):
        read_adapter_config(good)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# Refusals: tensors
# ---------------------------------------------------------------------------------------------


def test_nan_and_inf(good, base, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(good, other)

    def nan(t):
        t[KQ0 + ".lora_A.weight"][1, 2] = float("nan")
    edit_tensors(good, nan)
    refused(good, base, KQ0 + ".lora_A.weight", "non-finite")

    def inf(t):
        t["base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"][0, 0] = float("-inf")
    edit_tensors(other, inf)
    refused(other, base, "layers.1.self_attn.o_proj.lora_B.weight", "non-finite")


def test_overflow_at_requested_dtype(good, base):
    edit_tensors(good, lambda t: t[KQ0 + ".lora_B.weight"].__setitem__((0, 0), 1e6))
    refused(good, base, KQ0 + ".lora_B.weight", "overflows", dtype=torch.float16)
    assert load_adapter(good, base, dtype=torch.bfloat16).weights[(0, "q_proj")].b[0, 0] > 9e5


@pytest.mark.parametrize("field,what", [("use_dora", "lora_magnitude_vector"), ("lora_bias", "lora_B bias")])
def test_a_config_switch_without_its_tensors(good, base, field, what):
    edit_config(good, **{field: True})
    read_adapter_config(good, base)  # the config alone is valid
    refused(good, base, f"no {what} for 'model.layers.0.self_attn.q_proj', which adapter_config.json's {field} asks")


def test_lora_a_has_no_bias(good, base):
    edit_config(good, lora_bias=True)
    edit_tensors(good, lambda t: t.__setitem__(KQ0 + ".lora_A.bias", torch.ones(3)))
    refused(good, base, "lora_A has no bias")


@pytest.mark.parametrize("suffix,field", [(".lora_magnitude_vector", "use_dora"), (".lora_B.bias", "lora_bias")])
def test_a_dora_or_bias_tensor_without_its_config_switch(good, base, suffix, field):
    edit_tensors(good, lambda t: t.__setitem__(KQ0 + suffix, torch.ones(32)))
    refused(good, base, suffix.lstrip("."), f"{field} is not true")


@pytest.mark.parametrize("suffix,field,shape", [(".lora_magnitude_vector", "use_dora", (31,)),
                                                (".lora_magnitude_vector", "use_dora", (32, 1)),
                                                (".lora_B.bias", "lora_bias", (33,))])
def test_a_dora_or_bias_vector_of_the_wrong_shape(good, base, suffix, field, shape):
    def put(t):
        for k in [k for k in t if k.endswith(".lora_A.weight")]:
            stem = k.removesuffix(".lora_A.weight")
            t[stem + suffix] = torch.ones(t[stem + ".lora_B.weight"].shape[0])
        t[KQ0 + suffix] = torch.ones(shape)
    edit_config(good, **{field: True})
    edit_tensors(good, put)
    refused(good, base, suffix.lstrip("."), "expected")


@pytest.mark.parametrize("key,shape", [
    ("base_model.model.model.layers.0.self_attn.rotary_emb.lora_A.weight", (3, 32)),
    ("base_model.model.model.layers.0.mlp.q_proj.lora_A.weight", (3, 32)),
    ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", (32, 32)),
    ("model.layers.0.self_attn.q_proj.lora_A.weight", (3, 32)),
])
def test_tensor_for_unsupported_module(good, base, key, shape):
    edit_tensors(good, lambda t: t.__setitem__(key, torch.ones(shape)))
    msg = refused(good, base, "a tensor whose name is not a LoRA weight of a supported module")
    assert key not in msg  # not a LoRA weight key: text from the file, not echoed


def test_module_the_base_lacks(good, base):
    features = {m: f for m, f in base.features.items() if m != "k_proj"}
    lacking = BaseShapes(base.num_layers, features)
    edit_config(good, target_modules=["q_proj", "v_proj", "o_proj"])
    refused(good, lacking, "k_proj.lora_A.weight", "lacks")


def test_layer_out_of_range(good, base):
    def move(t):
        for k in [k for k in t if ".layers.1." in k]:
            t[k.replace(".layers.1.", ".layers.7.")] = t.pop(k)
    edit_tensors(good, move)
    refused(good, base, "layers.7.", "layer 7", "2 layers")


def test_adapter_for_deeper_base(saved, base):
    one = BaseShapes(1, base.features)
    refused(saved("attn_r3")[0], one, "layers.1.", "layer 1", "1 layers")


def test_non_canonical_layer_index(good, base):
    def move(t):
        for k in [k for k in t if ".layers.1." in k]:
            t[k.replace(".layers.1.", ".layers.01.")] = t.pop(k)
    edit_tensors(good, move)
    assert "layers.01." not in refused(good, base, "not a LoRA weight")


@pytest.mark.parametrize("which,shape,needle", [
    ("lora_A", (3, 33), "in_features"),
    ("lora_B", (31, 3), "out_features"),
    ("lora_B", (32, 2), "rank mismatch"),
    ("lora_A", (3, 32, 1), "2-D"),
])
def test_wrong_shapes(good, base, which, shape, needle):
    key = f"{KQ0}.{which}.weight"
    edit_tensors(good, lambda t: t.__setitem__(key, torch.ones(shape)))
    refused(good, base, key, needle)


def test_wrong_base_shapes(saved, base):
    wider = BaseShapes(base.num_layers, {m: (i + 16 if i == 32 else i, o) for m, (i, o) in base.features.items()})
    refused(saved("attn_r3")[0], wider, "lora_A.weight", "in_features")
    taller = BaseShapes(base.num_layers, {m: (i, o * 2) for m, (i, o) in base.features.items()})
    refused(saved("attn_r3")[0], taller, "lora_B.weight", "out_features")


def test_integer_tensor(good, base):
    key = KQ0 + ".lora_A.weight"
    edit_tensors(good, lambda t: t.__setitem__(key, torch.ones((3, 32), dtype=torch.int32)))
    refused(good, base, key, "floating")


@pytest.mark.parametrize("drop,other", [("lora_B", "lora_A"), ("lora_A", "lora_B")])
def test_unpaired(good, base, drop, other):
    edit_tensors(good, lambda t: t.pop(f"{KQ0}.{drop}.weight"))
    refused(good, base, f"{KQ0}.{other}.weight", f"no matching {drop}")


def test_mixed_adapter_names(good, base):
    def rename(t):
        k = KQ0 + ".lora_A.weight"
        t[k.replace(".weight", ".default.weight")] = t.pop(k)
    edit_tensors(good, rename)
    refused(good, base, "adapter names")


def test_zero_tensors(good, base):
    save_file({}, str(good / "adapter_model.safetensors"), metadata={"format": "pt"})
    refused(good, base, "adapter_model.safetensors", "no LoRA tensors")


# ---------------------------------------------------------------------------------------------
# Refusals: the safetensors file itself
# ---------------------------------------------------------------------------------------------


def test_truncated_safetensors(good, base):
    p = good / "adapter_model.safetensors"
    data = p.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    for cut in (0, 3, 8, 8 + n // 2, 8 + n, len(data) - 1):
        p.write_bytes(data[:cut])
        refused(good, base, str(p))


def test_garbage_safetensors(good, base):
    p = good / "adapter_model.safetensors"
    data = p.read_bytes()
    p.write_bytes(b"\x00" * 64)
    refused(good, base, str(p))
    p.write_bytes(os.urandom(4096))
    refused(good, base, str(p))
    header = b'{"a": [1, 2]}'
    p.write_bytes(struct.pack("<Q", len(header)) + header)
    refused(good, base, str(p), "malformed header entry")
    header = b"[1, 2, 3]"
    p.write_bytes(struct.pack("<Q", len(header)) + header)
    refused(good, base, str(p))
    # a header whose tensors overlap: caught by safetensors itself, reported cleanly
    hdr = {"x.lora_A.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "y.lora_A.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    raw = json.dumps(hdr).encode()
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x00" * 8)
    refused(good, base, str(p))
    # byte range that disagrees with the shape
    hdr = {"x.lora_A.weight": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}
    raw = json.dumps(hdr).encode()
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x00" * 8)
    refused(good, base, str(p), "byte range")
    assert data


# ---------------------------------------------------------------------------------------------
# Digest
# ---------------------------------------------------------------------------------------------


def test_the_digest_follows_the_content_not_the_folder(saved, base, tmp_path):
    src = saved("attn_r3")[0]
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(src, a)
    shutil.copytree(src, b)
    d = load_adapter(src, base).digest
    assert re.fullmatch("[0-9a-f]{64}", d), d  # a SHA-256, in hex
    assert load_adapter(a, base).digest == d == load_adapter(src, base).digest

    def nudge(t):
        t[KQ0 + ".lora_B.weight"][2, 1] += 1e-3
    edit_tensors(a, nudge)
    assert load_adapter(a, base).digest != d

    edit_config(b, lora_alpha=7)
    d_alpha = load_adapter(b, base).digest
    assert d_alpha != d
    edit_config(b, lora_alpha=6, lora_dropout=0.25)
    d_dropout = load_adapter(b, base).digest
    assert d_dropout not in (d, d_alpha)
    edit_config(b, lora_dropout=0.0)
    assert load_adapter(b, base).digest == d  # the same content again, key order rewritten

    assert load_adapter(saved("rslora")[0], base).digest != d


def test_digest_sees_dtype_and_names(good, base):
    d = load_adapter(good, base).digest
    edit_tensors(good, lambda t: t.update({k: v.to(torch.float64) for k, v in t.items()}))
    d64 = load_adapter(good, base).digest
    assert d64 != d

    def rename(t):
        for k in list(t):
            t[k.replace(".weight", ".default.weight")] = t.pop(k)
    edit_tensors(good, rename)
    assert load_adapter(good, base).digest not in (d, d64)


# ---------------------------------------------------------------------------------------------
# What a file can make expensive is bounded before it is evaluated (issue 48)
# ---------------------------------------------------------------------------------------------

BACKTRACKING = r"(.*?)*?.*?q.*?_.*?x"  # matches nothing, in exponential time on a module name


@pytest.mark.parametrize("field, value", [
    ("target_modules", BACKTRACKING),
    ("exclude_modules", BACKTRACKING),
    ("rank_pattern", {BACKTRACKING: 4}),
    ("alpha_pattern", {BACKTRACKING: 4}),
])
def test_a_pattern_that_backtracks_is_refused_at_its_timeout(good, base, field, value, monkeypatch):
    calls = []
    real = peft_config.Matcher.__call__

    def counted(self, *args, **kwargs):
        calls.append(args[0])
        return real(self, *args, **kwargs)
    monkeypatch.setattr(peft_config.Matcher, "__call__", counted)
    edit_config(good, **{field: value})
    msg = refused(good, base, field, "takes too long")
    secret_free(msg, good)
    assert calls.count(field) >= 1  # refused at its first name's timeout, not after all of them
    if field in ("target_modules", "exclude_modules"):  # what a registration checks (on a worker)
        with pytest.raises(AdapterError, match="takes too long"):
            read_adapter_config(good, base)


def test_a_pattern_too_long_is_refused_before_it_is_compiled(good, base):
    edit_config(good, target_modules="q_proj|" * 1000 + "v_proj")
    refused(good, base, "target_modules", f"at most {peft_config.MAX_PATTERN_CHARS} characters")


def test_many_rank_pattern_keys_one_per_module_still_load(good, base):
    names = list(base.module_names())
    edit_config(good, rank_pattern={n: 3 for n in names})  # PEFT's own form: one key per module
    assert load_adapter(good, base).weights


def test_a_header_over_its_cap_is_refused_before_it_is_parsed(good, base, monkeypatch):
    from lorafleet.adapters import adapter as adapter_mod

    p = good / "adapter_model.safetensors"
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["__metadata__"] = {f"k{i}": "v" for i in range(120_000)}  # ~1.5 MiB of metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    p.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    real = json.loads

    def loads(text, *args, **kwargs):
        assert len(text) < 1 << 20, "the header was parsed"
        return real(text, *args, **kwargs)
    monkeypatch.setattr(adapter_mod.json, "loads", loads)
    secret_free(refused(good, base, "header is over 1 MiB"), good)
    with pytest.raises(AdapterError, match="header is over"):
        read_plan(good, base)
