"""Adapters with their own embedding and LM head: LoRA on `embed_tokens` / `lm_head` and full
copies of them (`modules_to_save`), alone and in one batch with plain adapters of other ranks and
base requests: greedy tokens and logits as PEFT computes them (fp32)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import peft
import pytest
import torch

from lorafleet import Engine, Mix, SamplingParams
from lorafleet.errors import AdapterError, InvalidRequestError
from tests.engine.fleet_parity import (assert_held_prefill_within_tolerance, assert_one_batch_gives_peft_greedy_tokens,
                                      assert_one_prefill_gives_peft_logits)
from tests.engine.test_parity import hf_greedy, prompts_of_lengths
from tests.fixtures import ALL7, build_adapter, build_chat_model, build_model, load_hf, load_peft, registered_fleet

HEADS = {
    "lora-embed-head-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "embed_tokens", "lm_head"]),
    "saves-head-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "o_proj"], modules_to_save=["lm_head"]),
    "saves-both-r6": dict(r=6, lora_alpha=12, target_modules=ALL7, modules_to_save=["embed_tokens", "lm_head"]),
    "head-lora-only-r2": dict(r=2, lora_alpha=4, target_modules=["lm_head"]),
    "saves-norms-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj"],  # every norm, under any PEFT
                           modules_to_save=["input_layernorm", "post_attention_layernorm", "norm"]),
    "plain-r16": dict(r=16, lora_alpha=16, target_modules=ALL7),
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # qwen2: a tied embedding and LM head
def fleet(request, tmp_path_factory):
    return registered_fleet(tmp_path_factory.mktemp(f"heads-{request.param}"), request.param, HEADS)


def test_every_head_adapter_in_one_batch_gives_peft_greedy_tokens(fleet):
    assert_one_batch_gives_peft_greedy_tokens(fleet, HEADS, seed=21)


def test_every_head_adapter_in_one_prefill_gives_peft_logits(fleet):
    assert_one_prefill_gives_peft_logits(fleet, HEADS, seed=22)


def test_head_adapters_held_in_bf16_stay_within_the_stated_tolerance_of_peft(fleet):
    # their own embedding, LM head and norms read from 16-bit pages into fp32 activations
    base, adapters, _ = fleet
    assert_held_prefill_within_tolerance(base, adapters, "bfloat16", seed=23)


# -- an adapter with its own vocabulary ---------------------------------------------------------

ADDED = ["<|tool|>", "<|end_tool|>"]


def vocab_adapter(base: Path, folder: Path, added=ADDED, rows: int | None = None, tokenizer: bool = True) -> Path:
    """A PEFT adapter trained after adding tokens: its embedding and LM head resized to `rows`
    (default: the tokenizer's size) and saved whole (modules_to_save), its tokenizer beside it."""
    import peft
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    tok.add_special_tokens(added)
    torch.manual_seed(3)
    model = load_hf(base)
    model.resize_token_embeddings(rows or tok.get_vocab_size(), mean_resizing=False)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                    modules_to_save=["embed_tokens", "lm_head"]))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
            elif "modules_to_save" in name:
                p.add_(torch.randn_like(p), alpha=0.1)
    pm.save_pretrained(folder, safe_serialization=True)
    if tokenizer:
        tok.save(str(folder / "tokenizer.json"))
        cfg = json.loads((base / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "<|end_tool|>"}))
    return folder


@pytest.fixture(scope="module")
def vocab_fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    base = build_chat_model(root / "base")
    return base, vocab_adapter(base, root / "tools")


def test_an_adapter_with_added_tokens_is_served_with_its_own_tokenizer(vocab_fleet):
    base, folder = vocab_fleet
    engine = Engine(base, pool_bytes=8 << 20, debug_checks=True)
    info = engine.register_adapter("tools", folder)
    engine.register_adapter("tools2", folder)
    vocab = engine.model.cfg.vocab_size
    assert info["vocab_size"] == vocab + len(ADDED)
    tok = engine.tokenizer_for("tools")
    assert tok is not engine.tokenizer and engine.tokenizer_for(None) is engine.tokenizer
    text = "hello <|tool|> world"
    ids = tok.encode(text)
    assert vocab in ids  # the added token, past the base's vocabulary
    with pytest.raises(InvalidRequestError, match=rf"\[0, {vocab}\)"):  # the base does not know it
        engine.add_request(ids, SamplingParams(max_tokens=1))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    base_ids = engine.tokenizer.encode("hello world")
    outs = engine.generate([text, base_ids], params, adapters=["tools", None])
    ref = load_hf(base)
    ref.resize_token_embeddings(vocab + len(ADDED), mean_resizing=False)
    ref = peft.PeftModel.from_pretrained(ref, folder).eval()
    assert outs[0].token_ids == hf_greedy(ref, ids, 16)
    assert outs[1].token_ids == hf_greedy(load_hf(base), base_ids, 16)
    assert outs[0].text == tok.decode(outs[0].token_ids)
    # its tokenizer's end token stops it (the base's does not know it)
    end = tok.token_to_id("<|end_tool|>")
    forced = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[]),
                             adapters=["tools"])[0]
    assert end not in forced.token_ids[:-1]
    with pytest.raises(InvalidRequestError, match="modules_to_save.*serves alone"):
        engine.add_request(base_ids, SamplingParams(max_tokens=1), adapter=Mix.of({"tools": 1.0, "tools2": 0.5}))
    # loaded eagerly (never registered lazily): its inspection on the load worker brings the same
    assert engine.load_adapter("eager", folder)["vocab_size"] == vocab + len(ADDED)
    assert engine.tokenizer_for("eager").encode(text) == ids
    assert engine.generate([text], params, adapters=["eager"])[0].token_ids == outs[0].token_ids


