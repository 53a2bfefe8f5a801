"""The decoder layers of a decode step in one C++ call (`decode_layers_cpu`) equal the Python loop
on the same CPU kernels (`LlamaModel.layers_`) bit for bit: the MLP output, the residual stream
and the KV pages they write, on every parity family (biases, tied embeddings, q/k norms, GQA),
in fp32 and bf16, with adapters of two ranks and the base mixed in the batch, past `max_rows()`
rows (torch's GEMM) and in the build without AVX-512; an engine's decode steps take it, and a
step with a prefill row does not."""

from __future__ import annotations

import pytest
import torch

from lorafleet import Engine, SamplingParams
from lorafleet.kernels import decode_layers_cpu
from tests.fixtures import ALL7, FAMILIES, build_adapter, build_model

# with LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI), load() raises instead: a broken build fails, never skips
pytestmark = pytest.mark.skipif(decode_layers_cpu.load() is None, reason="the kernel does not build here")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in FAMILIES:
        model = build_model(root / family, family)
        out[family] = (model, {r: build_adapter(model, root / f"{family}-r{r}", seed=r, r=r, lora_alpha=2 * r,
                                                target_modules=ALL7) for r in (4, 16)})
    return out


def decode_step_both_ways(engine: Engine, requests: int) -> dict:
    """Run `engine` until a decode-only step, and that step's layers both ways on copies of its
    residual stream and KV pages (the step itself then proceeds as usual)."""
    model = engine.model
    seen: dict = {}
    real = model.forward

    def spy(input_ids, positions, attn, kv_cache, logits_rows, lora=None):
        if attn.num_decode == len(input_ids) == requests and not seen:
            x = model.w["embed"][input_ids]
            cfg = model.cfg
            for way in ("loop", "call"):
                xs, kv = x.clone(), kv_cache.clone()
                if way == "loop":
                    out = model.layers_(xs, positions, attn, kv, lora)
                else:
                    out = model.kernels.decode_layers(xs, model.flat_layers, kv, model.cos, model.sin, positions,
                                                      attn, model.scale, cfg.rms_norm_eps, cfg.num_heads,
                                                      cfg.num_kv_heads, cfg.head_dim, lora)
                seen[way] = (out, xs, kv)
            seen["lora"] = lora
        return real(input_ids, positions, attn, kv_cache, logits_rows, lora)

    model.forward = spy
    for _ in range(40):
        engine.step()
        if seen:
            return seen
    raise AssertionError("no decode-only step in 40 steps")


def start(model_dir, adapters: dict, dtype: str, names: list) -> Engine:
    engine = Engine(model_dir, pool_bytes=16 << 20, dtype=dtype)
    for r, path in adapters.items():
        engine.load_adapter(f"r{r}", path)
    g = torch.Generator().manual_seed(len(names))
    vocab = engine.model.cfg.vocab_size
    for i, name in enumerate(names):  # contexts of 3 to 40 tokens: one page and several
        prompt = torch.randint(3, vocab, (3 + (i * 13) % 38,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), adapter=name)
    return engine


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_call_equals_the_python_loop_bit_for_bit(family_dirs, family, dtype, isa):
    model_dir, adapters = family_dirs[family]
    names = ["r4", None, "r16", "r4", None]
    engine = start(model_dir, adapters, dtype, names)
    assert engine.model.kernels.decode_layers is decode_layers_cpu.decode_layers
    seen = decode_step_both_ways(engine, len(names))
    seg = seen["lora"].seg  # r4 and r16 segments; the two base rows in none
    assert seg.shape[0] == 2 and (seg[:, 1] - seg[:, 0]).sum().item() == 3
    for a, b, what in zip(seen["loop"], seen["call"], ("MLP output", "residual stream", "KV pages")):
        assert a.dtype == getattr(torch, dtype) and torch.equal(a, b), what


def test_past_max_rows_and_without_adapters(family_dirs):
    """70 decode rows (more than `max_rows()` on either instruction set: torch's GEMM) on the base."""
    model_dir, adapters = family_dirs["llama"]
    seen = decode_step_both_ways(start(model_dir, adapters, "float32", [None] * 70), 70)
    assert seen["lora"] is None
    for a, b, what in zip(seen["loop"], seen["call"], ("MLP output", "residual stream", "KV pages")):
        assert torch.equal(a, b), what


def test_the_engine_decodes_through_it_and_prefills_through_the_loop(family_dirs, monkeypatch):
    """On the CPU kernels every decode-only step makes one call and a step with prompt rows runs
    the Python loop; greedy tokens are the torch path's (which has no such call)."""
    model_dir, adapters = family_dirs["qwen2"]
    names = ["r16", None, "r4"]
    calls = {"call": 0, "loop": 0}
    real_call = decode_layers_cpu.decode_layers

    def call(*args):
        calls["call"] += 1
        return real_call(*args)

    monkeypatch.setattr(decode_layers_cpu, "decode_layers", call)
    tokens = {}
    for kernels in ("cpu", "torch"):
        monkeypatch.setenv("LORAFLEET_KERNELS", kernels)
        engine = start(model_dir, adapters, "float32", names)
        assert (engine.model.kernels.decode_layers is call) == (kernels == "cpu")
        if kernels == "cpu":
            real_loop = engine.model.layers_

            def loop(*args):
                calls["loop"] += 1
                return real_loop(*args)

            monkeypatch.setattr(engine.model, "layers_", loop)
        outs, steps = {}, 0
        while engine.has_unfinished():
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            steps += 1
        tokens[kernels] = [outs[k] for k in sorted(outs)]
        if kernels == "cpu":
            assert calls["loop"] >= 1 and calls["call"] >= 7 and calls["loop"] + calls["call"] == steps
    assert tokens["cpu"] == tokens["torch"]
