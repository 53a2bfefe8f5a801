"""Adapters in the unified pool: pages in proportion to rank, refcounts, refusals that change
nothing, and a pool that returns to its starting state."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorafleet import Engine, SamplingParams
from lorafleet.errors import (AdapterError, AdapterInUseError, AdapterNotFoundError, AdapterTooLargeError,
                              PoolExhaustedError)
from tests.engine.test_batching import random_prompts
from tests.fixtures import ALL7, build_adapter, stepping

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_bank(llama_dir, tmp_path_factory):
    """A few adapters of different ranks to copy from."""
    root = tmp_path_factory.mktemp("bank")
    return {r: build_adapter(llama_dir, root / f"r{r}", seed=r, r=r, lora_alpha=2 * r, target_modules=ALL7)
            for r in (2, 8, 32)}


def test_pages_grow_with_rank_without_padding(llama_dir, adapter_bank):
    engine = Engine(llama_dir, pool_bytes=4 << 20)
    pages = {r: engine.load_adapter(f"a{r}", path)["pages"] for r, path in adapter_bank.items()}
    page = engine.pool.page_elems
    for r, n in pages.items():
        numel = engine.adapters.get(f"a{r}").numel
        assert n == -(-numel // page)  # exactly what the weights need, rounded up to one page
    assert pages[2] < pages[8] < pages[32]
    assert engine.stats()["pool"]["pages_by_adapter"] == {f"a{r}": n for r, n in pages.items()}


def test_two_hundred_adapters_mixed_then_unloaded_return_the_pool_to_its_start(llama_dir, adapter_bank):
    engine = Engine(llama_dir, pool_bytes=48 << 20)
    start = engine.stats()["pool"]
    ranks = list(adapter_bank)
    names = [f"ad-{i:03d}" for i in range(200)]
    for i, name in enumerate(names):
        engine.load_adapter(name, adapter_bank[ranks[i % 3]])
    assert len(engine.list_adapters()) == 200
    rng = random.Random(0)
    prompts = random_prompts(40)
    for batch in range(3):
        chosen = [rng.choice(names + [None]) for _ in prompts]
        outs = engine.generate(prompts, GREEDY, adapters=chosen)  # integrity checked every step
        assert all(len(o.token_ids) == 6 for o in outs)
    for name in names:
        engine.unload_adapter(name)
    engine.check_integrity()
    assert engine.stats()["pool"]["kv_pages"] == 0
    engine.reset_prefix_cache()  # what finished requests left for reuse
    assert engine.stats()["pool"] == start


def test_same_weights_under_two_names_give_the_same_tokens(llama_dir, adapter_bank):
    engine = Engine(llama_dir, pool_bytes=4 << 20)
    engine.load_adapter("x", adapter_bank[8])
    engine.load_adapter("y", adapter_bank[8])
    engine.load_adapter("z", adapter_bank[32])
    prompt = random_prompts(1)[0]
    x, y, z, none = engine.generate([prompt] * 4, GREEDY, adapters=["x", "y", "z", None])
    assert x.token_ids == y.token_ids
    assert engine.adapters.get("x").digest == engine.adapters.get("y").digest
    assert engine.adapters.get("z").digest != engine.adapters.get("x").digest


def test_an_adapter_in_use_cannot_be_unloaded(llama_dir, adapter_bank):
    engine = Engine(llama_dir, pool_bytes=4 << 20)
    engine.load_adapter("busy", adapter_bank[8])
    rid = engine.add_request(random_prompts(1)[0], GREEDY, adapter="busy")
    engine.step()
    with pytest.raises(AdapterInUseError, match="busy"):
        engine.unload_adapter("busy")
    engine.abort(rid)
    engine.unload_adapter("busy")
    assert engine.pool.stats()["adapter_pages"] == 0


def test_replacing_weights_in_use_finishes_running_requests_on_the_old_ones(llama_dir, adapter_bank):
    prompts = random_prompts(3)
    solo = Engine(llama_dir, pool_bytes=4 << 20)
    solo.load_adapter("old", adapter_bank[8])
    solo.load_adapter("new", adapter_bank[32])
    old_tokens = [o.token_ids for o in solo.generate(prompts[:2], GREEDY, adapters=["old"] * 2)]
    new_tokens = solo.generate(prompts[2:], GREEDY, adapters=["new"])[0].token_ids

    engine = Engine(llama_dir, pool_bytes=4 << 20)
    engine.load_adapter("x", adapter_bank[8])
    running = engine.add_request(prompts[0], GREEDY, adapter="x")
    engine.step()                                          # running on the old weights
    waiting = engine.add_request(prompts[1], GREEDY, adapter="x")  # arrived before the swap
    info = engine.load_adapter("x", adapter_bank[32])      # replaced while both use it
    assert info["digest"] == solo.adapters.get("new").digest
    assert engine.adapters.stats()["retired"] == 1
    after = engine.add_request(prompts[2], GREEDY, adapter="x")
    done = {}
    for outs in stepping(engine):
        done.update({o.request_id: o for o in outs if o.finished})
    assert done[running].token_ids == old_tokens[0]
    assert done[waiting].token_ids == old_tokens[1]
    assert done[after].token_ids == new_tokens
    assert engine.adapters.stats()["retired"] == 0         # the old pages went back with its last user
    assert engine.stats()["pool"]["pages_by_adapter"] == {"x": info["pages"]}


def test_unknown_adapter_and_bad_names_are_refused(llama_dir, adapter_bank):
    engine = Engine(llama_dir, pool_bytes=4 << 20)
    with pytest.raises(AdapterNotFoundError, match="nope"):
        engine.add_request([5, 6], GREEDY, adapter="nope")
    with pytest.raises(AdapterNotFoundError, match="nope"):
        engine.unload_adapter("nope")
    for bad in ["", "../etc", "a b", "-x", "x" * 200]:
        with pytest.raises(AdapterError, match="name"):
            engine.load_adapter(bad, adapter_bank[2])
    assert not engine.requests and engine.pool.num_free == engine.pool.num_pages


def test_an_adapter_on_scattered_pages_computes_the_same(llama_dir, adapter_bank):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = random_prompts(1)[0]
    roomy = Engine(llama_dir, pool_bytes=4 << 20)
    roomy.load_adapter("a", adapter_bank[32])
    expected = roomy.generate([prompt], params, adapters=["a"])[0].token_ids
    need = len(roomy.adapters.get("a").pages)
    small = roomy.load_adapter("small", adapter_bank[2])["pages"]
    assert small < need
    k = -(-need // small)
    engine = Engine(llama_dir, pool_bytes=small * (2 * k + 2) * roomy.pool.page_bytes)
    fillers = [f"f{i}" for i in range(2 * k + 2)]
    for name in fillers:
        engine.load_adapter(name, adapter_bank[2])
    for name in fillers[::2]:  # free every other filler: no free run longer than one filler
        engine.unload_adapter(name)
    engine.load_adapter("a", adapter_bank[32])
    pages = engine.adapters.get("a").pages
    assert pages != list(range(pages[0], pages[0] + len(pages)))   # scattered: nothing was evicted to avoid it
    assert all(name in engine.adapters and engine.adapters.get(name).ready for name in fillers[1::2])
    for name in fillers[1::2]:  # room for the KV cache; "a" stays scattered
        engine.unload_adapter(name)
    assert engine.generate([prompt], params, adapters=["a"])[0].token_ids == expected


def test_an_adapter_larger_than_the_pool_is_refused_for_good_and_changes_nothing(llama_dir, adapter_bank):
    probe = Engine(llama_dir, pool_bytes=4 << 20)
    need = probe.load_adapter("big", adapter_bank[32])["pages"]
    engine = Engine(llama_dir, pool_bytes=(need - 1) * probe.pool.page_bytes)
    for load in (engine.load_adapter, engine.register_adapter):
        with pytest.raises(AdapterTooLargeError, match=rf"'big' needs {need} pages .*holds {need - 1} pages") as e:
            load("big", adapter_bank[32])
        assert e.value.http_status == 400  # no retry can succeed
    assert engine.pool.num_free == engine.pool.num_pages and not engine.list_adapters()


def declared_huge(src: Path, dst: Path, rank: int) -> Path:
    """A copy of the adapter `src` whose k_proj of layer 0 declares `rank` in its header, its data a
    hole in a sparse file (no disk used, nothing worth reading)."""
    import json
    import shutil
    import struct

    shutil.copytree(src, dst)
    p = dst / "adapter_model.safetensors"
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    key = "base_model.model.model.layers.0.self_attn.k_proj.lora_"
    fin = header[key + "A.weight"]["shape"][1]
    fout = header[key + "B.weight"]["shape"][0]
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    for ab, shape in (("A", [rank, fin]), ("B", [fout, rank])):
        nbytes = 4 * shape[0] * shape[1]
        header[key + ab + ".weight"] = {"dtype": "F32", "shape": shape, "data_offsets": [end, end + nbytes]}
        end += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + raw[8 + n:8 + n + end])
        f.truncate(8 + len(text) + end)
    return dst


def test_an_eager_load_checks_the_declared_size_before_reading_a_tensor(llama_dir, adapter_bank, tmp_path, monkeypatch):
    from lorafleet.adapters import adapter as adapter_mod

    huge = declared_huge(adapter_bank[2], tmp_path / "huge", rank=400_000)
    engine = Engine(llama_dir, pool_bytes=4 << 20)
    monkeypatch.setattr(adapter_mod, "read_tensors", lambda path: pytest.fail("a tensor was read"))
    for load in (engine.load_adapter, engine.register_adapter):
        with pytest.raises(AdapterTooLargeError, match="'huge' needs .* pages"):
            load("huge", huge)
    assert engine.pool.num_free == engine.pool.num_pages and not engine.list_adapters()


def test_an_adapter_that_fits_only_once_requests_finish_is_refused_as_retryable(llama_dir, adapter_bank):
    probe = Engine(llama_dir, pool_bytes=4 << 20)
    need = probe.load_adapter("big", adapter_bank[32])["pages"]
    engine = Engine(llama_dir, pool_bytes=(need + 2) * probe.pool.page_bytes)
    rid = engine.add_request(list(range(5, 45)), GREEDY)   # 3 KV pages while it runs
    engine.step()
    with pytest.raises(PoolExhaustedError, match="retry") as e:
        engine.load_adapter("big", adapter_bank[32])
    assert e.value.http_status == 503
    engine.abort(rid)
    assert engine.load_adapter("big", adapter_bank[32])["pages"] == need


def broken_adapter(kind, src, dst):
    """Copy of a good adapter broken one way."""
    import shutil
    shutil.copytree(src, dst)
    cfg_path, w_path = dst / "adapter_config.json", dst / "adapter_model.safetensors"
    cfg = json.loads(cfg_path.read_text())
    if kind == "dora":
        cfg["use_dora"] = True
    elif kind == "bias":
        cfg["bias"] = "all"
    elif kind == "modules_to_save":
        cfg["modules_to_save"] = ["lm_head"]
    elif kind == "unknown_target":
        cfg["target_modules"] = ["rotary_emb"]
    elif kind == "rank0":
        cfg["r"] = 0
    elif kind == "not_json":
        cfg_path.write_text("{not json")
        return dst
    elif kind in ("wrong_shape", "missing_pair", "non_finite"):
        t = load_file(w_path)
        key = next(k for k in sorted(t) if "lora_A" in k)
        if kind == "wrong_shape":
            t[key] = t[key][:, :-1].contiguous()
        elif kind == "missing_pair":
            del t[key.replace("lora_A", "lora_B")]
        else:
            t[key][0, 0] = float("nan")
        save_file(t, w_path)
    elif kind == "truncated":
        w_path.write_bytes(w_path.read_bytes()[:100])
    elif kind == "pickle":
        w_path.unlink()
        (dst / "adapter_model.bin").write_bytes(b"\x80\x04K\x01.")
    cfg_path.write_text(json.dumps(cfg))
    return dst


# each way `broken_adapter` breaks an adapter, and what the refusal must name (tests/store reuses both)
BROKEN = [
    ("dora", "use_dora"), ("bias", "bias"), ("modules_to_save", "modules_to_save"),
    ("unknown_target", "target_modules has an entry"), ("rank0", "r"), ("not_json", "adapter_config.json"),
    ("wrong_shape", "lora_A"), ("missing_pair", "lora_B"), ("non_finite", "lora_A"),
    ("truncated", "adapter_model.safetensors"), ("pickle", "adapter_model.bin"),
]


@pytest.mark.parametrize("kind, named", BROKEN)
def test_a_refused_adapter_changes_nothing_and_serving_goes_on(llama_dir, adapter_bank, tmp_path, kind, named):
    engine = Engine(llama_dir, pool_bytes=4 << 20)
    engine.load_adapter("good", adapter_bank[8])
    prompt = random_prompts(1)[0]
    before = engine.generate([prompt], GREEDY, adapters=["good"])[0].token_ids
    pool_before = engine.stats()["pool"]
    rid = engine.add_request(prompt, GREEDY, adapter="good")  # in flight during the refusal
    with pytest.raises(AdapterError, match=named):
        engine.load_adapter("broken", broken_adapter(kind, adapter_bank[8], tmp_path / kind))
    with pytest.raises(AdapterError, match=named):
        engine.load_adapter("good", broken_adapter(kind, adapter_bank[8], tmp_path / f"{kind}-2"))
    assert engine.stats()["pool"]["pages_by_adapter"] == pool_before["pages_by_adapter"]
    done = {}
    for outs in stepping(engine):
        done.update({o.request_id: o for o in outs if o.finished})
    assert done[rid].token_ids == before
    assert engine.generate([prompt], GREEDY, adapters=["good"])[0].token_ids == before


def test_one_lora_batch_holds_decode_and_prefill_segments_with_their_row_tables(llama_dir, adapter_bank):
    from lorafleet.engine.request import Request
    from lorafleet.engine.scheduler import Chunk
    from lorafleet.kernels.reference import scale_bits
    engine = Engine(llama_dir, pool_bytes=4 << 20)
    engine.load_adapter("a", adapter_bank[8])
    engine.load_adapter("b", adapter_bank[2])
    def request(rid, n, adapter):
        return Request(rid, [5] * n, GREEDY, adapter, loras=(engine.adapters.get(adapter),) if adapter else (),
                       scales=(1.0,) if adapter else ())
    decode = [Chunk(request(f"d{i}", 3, n), 1) for i, n in enumerate(["a", "b", None])]
    prefill = [Chunk(request("p", 20, "a"), 20)]
    batch = engine.runner.lora_batch(engine.runner.order(decode + prefill))
    a, b = engine.adapters.get("a"), engine.adapters.get("b")
    # row 0 has no adapter: no segment; each segment points to its adapter's row table
    one = scale_bits(1.0)
    assert batch.host.tolist() == [[1, 2, a.row_table, one, 1], [2, 3, b.row_table, one, 1],
                                   [3, 23, a.row_table, one, 1]]
    assert (batch.max_rows, batch.max_rank) == (20, 8)
    pool = engine.pool.tensor.view(-1).view(torch.int64)
    for entry in (a, b):  # the table lies in the adapter's own pages
        assert entry.row_table * 8 // engine.pool.page_bytes in entry.pages
        assert pool[entry.row_table] == entry.max_rank  # layer 0's q_proj rank


def test_start_up_loads_into_a_small_pool_evict_the_adapters_no_request_holds():
    """The demo fleet through a 2 MiB pool, as `serve --pool-bytes 2MiB` loads it before any step:
    each load evicts earlier ones that no request holds; every adapter then serves on demand."""
    from lorafleet.demo import default_fleet
    from lorafleet.demo.skills import expected, user_turn

    fleet = default_fleet()
    engine = Engine(fleet.model, pool_bytes=2 << 20)
    for name, path in fleet.adapters.items():
        engine.load_adapter(name, path)
    evicted = [n for n in fleet.adapters if engine.adapters.get(n).evictions]
    assert evicted and engine.adapters.get(list(fleet.adapters)[-1]).ready
    name = evicted[0]
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": user_turn(name, "mixed batch")}],
                                                  add_generation_prompt=True, tokenize=True)
    out = engine.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0), adapters=[name])[0]
    assert out.text == expected(name, "mixed batch")


def test_a_young_adapter_a_waiting_request_holds_is_spared_by_other_loads(llama_dir, adapter_bank):
    probe = Engine(llama_dir, pool_bytes=4 << 20)
    need = probe.load_adapter("a", adapter_bank[32])["pages"]
    engine = Engine(llama_dir, pool_bytes=(need + need // 2) * probe.pool.page_bytes)
    engine.load_adapter("a", adapter_bank[32])
    engine.add_request([5, 6, 7], GREEDY, adapter="a")   # holds "a" (waiting: not yet run)
    with pytest.raises(PoolExhaustedError):
        engine.load_adapter("b", adapter_bank[32])          # would need a's pages: spared while young
    while engine.has_unfinished():
        engine.step()
    engine.adapters.step += engine.config.min_resident_steps  # no longer young
    engine.load_adapter("b", adapter_bank[32])
    assert engine.adapters.get("a").evictions == 1
