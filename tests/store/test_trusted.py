"""Loads from the store trust the pull: its validation, its digest and its laid-out weights
(`adapters.layout.save` at pull, `read_saved` at load). A stored load gives the very bits a checked
load of the same files gives, for PEFT's rank/alpha patterns and rsLoRA too, at float32 and
bfloat16; it reads nothing but the saved layout; a layout of another version or for other
weights is not used; the resolver trusts only when the daemon serves the base the adapter was
validated against; `bench store-load` measures the difference."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import safetensors.torch
import torch

from lorafleet import Engine, SamplingParams
from lorafleet.bench.store_load import run_store_load
from lorafleet.errors import AdapterError
from lorafleet.adapters.adapter import BaseShapes
from lorafleet.adapters import layout
from lorafleet.memory.host_cache import build_host_adapter
from lorafleet.memory.kv import kv_page_elems
from lorafleet.model.config import ModelConfig
from lorafleet.store.pull import pull
from lorafleet.store.resolver import StoreResolver
from lorafleet.store.store import Store
from tests.fixtures import ALL7, build_adapter, slow_down, stepping

VARIANTS = {
    "all7": dict(r=8, lora_alpha=16, target_modules=ALL7),
    "patterns": dict(r=4, lora_alpha=8, target_modules=ALL7, rank_pattern={"q_proj": 6, "down_proj": 2},
                     alpha_pattern={"v_proj": 3}),
    "rslora-attn": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
}


@pytest.fixture
def stored(llama_dir, tmp_path):
    """(store, shapes, page_elems): a store holding the tiny llama as its base; the elements of
    an engine's page at the default block size, which the store lays adapters out for."""
    store = Store(tmp_path / "store")
    pull(str(llama_dir), name="base", base=True, store=store)
    cfg = ModelConfig.from_folder(llama_dir)
    return store, BaseShapes.from_model_config(cfg), kv_page_elems(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_stored_load_gives_the_bits_a_checked_load_gives(llama_dir, tmp_path, stored, variant, dtype):
    store, shapes, page_elems = stored
    m = pull(str(build_adapter(llama_dir, tmp_path / variant, seed=3, **VARIANTS[variant])), name="a", store=store)
    assert layout.LAYOUT_FILE in m["files"]  # laid out at pull, a blob like the others
    folder = store.folder(m)
    checked = build_host_adapter(folder, shapes, page_elems, dtype, False)
    trusted = build_host_adapter(folder, shapes, page_elems, dtype, False, m["digest"])
    assert trusted.digest == checked.digest == m["digest"]
    assert trusted.buffer.dtype == dtype and torch.equal(trusted.buffer, checked.buffer)
    assert trusted.layout == checked.layout
    assert trusted.ranks == checked.ranks == m["ranks"] and trusted.num_params == checked.num_params == m["params"]


def test_a_stored_load_reads_only_the_saved_layout(llama_dir, tmp_path, stored):
    store, shapes, page_elems = stored
    m = pull(str(build_adapter(llama_dir, tmp_path / "src", r=4, target_modules=ALL7)), name="a", store=store)
    folder = tmp_path / "copy"
    shutil.copytree(store.folder(m), folder)
    (folder / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError):
        build_host_adapter(folder, shapes, page_elems, torch.float32, False)  # a checked load reads the weights
    host = build_host_adapter(folder, shapes, page_elems, torch.float32, False, m["digest"])
    assert host.digest == m["digest"] and host.layout.numel == host.buffer.numel() >= m["params"]


@pytest.mark.parametrize("change", ["version", "digest", "page_elems"])
def test_a_layout_of_another_version_or_other_weights_or_pages_is_not_used(llama_dir, tmp_path, stored, change):
    store, shapes, page_elems = stored
    m = pull(str(build_adapter(llama_dir, tmp_path / "src", r=4, target_modules=ALL7)), name="a", store=store)
    folder = tmp_path / "copy"
    shutil.copytree(store.folder(m), folder)
    saved = folder / layout.LAYOUT_FILE
    with safetensors.safe_open(str(saved), "pt") as f:
        meta, tensor = f.metadata(), f.get_tensor("layout")
    meta[change] = {"version": "0", "digest": "f" * 64, "page_elems": str(2 * page_elems)}[change]
    saved.unlink()
    safetensors.torch.save_file({"layout": torch.zeros_like(tensor)}, str(saved), metadata=meta)
    host = build_host_adapter(folder, shapes, page_elems, torch.float32, False, m["digest"])
    assert host.digest == m["digest"] and torch.equal(host.buffer, tensor)  # read and laid out again
    assert json.loads(meta["ranks"]) == host.ranks


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


@pytest.mark.parametrize("short_loads", [True, False])
def test_a_cold_stored_adapter_serves_in_the_step_it_arrived_before(llama_dir, tmp_path, stored, monkeypatch, short_loads):
    """Recent loads short: the tick waits for the wanted load in flight, so the request runs in
    the first step; loads long: the step goes on without it (its adapter lands later)."""
    from lorafleet.memory import prefetch

    store, _, _ = stored
    pull(str(build_adapter(llama_dir, tmp_path / "src", r=4, target_modules=ALL7)), name="a", store=store)
    engine = Engine(store.folder(store.get("models", "base")), pool_bytes=4 << 20)
    StoreResolver(store).resolve(engine, "a")
    slow_down(monkeypatch, prefetch, "_load", 0.2)  # never landed before the first tick looks
    monkeypatch.setattr(prefetch, "MAX_TICK_WAIT_S", 5.0)  # a deadline the 2-core CI machine always meets
    engine.prefetcher.load_s = 5.0 if short_loads else 6.0
    rid = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0), adapter="a")
    first = engine.step()
    assert [o.request_id for o in first] == ([rid] if short_loads else [])
    done = [o for outs in stepping(engine) for o in outs if o.finished]
    assert [o.request_id for o in done] == [rid] and len(done[0].token_ids) == 3