@pytest.mark.parametrize("case", ["tokenizer-larger", "no-tokenizer", "huge-tokenizer-config"])
def test_an_adapter_whose_vocabulary_and_tokenizer_disagree_is_refused(vocab_fleet, tmp_path, case):
    base, _ = vocab_fleet
    engine = Engine(base, pool_bytes=8 << 20)
    vocab = engine.model.cfg.vocab_size
    if case == "tokenizer-larger":
        folder = vocab_adapter(base, tmp_path / case, added=[*ADDED, "<|extra|>"], rows=vocab + 2)
        named = f"tokenizer has {vocab + 3} token ids but its saved embedding / LM head {vocab + 2} rows"
    elif case == "no-tokenizer":
        folder = vocab_adapter(base, tmp_path / case, tokenizer=False)
        named = f"tokenizer.json: missing; its saved embedding / LM head has {vocab + 2} rows, the base's vocabulary {vocab}"
    else:  # parsed holding the GIL on a worker: bounded first
        folder = vocab_adapter(base, tmp_path / case)
        (folder / "tokenizer_config.json").write_text(json.dumps({"x": "y" * (5 << 20)}))
        named = "tokenizer_config.json: over 4 MiB"
    with pytest.raises(AdapterError, match=re.escape(named)):
        engine.register_adapter(case, folder)
    assert engine.list_adapters() == []


