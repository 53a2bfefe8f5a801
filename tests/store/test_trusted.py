"""Loads from the store trust the pull's validation and digest (`lora.adapter.load_trusted`):
the same weights and scales as a checked load, for PEFT's rank/alpha patterns and rsLoRA too;
the resolver trusts only when the daemon serves the base the adapter was validated against;
`bench store-load` measures the difference."""

from __future__ import annotations

import pytest
import torch

from lorafleet import Engine, SamplingParams
from lorafleet.bench.store_load import run_store_load
from lorafleet.lora.adapter import BaseShapes, load_adapter, load_trusted
from lorafleet.model.config import ModelConfig
from lorafleet.store.pull import pull
from lorafleet.store.resolver import StoreResolver
from lorafleet.store.store import Store
from tests.fixtures import ALL7, build_adapter

VARIANTS = {
    "all7": dict(r=8, lora_alpha=16, target_modules=ALL7),
    "patterns": dict(r=4, lora_alpha=8, target_modules=ALL7, rank_pattern={"q_proj": 6, "down_proj": 2},
                     alpha_pattern={"v_proj": 3}),
    "rslora-attn": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_trusted_load_reads_what_a_checked_load_reads(llama_dir, tmp_path, variant, dtype):
    folder = build_adapter(llama_dir, tmp_path / variant, seed=3, **VARIANTS[variant])
    shapes = BaseShapes.from_model_config(ModelConfig.from_folder(llama_dir))
    checked = load_adapter(folder, shapes, dtype=dtype)
    trusted = load_trusted(folder, shapes, checked.digest, dtype=dtype)
    assert trusted.digest == checked.digest and trusted.weights.keys() == checked.weights.keys()
    for key, w in checked.weights.items():
        t = trusted.weights[key]
        assert t.scale == w.scale and t.a.dtype == dtype
        assert torch.equal(t.a, w.a) and torch.equal(t.b, w.b), key


def test_the_resolver_trusts_only_for_the_base_the_adapter_was_validated_against(llama_dir, tmp_path):
    store = Store(tmp_path / "store")
    base = pull(str(llama_dir), name="base", base=True, store=store)
    m = pull(str(build_adapter(llama_dir, tmp_path / "a", r=4, target_modules=ALL7)), name="a", store=store)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outs = {}
    for label, folder in (("store base", store.folder(base)), ("same weights elsewhere", llama_dir)):
        engine = Engine(folder, pool_bytes=4 << 20)
        StoreResolver(store).resolve(engine, "a")
        entry = engine.adapters.get("a")
        assert entry.trusted_digest == (m["digest"] if label == "store base" else None), label
        outs[label] = engine.generate([[5, 6, 7, 8]], params, adapters=["a"])[0].token_ids
        assert engine.adapters.get("a").digest == m["digest"]  # trusted or computed: the same identity
    assert outs["store base"] == outs["same weights elsewhere"]


def test_bench_store_load_measures_both_loads(tmp_path):
    r = run_store_load("micro", rank=4, repeats=3, root=tmp_path)
    assert r["store_cpu_ms"] > 0 and r["folder_cpu_ms"] > 0 and r["speedup"] == r["folder_cpu_ms"] / r["store_cpu_ms"]
    assert r["bytes"] > 0 and r["target_met"] == (r["store_cpu_ms"] <= 3.0)


def test_the_resolver_never_shadows_an_adapter_loaded_by_other_means(llama_dir, tmp_path):
    store = Store(tmp_path / "store")
    base = pull(str(llama_dir), name="base", base=True, store=store)
    first = build_adapter(llama_dir, tmp_path / "first", seed=1, r=2, target_modules=ALL7)
    mine = build_adapter(llama_dir, tmp_path / "mine", seed=2, r=2, target_modules=ALL7)
    pull(str(first), name="a", store=store)
    engine = Engine(store.folder(base), pool_bytes=4 << 20)
    resolver = StoreResolver(store)
    resolver.resolve(engine, "a")
    assert engine.adapters.get("a").path == store.folder(store.get("adapters", "a"))
    engine.load_adapter("a", mine)                       # the user loads other weights over it
    pull(str(build_adapter(llama_dir, tmp_path / "new", seed=3, r=2, target_modules=ALL7)), name="a", store=store)
    resolver.resolve(engine, "a")
    assert engine.adapters.get("a").path == mine        # the store does not take the name back