def test_the_tick_waits_for_every_wanted_load_a_few_typical_times_long(llama_dir, tmp_path, stored, monkeypatch):
    """Two cold adapters arrive together and each load takes longer than the typical load
    (about half of all loads do): the tick waits for both, up to TICK_WAIT_LOADS typical times,
    so both requests run in the first step. Waiting one typical time, or for the first landing
    only, left them for the next step, which may be a whole long prefill later."""
    from lorafleet.memory import prefetch

    store, _, _ = stored
    for i, name in enumerate(("a", "b")):
        pull(str(build_adapter(llama_dir, tmp_path / name, seed=i, r=4, target_modules=ALL7)), name=name, store=store)
    engine = Engine(store.folder(store.get("models", "base")), pool_bytes=4 << 20)
    resolver = StoreResolver(store)
    for name in ("a", "b"):
        resolver.resolve(engine, name)
    slow = 0.5  # the margin (a third of a second) holds with both cores busy elsewhere
    slow_down(monkeypatch, prefetch, "_load", slow)
    monkeypatch.setattr(prefetch, "MAX_TICK_WAIT_S", 5.0)  # the cap out of the way: the multiple decides
    engine.prefetcher.load_s = 2 * slow / 3  # the deadline, 3 typical loads = 2x each load: a wide margin
    rids = [engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0), adapter=name)
            for name in ("a", "b")]
    t0 = time.monotonic()
    first = engine.step()
    assert sorted(o.request_id for o in first) == sorted(rids)
    assert time.monotonic() - t0 < 2 * slow + 1.0  # it waited for the loads, not for its cap
    done = [o for outs in stepping(engine) for o in outs if o.finished]
    assert sorted(o.request_id for o in done) == sorted(rids)