def test_saved_module_adapters_through_a_pool_holding_a_tenth_of_them_equal_solo_runs(tmp_path):
    """20 adapters that save the LM head (and one the embedding too) through a pool with room for
    2 of them at a time: every output is its solo run's, and each adapter was evicted and loaded
    again as the others needed the pages."""
    base = build_model(tmp_path / "base")
    n = 20
    folders = {f"s{i}": build_adapter(base, tmp_path / f"s{i}", seed=i, r=2 + i % 3, lora_alpha=4,
                                      target_modules=["q_proj", "v_proj"],
                                      modules_to_save=["embed_tokens", "lm_head"] if i % 5 == 0 else ["lm_head"])
               for i in range(n)}
    prompts = prompts_of_lengths([4 + i % 7 for i in range(2 * n)], seed=23)
    names = [f"s{i % n}" for i in range(2 * n)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    solo = Engine(base, pool_bytes=8 << 20)
    for name, folder in folders.items():
        solo.register_adapter(name, folder)
    expected = [solo.generate([p], params, adapters=[a])[0].token_ids for p, a in zip(prompts, names)]

    sizing = Engine(base, pool_bytes=8 << 20)
    pages = max(sizing.adapters.pages_needed(sizing.adapters.register(a, f)) for a, f in folders.items())
    kv_pages = 4 * sizing.kv.blocks_needed(10 + 12)  # a few requests' KV beside the adapters
    page_bytes = sizing.pool.page_bytes
    engine = Engine(base, pool_bytes=(n // 10 * pages + kv_pages) * page_bytes, debug_checks=True)
    assert engine.pool.num_pages < (n // 10 + 1) * pages + kv_pages  # room for 2 adapters, not 3
    for name, folder in folders.items():
        engine.register_adapter(name, folder)
    outs = engine.generate(prompts, params, adapters=names)
    assert [o.token_ids for o in outs] == expected
    info = {a["name"]: a for a in engine.list_adapters()}
    assert all(a["saved_modules"] for a in info.values())
    assert sum(a["evictions"] for a in info.values()) >= n - 2
    assert all(a["device_loads"] >= 1 for a in info.values())


def test_every_variant_and_head_adapter_in_one_batch_gives_peft_greedy_tokens(tmp_path):
    """DoRA, lora_bias, rsLoRA, LoRA on the embedding and the LM head, saved copies and saved
    norms, beside plain adapters of other ranks and a base request: one batch, PEFT's tokens."""
    from tests.engine.test_variants import VARIANTS

    every = {**VARIANTS, **HEADS}
    assert_one_batch_gives_peft_greedy_tokens(registered_fleet(tmp_path, "llama", every), every, seed=24)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_saved_copies_on_a_quantized_base_are_served_at_full_precision(tmp_path, scheme):
    """On a quantized base an adapter's own LM head and norms are its full-precision copies, as
    PEFT on the dequantized base computes them."""
    from tests.engine.test_quantized import dequantized_

    base = build_model(tmp_path / "base")
    engine = Engine(base, pool_bytes=8 << 20, quantize=scheme)
    prompt = prompts_of_lengths([9], seed=25)[0]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for i, name in enumerate(("saves-head-r8", "saves-norms-r4")):
        folder = build_adapter(base, tmp_path / name, seed=i, **HEADS[name])
        engine.register_adapter(name, folder)
        out = engine.generate([prompt], params, adapters=[name])[0]
        assert out.token_ids == hf_greedy(dequantized_(load_peft(base, folder), scheme), prompt, 16), name


def test_head_adapters_through_the_daemons_app_answer_as_in_process(fleet):
    """The daemon's routes (in this process: `InProcessServer`), streamed and not: each adapter
    with its own embedding, LM head or norms answers with the engine's own greedy tokens."""
    import asyncio

    from lorafleet.deploy.inprocess import InProcessServer

    base, adapters, _ = fleet
    engine = Engine(base, pool_bytes=8 << 20)
    for name, folder in adapters.items():
        engine.register_adapter(name, folder)
    prompt = prompts_of_lengths([7], seed=26)[0]
    want = {name: engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                                  adapters=[name])[0].token_ids for name in HEADS}
    server = InProcessServer(engine, "base", base)
    try:
        for i, name in enumerate(HEADS):
            body = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "logprobs": 1, "stream": i % 2 == 1}
            status, _, raw = asyncio.run(server.call("POST", "/v1/completions", json.dumps(body).encode()))
            assert status == 200, raw
            if body["stream"]:  # a base without a tokenizer: chunks carry the tokens' ids
                chunks = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
                got = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]
            else:
                got = json.loads(raw)["choices"][0]["token_ids"]
            assert got == want[name], name
    finally:
        server.close()


def test_saved_copies_equal_to_the_base_are_dropped_at_load_stored_or_not(fleet, tmp_path):
    """PEFT saves the embedding and LM head whole beside an embedding LoRA: equal to the base's,
    they are dropped at load (fewer pages than the header planned; the parity tests above still
    hold), from a folder and from the store's laid-out file alike. Trained copies are kept."""
    import shutil

    from lorafleet.adapters.adapter import BaseShapes, load_adapter
    from lorafleet.memory.host_cache import build_host_adapter
    from lorafleet.adapters.layout import LAYOUT_FILE, save

    base, adapters, engine = fleet
    for name in ("lora-embed-head-r4", "saves-both-r6"):
        engine.load_adapter(name, adapters[name])
    defaults, trained = engine.adapters.get("lora-embed-head-r4"), engine.adapters.get("saves-both-r6")
    assert {"embed_a", "lm_head_a"} <= defaults.heads.parts.keys() and not {"embed", "lm_head"} & defaults.heads.parts.keys()
    assert defaults.numel < engine.adapters.inspect("x", adapters["lora-embed-head-r4"]).numel
    assert {"embed", "lm_head"} <= trained.heads.parts.keys()
    assert trained.numel == engine.adapters.inspect("y", adapters["saves-both-r6"]).numel
    assert defaults.saved == ("embed_tokens", "lm_head")  # what the files declare
    assert defaults.info()["saved_modules"] == [] and trained.info()["saved_modules"] == ["embed_tokens", "lm_head"]

    folder = tmp_path / "stored"
    shutil.copytree(adapters["lora-embed-head-r4"], folder)
    shapes, page = BaseShapes.from_model_config(engine.model.cfg), engine.pool.page_elems
    adapter = load_adapter(folder, shapes)
    save(folder / LAYOUT_FILE, adapter, shapes, page)
    stored = build_host_adapter(folder, shapes, page, torch.float32, False, adapter.digest, engine.model.base_rows)
    loaded = build_host_adapter(folder, shapes, page, torch.float32, False, None, engine.model.base_rows)
    assert stored.layout == loaded.layout and torch.equal(stored.buffer, loaded.buffer)
    assert not {"embed", "lm_head"} & stored.layout.parts.keys()
