"""The store: pulls from local folders validate once and install atomically; refusals leave
the store as it was; what is stored loads in the engine and computes what the original folder
computes; rm and gc; check() finds what is wrong."""

from __future__ import annotations

import json
import os

import pytest

from lorafleet import Engine, SamplingParams
from lorafleet.errors import AdapterError, LorafleetError
from lorafleet.adapters.layout import LAYOUT_FILE
from lorafleet.store.pull import pull
from lorafleet.errors import StoreError
from lorafleet.store.store import Store
from tests.engine.test_adapters import BROKEN, broken_adapter
from tests.fixtures import ALL7, build_adapter, build_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def bank(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("store-bank")
    return {r: build_adapter(llama_dir, root / f"r{r}", seed=r, r=r, lora_alpha=2 * r, target_modules=ALL7)
            for r in (2, 8)}


@pytest.fixture
def store(tmp_path, llama_dir):
    s = Store(tmp_path / "store")
    pull(str(llama_dir), name="base", base=True, store=s)
    return s


def snapshot(store: Store) -> dict:
    """Everything a refusal must leave as it was: manifests, snapshots, blobs."""
    return {p.relative_to(store.root).as_posix(): (p.stat().st_size if p.is_file() else None)
            for p in sorted(store.root.rglob("*")) if "tmp" not in p.relative_to(store.root).parts}


def test_a_pulled_adapter_is_listed_and_serves_what_its_folder_serves(store, llama_dir, bank):
    m = pull(str(bank[8]), name="r8", store=store)
    assert (m["kind"], m["name"], m["base"]["name"], m["ranks"]["q_proj"]) == ("adapter", "r8", "base", 8)
    assert len(m["digest"]) == 64 and set(m["files"]) == {"adapter_config.json", "adapter_model.safetensors",
                                                                   LAYOUT_FILE}
    assert [a["name"] for a in store.list("adapters")] == ["r8"]
    assert [b["name"] for b in store.list("models")] == ["base"]
    assert store.check(deep=True) == []
    direct = Engine(llama_dir, pool_bytes=4 << 20)
    direct.load_adapter("a", bank[8])
    stored = Engine(store.folder(store.get("models", "base")), pool_bytes=4 << 20)
    stored.load_adapter("a", store.folder(m))
    prompt = [[5, 6, 7, 8, 9]]
    assert (stored.generate(prompt, GREEDY, adapters=["a"])[0].token_ids
            == direct.generate(prompt, GREEDY, adapters=["a"])[0].token_ids)
    assert stored.adapters.get("a").digest == m["digest"]


def test_the_same_content_twice_is_stored_once(store, bank):
    a = pull(str(bank[2]), name="one", store=store)
    b = pull(str(bank[2]), name="two", store=store)
    assert a["snapshot"] == b["snapshot"] and a["digest"] == b["digest"]
    assert len(list(store.blobs.iterdir())) == len(store.get("models", "base")["files"]) + 3


@pytest.mark.parametrize("kind, named", BROKEN)
def test_a_broken_adapter_is_refused_at_pull_and_the_store_is_unchanged(store, bank, tmp_path, kind, named):
    pull(str(bank[2]), name="good", store=store)
    before = snapshot(store)
    with pytest.raises(LorafleetError, match=named):
        pull(str(broken_adapter(kind, bank[8], tmp_path / kind)), name="bad", store=store)
    assert snapshot(store) == before and store.check() == []


def test_an_adapter_for_another_base_is_refused(store, tmp_path):
    other = build_model(tmp_path / "other", "llama", hidden_size=48)
    foreign = build_adapter(other, tmp_path / "foreign", r=4, target_modules=ALL7)
    before = snapshot(store)
    with pytest.raises(AdapterError, match="in_features|out_features"):
        pull(str(foreign), name="foreign", store=store)
    assert snapshot(store) == before


def test_base_model_name_mismatch_warns_or_refuses_with_strict(store, bank, tmp_path):
    import shutil
    folder = tmp_path / "named"
    shutil.copytree(bank[2], folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "meta-llama/Llama-3.1-8B"
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    warnings = []
    pull(str(folder), name="named", store=store, warn=warnings.append)
    assert len(warnings) == 1 and "Llama-3.1-8B" in warnings[0]
    with pytest.raises(StoreError, match="strict"):
        pull(str(folder), name="strict", store=store, strict_base=True)
    assert not store.has("adapters", "strict")


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".hidden", "x" * 129, "a b", ""])
def test_bad_names_are_refused(store, bank, name):
    before = snapshot(store)
    with pytest.raises(StoreError, match="invalid name"):
        pull(str(bank[2]), name=name, store=store)
    assert snapshot(store) == before


def test_an_adapter_needs_a_base_in_the_store(tmp_path, bank):
    with pytest.raises(StoreError, match="no base model"):
        pull(str(bank[2]), name="a", store=Store(tmp_path / "empty"))


def test_rm_then_gc_frees_what_no_manifest_names(store, bank):
    pull(str(bank[2]), name="a", store=store)
    pull(str(bank[8]), name="b", store=store)
    with store.lock():
        store.remove("adapters", "a")
        removed = store.gc()
    assert removed["blobs"] == 3 and removed["snapshots"] == 1  # config, weights, their layout
    assert [a["name"] for a in store.list("adapters")] == ["b"] and store.check(deep=True) == []


def test_check_finds_a_missing_or_altered_blob(store, bank):
    m = pull(str(bank[2]), name="a", store=store)
    blob = store.blobs / m["files"]["adapter_model.safetensors"]["sha256"]
    os.chmod(blob, 0o644)
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert store.check() == []                      # same size: only the deep check sees it
    assert any("sha256" in p for p in store.check(deep=True))
    blob.unlink()
    assert any("missing" in p for p in store.check())
