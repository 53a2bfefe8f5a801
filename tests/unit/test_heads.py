"""An adapter's own embedding and LM head (`adapters/heads.py`): what the files' headers plan is what
loading lays out, the store's saved layout reads back the same, and each malformed case is refused
naming the tensor or field (not "invalid")."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorafleet.errors import AdapterError
from lorafleet.adapters.adapter import BaseShapes, load_adapter
from lorafleet.adapters.weights_file import read_plan
from lorafleet.memory.kv import BASE_SALT, kv_salt
from lorafleet.adapters.layout import Layout, read_saved, save
from lorafleet.model.config import ModelConfig
from tests.fixtures import build_adapter, build_model

pytestmark = pytest.mark.unit

PAGE = 4096
KINDS = {
    "lora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens", "lm_head"]),
    "saved": dict(r=2, lora_alpha=4, target_modules=["v_proj"], modules_to_save=["embed_tokens", "lm_head"]),
    "head-only": dict(r=3, lora_alpha=3, target_modules=["lm_head"]),
    "norms": dict(r=2, lora_alpha=2, target_modules=["k_proj"], modules_to_save=["input_layernorm", "model.norm"]),
}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    base = build_model(root / "base")
    shapes = BaseShapes.from_model_config(ModelConfig.from_folder(base))
    return base, shapes, {k: build_adapter(base, root / k, seed=i, **kw) for i, (k, kw) in enumerate(KINDS.items())}


@pytest.mark.parametrize("kind", KINDS)
def test_the_headers_plan_is_the_loaded_layout_and_saves_back(made, kind, tmp_path):
    _, base, folders = made
    adapter = load_adapter(folders[kind], base)
    plan = read_plan(folders[kind], base)
    planned = Layout.plan(plan.ranks, base, PAGE, plan.posts, plan.heads)
    loaded = Layout.of(adapter, base, PAGE)
    assert planned == loaded and planned.parts and all(p.first % PAGE == 0 for p in planned.parts.values())
    buf = torch.zeros(loaded.numel)
    loaded.fill(buf, adapter)
    save(tmp_path / "layout.safetensors", adapter, base, PAGE)
    layout, saved, _ = read_saved(tmp_path / "layout.safetensors", adapter.digest, base, PAGE)
    assert layout == loaded and torch.equal(saved, buf)
    for name, part in loaded.parts.items():  # each row where its offset says, e.g. the copy's first and last
        for i in {min(1, part.rows - 1), part.rows - 1}:  # (row 0 of an embedding: the padding token, zeros)
            o = int(part.offsets(PAGE)[i])
            assert buf[o:o + part.width].abs().sum() > 0, (name, i)
    salt = kv_salt(loaded.targets(), adapter.digest, base.num_layers)
    assert (salt == BASE_SALT) == (kind == "head-only")  # only the LM head: the base's K and V


def edited(folder, tmp_path, config=None, tensors=None):
    import shutil
    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    if config:
        cfg = json.loads((out / "adapter_config.json").read_text())
        config(cfg)
        (out / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors:
        t = load_file(out / "adapter_model.safetensors")
        tensors(t)
        save_file(t, out / "adapter_model.safetensors")
    return out


HEAD = "base_model.model.lm_head.weight"
EMBED = "base_model.model.model.embed_tokens.weight"


def grow(t, key, rows=2):
    t[key] = torch.cat([t[key], torch.zeros(rows, t[key].shape[1])])


REFUSALS = [
    ("lora", dict(config=lambda c: c.update(target_modules=["q_proj", "embed_tokens"])),
     "but target_modules does not target 'lm_head'"),
    ("saved", dict(tensors=lambda t: t.pop(HEAD)),
     "modules_to_save names 'lm_head', but the weights hold no 'base_model.model.lm_head.weight'"),
    ("saved", dict(tensors=lambda t: grow(t, HEAD)), "the saved embed_tokens has 160 rows but lm_head 162"),
    ("saved", dict(config=lambda c: c.update(modules_to_save=["embed_tokens"]), tensors=lambda t: (t.pop(HEAD), grow(t, EMBED))),
     "the saved embed_tokens has 162 rows, the base's vocabulary 160: an adapter with its own vocabulary saves lm_head too"),
    ("head-only", dict(config=lambda c: c.update(use_dora=True),
                       tensors=lambda t: t.__setitem__("base_model.model.lm_head.lora_magnitude_vector", torch.ones(160))),
     "use_dora on lm_head is not supported"),
    ("head-only", dict(tensors=lambda t: t.__setitem__("base_model.model.lm_head.lora_B.weight", torch.ones(150, 3))),
     "shapes [3, 64] and [150, 3], expected [r, 64] and [160, r]"),
    ("saved", dict(config=lambda c: c.update(modules_to_save=["lm_head", "score"])),
     "modules_to_save: an entry names no module the base has, or one that is not supported"),
    ("saved", dict(config=lambda c: c.update(modules_to_save=["lm_head", "q_proj"])), "not supported as a saved module"),
    ("saved", dict(config=lambda c: c.update(modules_to_save=["lm_head"] * 65)), "modules_to_save: at most 64 entries"),
    ("norms", dict(config=lambda c: c.update(modules_to_save=["layers.0.input_layernorm"])),
     "modules_to_save: input_layernorm is supported saved in every layer or none"),
    ("norms", dict(tensors=lambda t: t.pop("base_model.model.model.layers.1.input_layernorm.weight")),
     "modules_to_save names 'input_layernorm', but the weights hold it for 1 of the base's 2 layers"),
    ("norms", dict(tensors=lambda t: t.__setitem__("base_model.model.model.norm.weight", torch.ones(3))),
     "expected a vector of the base's hidden size ([64])"),
]


@pytest.mark.parametrize("kind,edit,named", REFUSALS)
def test_a_malformed_embedding_or_lm_head_is_refused_naming_it(made, tmp_path, kind, edit, named):
    _, base, folders = made
    with pytest.raises(AdapterError) as e:
        load_adapter(edited(folders[kind], tmp_path, **edit), base)
    assert named in str(e.value)


@pytest.mark.parametrize("scattered", [False, True])
def test_a_part_is_read_from_its_pages_as_it_was_written(made, scattered):
    """The pool side (`adapters.batch.HeadParts`): a saved LM head and an embedding LoRA copied into
    pages, consecutive (read in place) or scattered (gathered), read back equal to the adapter's
    matrices: whole, by token rows, and as a product."""
    from lorafleet.adapters.batch import HeadParts
    from lorafleet.adapters.heads import matrices

    _, base, folders = made
    adapter = load_adapter(folders["saved"], base)
    layout = Layout.of(adapter, base, PAGE)
    buf = torch.zeros(layout.numel)
    layout.fill(buf, adapter)
    n = -(-layout.numel // PAGE)
    pool = torch.zeros(n + 7, PAGE)
    pages = torch.randperm(n + 7, generator=torch.Generator().manual_seed(1))[:n].tolist() if scattered else list(range(3, 3 + n))
    for j, page in enumerate(pages):
        chunk = buf[j * PAGE:(j + 1) * PAGE]
        pool[page, :len(chunk)] = chunk
    heads = HeadParts(layout.parts, pages, PAGE, "cpu")
    assert bool(heads.run_start) is not scattered
    x = torch.randn(5, base.hidden_size)
    for name, want in matrices(adapter.heads).items():
        assert torch.equal(heads.matrix(pool, name), want)
        ids = torch.tensor([1, want.shape[0] - 1, 7])
        assert torch.equal(heads.lookup(pool, name, ids), want[ids])
        if want.shape[1] == base.hidden_size:
            assert torch.allclose(heads.project(pool, name, x), x @ want.t(), atol=1e-5)


def test_an_adapters_tokenizer_json_over_its_cap_is_refused_unparsed(tmp_path):
    """Its parse would hold the interpreter's lock: a file over the cap is refused by its size alone
    (a sparse file of garbage: at the cap it is parsed, and refused as malformed instead)."""
    from lorafleet.adapters import heads

    with open(tmp_path / "tokenizer.json", "wb") as f:
        f.truncate(heads.MAX_TOKENIZER_BYTES + 1)
    with pytest.raises(AdapterError, match=r"over the 36 MiB an adapter's tokenizer.json may take"):
        heads.own_tokenizer(tmp_path, 200, 160)
    with open(tmp_path / "tokenizer.json", "wb") as f:
        f.truncate(heads.MAX_TOKENIZER_BYTES)
    with pytest.raises(AdapterError, match="malformed tokenizer.json"):
        heads.own_tokenizer(tmp_path, 200, 160)


@pytest.mark.parametrize("version,norms", [
    (None, {"input_layernorm", "post_attention_layernorm", "model.norm"}),  # no version: the older, loose rule
    ("0.21.2", {"input_layernorm", "post_attention_layernorm", "model.norm"}),
    ("0.13.0.dev0@0123abc", {"input_layernorm", "post_attention_layernorm", "model.norm"}),
    ("0.22.0", {"model.norm"}),  # from 0.22 an entry matches a whole dotted suffix
    ("1.3.0", {"model.norm"}),
    ("garbage", {"input_layernorm", "post_attention_layernorm", "model.norm"}),
])
def test_modules_to_save_is_matched_as_the_peft_that_saved_it_matched(version, norms):
    """`norm` names every RMS norm for a PEFT before 0.22 (a plain suffix) and only the final one
    from 0.22 (a dotted suffix); a full dotted name means the same under both."""
    from lorafleet.adapters.heads import saved_modules

    cfg = {"modules_to_save": ["norm"], **({"peft_version": version} if version else {})}
    assert saved_modules(cfg, num_layers=3) == norms
    cfg["modules_to_save"] = ["layernorm"]
    if version in ("0.22.0", "1.3.0"):
        with pytest.raises(AdapterError, match="names no module the base has"):
            saved_modules(cfg, num_layers=3)
    else:
        assert saved_modules(cfg, num_layers=3) == {"input_layernorm", "post_attention_layernorm"}
    cfg["modules_to_save"] = ["post_attention_layernorm", "model.norm"]
    assert saved_modules(cfg, num_layers=3) == {"post_attention_layernorm", "model.norm"}
