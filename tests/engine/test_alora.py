"""Activated LoRA (aLoRA, PEFT's `alora_invocation_tokens`): adapters of several ranks and targets
(rsLoRA, lora_bias, an LM-head LoRA) in one batch with a plain adapter and base requests give
PEFT's greedy tokens (its own `generate`, which finds the activation itself) and its prefill
logits (fp32), the rows before the activation the base's; with the prefix cache on and off, and
chunked prefill; the prefix cache reuses the base's blocks before the activation (by counts);
refusals name the field at fault."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from lorafleet import Engine, Mix, SamplingParams
from lorafleet.adapters.alora import FIELD, activation
from lorafleet.engine.request import Request
from lorafleet.errors import AdapterError, InvalidRequestError
from tests.engine.fleet_parity import prefill_logits
from tests.fixtures import ALL7, build_adapter, build_model, force_kernels, load_hf, load_peft

INV = [7, 8, 9]
ALORAS = {
    "alora-attn-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], alora_invocation_tokens=INV),
    "alora-rslora-r8": dict(r=8, lora_alpha=8, use_rslora=True, target_modules="all-linear",
                            alora_invocation_tokens=[30, 31]),
    "alora-bias-r6": dict(r=6, lora_alpha=12, target_modules=["k_proj", "gate_proj", "down_proj"], lora_bias=True,
                          alora_invocation_tokens=[40]),
    "alora-head-r2": dict(r=2, lora_alpha=4, target_modules=["o_proj", "lm_head"], alora_invocation_tokens=INV),
}
PLAIN = {"plain-r16": dict(r=16, lora_alpha=16, target_modules=ALL7)}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BS = 16


@pytest.fixture(scope="module", params=["llama", pytest.param("SmolLM2-135M", marks=pytest.mark.heavy)])
def fleet(request, tmp_path_factory):
    """The aLoRAs and the plain adapter on a tiny Llama; in the heavy tier on a real config too
    (SmolLM2's at 2 layers: tied embeddings, 9 heads, GQA 3)."""
    from tests.engine.conformance import build

    root = tmp_path_factory.mktemp("alora")
    base = build_model(root / "base", "llama") if request.param == "llama" else build(request.param, root / "base")
    adapters = {name: build_adapter(base, root / name, seed=i, b_std=0.3, **kw)
                for i, (name, kw) in enumerate({**ALORAS, **PLAIN}.items())}
    return base, adapters


def engine(fleet, **options) -> Engine:
    base, adapters = fleet
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    # a tied LM head's LoRA comes with the embedding PEFT saves beside it: a real vocabulary's needs room
    e = Engine(base, pool_bytes=(8 << 20) * (1 if vocab <= 4096 else 32), debug_checks=True, **options)
    for name, path in adapters.items():
        e.register_adapter(name, path)
    return e


def filler(n: int, rng: random.Random) -> list[int]:
    """Tokens that hold no invocation token (so each prompt's activation is where it is put)."""
    return [rng.randrange(50, 160) for _ in range(n)]


def placed(inv: list[int], seed: int) -> dict[str, list[int]]:
    """Prompts holding `inv`: twice, at the very start, at the very end, past two blocks."""
    rng = random.Random(seed)
    return {"twice": filler(5, rng) + inv + filler(6, rng) + inv + filler(4, rng),
            "start": inv + filler(9, rng),
            "end": filler(11, rng) + inv,
            "late": filler(37, rng) + inv + filler(3, rng)}


def requests(seed: int):
    """(adapter, prompt) for every aLoRA at every placement, the plain adapter and the base."""
    out = [(name, p) for i, (name, kw) in enumerate(ALORAS.items())
           for p in placed(kw["alora_invocation_tokens"], seed + i).values()]
    rng = random.Random(seed)
    return out + [("plain-r16", filler(13, rng)), (None, filler(17, rng)), (None, out[0][1])]


def peft_greedy(model, ids: list[int], n: int) -> list[int]:
    """PEFT's own generate (it computes the aLoRA offsets from the prompt itself), greedy, never stopping."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_activation_is_pefts_offset():
    """The start of the last occurrence: PEFT's offset counted from the end, on random prompts."""
    import peft
    from peft.tuners.lora.variants import calculate_alora_offsets

    rng = random.Random(0)
    for _ in range(300):
        inv = [rng.randrange(3) for _ in range(rng.randrange(1, 4))]
        prompt = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        cfg = {"a": peft.LoraConfig(alora_invocation_tokens=inv)}
        (offset,) = calculate_alora_offsets(cfg, "a", torch.tensor([prompt]))
        at = activation(prompt, tuple(inv))
        assert (at is None and offset is None) or len(prompt) - at == offset, (inv, prompt)
    assert activation([1, 1, 1], (1, 1)) == 1 and activation([5, 1], (1, 2)) is None


def test_a_runs_adapter_rows_start_at_each_requests_activation():
    """Chunks wholly before, holding and after an activation, and a plain request's, in one run."""
    from types import SimpleNamespace

    from lorafleet.engine.runner import adapter_rows

    def chunk(n, computed, act):
        return SimpleNamespace(num_tokens=n, request=SimpleNamespace(num_computed=computed, activation=act))

    run = [chunk(8, 0, 20), chunk(8, 16, 20), chunk(1, 30, 20), chunk(4, 0, None), chunk(6, 0, 0), chunk(5, 5, 7)]
    assert adapter_rows(run, 10) == [(22, 37), (39, 42)]  # 10-21 base, 22-36 on, 37-38 base, 39-41 on


def _kernels():
    """Every CPU variant this CPU runs, forced, and torch: the host's own in the default tier."""
    from lorafleet.kernels import cpu_module

    host = cpu_module.host_variant()
    return [pytest.param(k, marks=() if k == host else pytest.mark.heavy) for k in (*cpu_module.runnable(), "torch")]


@pytest.mark.parametrize("options", [{}, {"prefix_cache": False}, {"max_num_batched_tokens": 8},
                                     {"async_decode": "on", "decode_graphs": "fixed"}],
                         ids=["cache", "no-cache", "chunked", "async-fixed"])
@pytest.mark.parametrize("kernels", _kernels())
def test_alora_adapters_in_one_batch_with_plain_and_base_give_pefts_greedy_tokens(fleet, options, kernels,
                                                                                    monkeypatch):
    base, adapters = fleet
    force_kernels(monkeypatch, kernels)
    e = engine(fleet, **options)
    assert e.model.kernels.label == ("torch" if kernels == "torch" else f"cpu/{kernels}")
    reqs = requests(seed=3)
    if options.get("prefix_cache", True):  # the base answered every history first: its blocks are cached
        e.generate([p for _, p in reqs], GREEDY, adapters=[None] * len(reqs))
    outs = e.generate([p for _, p in reqs], GREEDY, adapters=[a for a, _ in reqs])
    plain = load_hf(base)
    refs = {name: load_peft(base, path) for name, path in adapters.items()}
    for (name, prompt), out in zip(reqs, outs):
        ref = peft_greedy(refs[name], prompt, GREEDY.max_tokens) if name else peft_greedy(plain, prompt, 12)
        assert out.token_ids == ref, (name, prompt)


def test_alora_prefill_logits_are_pefts_and_the_bases_before_the_activation(fleet):
    """Every row of one prefill step (all placements, a plain adapter, the base) within 1e-4 of
    PEFT's forward; an aLoRA's rows before its activation within 1e-4 of the base's, and from it on
    moved from them (the adapter really applies)."""
    base, adapters = fleet
    e = engine(fleet)
    for name in adapters:
        e.load_adapter(name, adapters[name])
    reqs = []
    for i, (name, prompt) in enumerate(requests(seed=5)):
        inv = ALORAS.get(name, {}).get("alora_invocation_tokens")
        reqs.append(Request(f"p{i}", prompt, SamplingParams(), name, loras=(e.adapters.get(name),) if name else (),
                            scales=(1.0,) if name else (), activation=activation(prompt, tuple(inv)) if inv else None))
    chunks, logits = prefill_logits(e, reqs)
    row, plain = 0, load_hf(base)
    for c in chunks:
        ours, name, ids = logits[row:row + c.num_tokens], c.request.adapter, c.request.prompt_token_ids
        row += c.num_tokens
        with torch.no_grad():
            ref = (load_peft(base, adapters[name]) if name else plain)(torch.tensor([ids])).logits[0]
            base_ref = plain(torch.tensor([ids])).logits[0]
        assert (ours - ref).abs().max().item() <= 1e-4, (name, ids)
        act = c.request.activation
        if act is not None:
            assert act == 0 or (ours[:act] - base_ref[:act]).abs().max().item() <= 1e-4, (name, ids)
            assert (ours[act:] - base_ref[act:]).abs().max().item() > 1e-3, f"{name} changes nothing"


def test_an_alora_call_after_the_base_reuses_the_bases_blocks_before_its_activation(fleet):
    rng = random.Random(9)
    history = filler(70, rng)                     # blocks 0-3 wholly before the activation (at 70)
    asked = history + INV + filler(5, rng)
    e, fresh = engine(fleet), engine(fleet, prefix_cache=False)
    e.generate([history], GREEDY)                 # the base answers the conversation so far
    before = e.kv.hit_tokens
    out = e.generate([asked], GREEDY, adapters=["alora-attn-r4"])[0]
    assert e.kv.hit_tokens - before == 4 * BS == out.metrics["cached_tokens"]
    assert out.token_ids == fresh.generate([asked], GREEDY, adapters=["alora-attn-r4"])[0].token_ids
    # another aLoRA on the same history finds the base's blocks too; a plain adapter finds none
    other = history + [30, 31] + filler(3, rng)
    assert e.generate([other], GREEDY, adapters=["alora-rslora-r8"])[0].metrics["cached_tokens"] == 4 * BS
    assert e.generate([asked], GREEDY, adapters=["plain-r16"])[0].metrics["cached_tokens"] == 0
    # the same aLoRA call again: its own blocks from the activation on as well (all but the last token's)
    again = e.generate([asked], GREEDY, adapters=["alora-attn-r4"])[0]
    assert again.metrics["cached_tokens"] == (len(asked) - 1) // BS * BS and again.token_ids == out.token_ids
    # counted: the three aLoRA requests and what the cache served them, not the base's nor the plain one's
    assert e.stats()["alora"] == {"requests": 3, "reused_tokens": 8 * BS + again.metrics["cached_tokens"]}


def test_block_keys_follow_the_activation(fleet):
    """The same tokens: blocks wholly before the activation keyed as the base's, the block holding it
    and those after by the adapter and the activation's place in that block."""
    e = engine(fleet)
    e.load_adapter("alora-attn-r4", fleet[1]["alora-attn-r4"])
    entry, tokens = e.adapters.get("alora-attn-r4"), filler(64, random.Random(2))

    def keys(act, adapter=True):
        req = Request(f"k{act}{adapter}", tokens, GREEDY, loras=(entry,) if adapter else (),
                      scales=(1.0,) if adapter else (), activation=act if adapter else None)
        return e.kv._chain(req, 4)

    base, at20, at21, at16 = keys(None, adapter=False), keys(20), keys(21), keys(16)
    assert at20[0] == base[0] == at16[0] and at20[1] != base[1]
    assert at20[1] != at21[1] and at20[1] != at16[1] and at20[3] != at21[3]
    assert keys(0)[0] != base[0] and keys(None)[0] != base[0]  # from the start: the adapter's chain


def test_a_prompt_without_the_invocation_sequence_is_refused_naming_it(fleet):
    e = engine(fleet)
    for prompt in ([60, 61, 62], [60, 7, 8], [9, 8, 7, 60]):
        with pytest.raises(InvalidRequestError, match=FIELD) as caught:
            e.add_request(prompt, GREEDY, adapter="alora-attn-r4")
        assert caught.value.param == "prompt" and "[7, 8, 9]" in str(caught.value)
    assert not e.requests and not e.adapters.get("alora-attn-r4").users


def test_an_alora_serves_alone_in_a_mix(fleet):
    e = engine(fleet)
    prompt = placed(INV, 1)["twice"]
    for mix in (Mix.of({"alora-attn-r4": 1.0, "plain-r16": 0.5}), Mix.of({"alora-attn-r4": 0.5})):
        with pytest.raises(InvalidRequestError, match="aLoRA") as caught:
            e.add_request(prompt, GREEDY, adapter=mix)
        assert caught.value.param == "adapters"
    alone = e.generate([prompt], GREEDY, adapters=[Mix.of({"alora-attn-r4": 1.0})])[0]
    assert alone.token_ids == e.generate([prompt], GREEDY, adapters=["alora-attn-r4"])[0].token_ids
    # a plain mix whose aLoRA member is at scale 0 is no aLoRA: any prompt
    e.generate([[60, 61]], GREEDY, adapters=[Mix.of({"plain-r16": 1.0, "alora-attn-r4": 0.0})])


def test_snapshot_shows_the_invocation_tokens_registered_or_loaded_eagerly(fleet):
    e = engine(fleet)
    e.load_adapter("eager", fleet[1]["alora-rslora-r8"])  # a new name: staged, then installed
    info = {a["name"]: a for a in e.list_adapters()}
    assert info["alora-attn-r4"]["invocation_tokens"] == INV and "invocation_tokens" not in info["plain-r16"]
    assert info["eager"]["invocation_tokens"] == [30, 31]
    with pytest.raises(InvalidRequestError, match=FIELD):
        e.add_request(INV + [60], GREEDY, adapter="eager")


def edited(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes,field", [
    ({FIELD: "7 8 9"}, FIELD), ({FIELD: [7, -1]}, FIELD), ({FIELD: [7, True]}, FIELD), ({FIELD: [7, 8.0]}, FIELD),
    ({FIELD: "the base's vocabulary size"}, FIELD), ({FIELD: [1] * 257}, FIELD), ({FIELD: [7], "use_dora": True}, "use_dora"),
    ({FIELD: [7], "modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({FIELD: [7], "target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
], ids=["string", "negative", "bool", "float", "out-of-vocab", "too-long", "dora", "saved-modules", "embedding"])
def test_bad_alora_configs_are_refused_naming_the_field(fleet, tmp_path, changes, field):
    e = engine(fleet)
    if changes[FIELD] == "the base's vocabulary size":  # the first id past it
        changes = {FIELD: [json.loads((fleet[0] / "config.json").read_text())["vocab_size"]]}
    folder = edited(fleet[1]["alora-attn-r4"], tmp_path / "bad", **changes)
    with pytest.raises(AdapterError, match=field):
        e.register_adapter("bad", folder)


def test_a_null_or_empty_invocation_is_plain_lora_as_in_peft(fleet, tmp_path):
    e = engine(fleet)
    for i, value in enumerate((None, [])):
        folder = edited(fleet[1]["plain-r16"], tmp_path / f"p{i}", **{FIELD: value})
        e.register_adapter(f"p{i}", folder)
        assert "invocation_tokens" not in e.list_adapters()[-1]
        e.generate([[60, 61]], GREEDY, adapters=[f"p{i}"])


def test_through_the_daemons_app_an_alora_answers_as_in_process_and_a_prompt_without_it_is_a_400(fleet):
    import asyncio

    from lorafleet.deploy.inprocess import InProcessServer

    e = engine(fleet)
    prompt = placed(INV, 4)["twice"]
    want = e.generate([prompt], GREEDY, adapters=["alora-attn-r4"])[0].token_ids
    server = InProcessServer(e, "base", fleet[0])
    try:
        for stream in (False, True):
            body = {"model": "alora-attn-r4", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True, "stream": stream}
            status, _, raw = asyncio.run(server.call("POST", "/v1/completions", json.dumps(body).encode()))
            assert status == 200, raw
            if stream:
                chunks = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
                got = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]
            else:
                got = json.loads(raw)["choices"][0]["token_ids"]
            assert got == want, stream
        body = {"model": "alora-attn-r4", "prompt": [60, 61, 62], "max_tokens": 4}
        status, _, raw = asyncio.run(server.call("POST", "/v1/completions", json.dumps(body).encode()))
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == "prompt" and FIELD in error["message"], raw
        status, _, raw = asyncio.run(server.call("GET", "/metrics"))
        counted = [ln for ln in raw.decode().splitlines() if ln.startswith("lorafleet_alora_requests_total")]
        assert counted[0].endswith(" 3.0"), counted  # the one in process and the two answered; not the refused one
    finally:
        server.close()