def test_a_copy_back_from_the_host_is_waited_for_by_its_own_typical_time(llama_dir, tmp_path, stored, monkeypatch):
    """An evicted adapter comes back from the host cache by a copy, whose typical time is kept
    apart from disk loads': with disk loads slow (over the cap: no wait for them), the tick
    still waits for the short copy, and the request runs in the first step."""
    from lorafleet.memory import prefetch

    store, _, _ = stored
    pull(str(build_adapter(llama_dir, tmp_path / "src", r=4, target_modules=ALL7)), name="a", store=store)
    engine = Engine(store.folder(store.get("models", "base")), pool_bytes=4 << 20)
    StoreResolver(store).resolve(engine, "a")
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine.generate([[5, 6, 7, 8]], params, adapters=["a"])
    entry = engine.adapters.get("a")
    engine.adapters.step += 100  # past the hysteresis
    assert engine.arbiter.make_room(engine.pool.num_free + 1) and not entry.ready and entry.host is not None
    slow = 0.2
    slow_down(monkeypatch, prefetch, "copy_in", slow)
    monkeypatch.setattr(prefetch, "MAX_TICK_WAIT_S", 1.0)
    engine.prefetcher.load_s = 2.0                 # disk loads over the cap: never waited for
    engine.prefetcher.copy_s = 2 * slow / 3        # copies: 3 typical = 2x this one
    rid = engine.add_request([5, 6, 7, 8], params, adapter="a")
    assert [o.request_id for o in engine.step()] == [rid]
    assert engine.prefetcher.copy_s != 2 * slow / 3  # the copy's seconds were recorded


HEADS_VARIANT = {"heads": dict(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"], modules_to_save=["lm_head"])}


@pytest.mark.parametrize("variant", {**VARIANTS, **HEADS_VARIANT})
def test_a_stored_layout_serves_adapters_held_in_16_bits_laid_out_again(llama_dir, tmp_path, stored, variant):
    # `--lora-dtype bfloat16`: a page holds twice the elements the store laid the adapter out for;
    # the saved rows (the embedding's and LM head's parts too) are moved to the new layout, and the
    # weights file is still never read
    store, shapes, page_elems = stored
    kw = {**VARIANTS, **HEADS_VARIANT}[variant]
    m = pull(str(build_adapter(llama_dir, tmp_path / variant, seed=4, **kw)), name="a", store=store)
    folder = tmp_path / "copy"
    shutil.copytree(store.folder(m), folder)
    checked = build_host_adapter(folder, shapes, 2 * page_elems, torch.bfloat16, False)
    (folder / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    trusted = build_host_adapter(folder, shapes, 2 * page_elems, torch.bfloat16, False, m["digest"])
    assert trusted.layout == checked.layout and trusted.layout.page_elems == 2 * page_elems
    assert trusted.buffer.dtype == torch.bfloat16 and torch.equal(trusted.buffer, checked.buffer)
    assert trusted.layout != build_host_adapter(folder, shapes, page_elems, torch.bfloat16, False, m["digest"]).layout
    assert bool(trusted.layout.parts) == (variant == "heads")


@pytest.mark.parametrize("kw", [dict(r=4, lora_alpha=8, target_modules=ALL7, use_dora=True),
                                dict(r=3, lora_alpha=6, target_modules=["q_proj", "down_proj"], lora_bias=True)])
def test_laying_a_saved_layout_out_again_moves_the_epilogues_rows_too(llama_dir, tmp_path, stored, kw):
    from lorafleet.adapters.adapter import load_adapter
    from lorafleet.adapters.finish import relaid

    _, shapes, page_elems = stored
    adapter = load_adapter(build_adapter(llama_dir, tmp_path / "src", seed=5, **kw), shapes)
    layout.save(tmp_path / "saved.safetensors", adapter, shapes, page_elems)
    old, buf, _ = layout.read_saved(tmp_path / "saved.safetensors", adapter.digest, shapes, 2 * page_elems)
    assert old.page_elems == page_elems and any(m.post for m in old.modules)
    new, out = relaid(old, buf, 2 * page_elems, shapes)
    want = layout.Layout.of(adapter, shapes, 2 * page_elems)
    filled = torch.zeros(want.numel)
    want.fill(filled, adapter)
    assert new == want and torch.equal(out, filled)
    assert layout.read_saved(tmp_path / "saved.safetensors", adapter.digest, shapes, 3 * page_elems // 2) is None
