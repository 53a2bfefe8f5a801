"""The decoder layers of a decode step in one C++ call (`decode_layers_cpu`) equal the Python loop
on the same CPU kernels (`LlamaModel.layers_`) bit for bit: the MLP output, the residual stream
and the KV pages they write, on every parity family (biases, tied embeddings, q/k norms, GQA),
in fp32 and bf16, with adapters of two ranks and the base mixed in the batch, past `max_rows()`
rows (torch's GEMM on weights [N, K], the kernel on packed ones) and in the build without
AVX-512; an engine's decode steps take it, and a step with a prefill row does not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lorafleet import Engine, SamplingParams
from lorafleet.kernels import backend, decode_layers_cpu
from tests.fixtures import ALL7, FAMILIES, build_adapter, build_model

# with LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI), load() raises instead: a broken build fails, never skips
# a string, read as each test starts: collecting the tree builds nothing (a session of unit tests builds no kernel)
pytestmark = pytest.mark.skipif("decode_layers_cpu.load() is None", reason="the kernel does not build here")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in FAMILIES:
        model = build_model(root / family, family)
        out[family] = (model, {r: build_adapter(model, root / f"{family}-r{r}", seed=r, r=r, lora_alpha=2 * r,
                                                target_modules=ALL7) for r in (4, 16)})
    return out


def decode_step_both_ways(engine: Engine, requests: int, reference: bool = False) -> dict:
    """Run `engine` until a decode-only step, and that step's layers both ways on copies of its
    residual stream and KV pages (the step itself then proceeds as usual); with `reference`, the
    loop once more on the torch reference kernels (`seen["torch"]`)."""
    model = engine.model
    seen: dict = {}
    real = model.forward

    def spy(input_ids, positions, attn, kv_cache, logits_rows, lora=None):
        if attn.num_decode == len(input_ids) == requests and not seen:
            x = model.kernels.rows(model.w["embed"], input_ids, model.w.get("embed_s"), model.dtype)
            cfg = model.cfg
            for way in ("loop", "call", "torch")[:3 if reference else 2]:
                xs, kv = x.clone(), kv_cache.clone()
                if way == "loop":
                    out = model.layers_(xs, positions, attn, kv, lora)
                elif way == "torch":
                    fast, model.kernels = model.kernels, backend.torch_kernels()
                    try:
                        out = model.layers_(xs, positions, attn, kv, lora)
                    finally:
                        model.kernels = fast
                else:
                    out = decode_layers_cpu.decode_layers(xs, model.decode_weights.layers, kv, model.cos, model.sin,
                                                          positions, attn, model.scale, cfg.rms_norm_eps,
                                                          cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, lora)
                seen[way] = (out, xs, kv)
            seen["lora"] = lora
        return real(input_ids, positions, attn, kv_cache, logits_rows, lora)

    model.forward = spy
    for _ in range(40):
        engine.step()
        if seen:
            return seen
    raise AssertionError("no decode-only step in 40 steps")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: the pool's pages seen as KV include adapters' row tables, whose int64 fields
    (-1: a plain module's epilogue) read as NaN floats, which no float comparison equals."""
    ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


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
def test_one_call_equals_the_python_loop_bit_for_bit(family_dirs, family, dtype, variant):
    model_dir, adapters = family_dirs[family]
    names = ["r4", None, "r16", "r4", None]
    engine = start(model_dir, adapters, dtype, names)
    assert engine.model.kernels.decode_forward is decode_layers_cpu.decode_forward
    seen = decode_step_both_ways(engine, len(names))
    seg = seen["lora"].seg  # r4 and r16 segments; the two base rows in none
    assert seg.shape[0] == 2 and (seg[:, 1] - seg[:, 0]).sum().item() == 3
    for a, b, what in zip(seen["loop"], seen["call"], ("MLP output", "residual stream", "KV pages")):
        assert a.dtype == getattr(torch, dtype) and same_bits(a, b), what


def test_past_max_rows_and_without_adapters(family_dirs):
    """70 decode rows (more than `max_rows()` on either instruction set: torch's GEMM on weights
    [N, K], the kernel's blocks of 64 rows on packed ones) on the base."""
    model_dir, adapters = family_dirs["llama"]
    seen = decode_step_both_ways(start(model_dir, adapters, "float32", [None] * 70), 70)
    assert seen["lora"] is None
    for a, b, what in zip(seen["loop"], seen["call"], ("MLP output", "residual stream", "KV pages")):
        assert same_bits(a, b), what


def test_the_engine_decodes_through_it_and_prefills_through_the_loop(family_dirs, monkeypatch):
    """On the CPU kernels every decode-only step makes one call and a step with prompt rows runs
    the Python loop; greedy tokens are the torch path's (which has no such call)."""
    model_dir, adapters = family_dirs["qwen2"]
    names = ["r16", None, "r4"]
    calls = {"call": 0, "loop": 0}
    real_call = decode_layers_cpu.decode_forward

    def call(*args):
        calls["call"] += 1
        return real_call(*args)

    monkeypatch.setattr(decode_layers_cpu, "decode_forward", call)
    tokens = {}
    for kernels in ("cpu", "torch"):
        monkeypatch.setenv("LORAFLEET_KERNELS", kernels)
        engine = start(model_dir, adapters, "float32", names)
        assert (engine.model.kernels.decode_forward is call) == (kernels == "cpu")
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


def test_a_pure_decode_batch_in_one_call_equals_the_general_builder(family_dirs):
    """The runner's pure decode steps take `decode_batch` (one C++ call) and get the `StepInputs`
    its general path builds: ids, positions, KV slots, context lengths, logits rows and block
    tables (as wide as the longest sequence needs: the general path's may be wider, and equal up
    to there); the prefill step does not take it; a sequence outside the table is refused."""
    import dataclasses

    model_dir, adapters = family_dirs["llama"]
    engine = start(model_dir, adapters, "float32", ["r4", None, "r16", None, "r4"])
    runner = engine.runner
    assert runner.model.kernels.decode_batch is decode_layers_cpu.decode_batch
    calls = []

    def counted(*args):
        calls.append(len(args[1]))
        return decode_layers_cpu.decode_batch(*args)

    fast_ops = runner.model.kernels = dataclasses.replace(runner.model.kernels, decode_batch=counted)
    general_ops = dataclasses.replace(fast_ops, decode_batch=None)
    real, compared, general_steps = runner.inputs, [], []

    def both(chunks, all_logits=False):
        before = len(calls)
        step = real(chunks, all_logits)
        runner.model.kernels = general_ops
        try:
            general = real(chunks, all_logits)
        finally:
            runner.model.kernels = fast_ops
        if len(calls) == before:  # the general path both times: a step with prompt rows
            assert any(c.num_tokens > 1 for c in chunks) and not step.pure_decode
            general_steps.append(len(chunks))
            return step
        for a, b in ((step.ids, general.ids), (step.positions, general.positions), (step.out_rows, general.out_rows),
                     (step.slot_pages, general.slot_pages), (step.slot_offsets, general.slot_offsets),
                     (step.lens, general.lens)):
            assert a.dtype == b.dtype == np.int64 and np.array_equal(a, b)
        assert step.num_decode == general.num_decode == len(chunks) and step.pure_decode and general.pure_decode
        width = step.tables.shape[1]
        assert width == int((step.positions // engine.kv.block_size).max()) + 1 <= general.tables.shape[1]
        assert np.array_equal(step.tables, general.tables[:, :width])
        compared.append(width)
        return step

    runner.inputs = both
    while engine.has_unfinished():
        engine.step()
    assert general_steps and len(compared) >= 6 and max(compared) >= 3  # contexts of 1 to 3 pages
    table = engine.kv.block_table
    with pytest.raises(RuntimeError, match="outside the block table"):
        decode_layers_cpu.decode_batch(table, [table.shape[0]], [0], [5], engine.kv.block_size)
    with pytest.raises(RuntimeError, match="outside the block table"):
        decode_layers_cpu.decode_batch(table, [0], [table.shape[1] * engine.kv.block_size], [5], engine.kv.block_size)


@pytest.mark.parametrize("family,dtype", [(f, "float32") for f in FAMILIES] + [("qwen3", "bfloat16")])
def test_the_forward_in_one_call_equals_the_python_forward_bit_for_bit(family_dirs, family, dtype):
    """`decode_forward` (embedding, layers, final norm, LM head in one call) gives the Python
    forward's logits and KV pages bit for bit, for every row and for a subset of the rows, with
    adapters of two ranks and the base in the batch; the engine's model takes it."""
    model_dir, adapters = family_dirs[family]
    names = ["r4", None, "r16", "r4", None]
    engine = start(model_dir, adapters, dtype, names)
    assert compare_decode_forward(engine, len(names), subset=[1, 3, 4]) == [len(names), 3]


def compare_decode_forward(engine, batch: int, subset: list[int] | None = None, steps: int = 40) -> list[int]:
    """Step `engine` until a decode-only step of `batch` rows, and there run the model's forward
    both ways, the Python loop and `decode_forward` in one call, on copies of the KV pages, for
    every row (and for the rows `subset` too): asserts the same logits and KV pages bit for bit.
    Returns the row counts compared."""
    import dataclasses

    model = engine.model
    assert model.kernels.decode_forward is decode_layers_cpu.decode_forward
    python_ops = dataclasses.replace(model.kernels, decode_forward=None)
    fast_ops, real, compared = model.kernels, model.forward, []

    def spy(input_ids, positions, attn, kv_cache, logits_rows, lora=None):
        if attn.num_decode == len(input_ids) == batch and not compared:
            for rows in (logits_rows, *([logits_rows[subset]] if subset else [])):
                got = {}
                for way, ops in (("python", python_ops), ("call", fast_ops)):
                    kv = kv_cache.clone()
                    model.kernels = ops
                    try:
                        got[way] = (real(input_ids, positions, attn, kv, rows, lora), kv)
                    finally:
                        model.kernels = fast_ops
                (a, kv_a), (b, kv_b) = got["python"], got["call"]
                assert a.dtype == b.dtype == torch.float32 and a.shape == (len(rows), model.cfg.vocab_size)
                assert same_bits(a, b) and same_bits(kv_a, kv_b)
                compared.append(len(rows))
        return real(input_ids, positions, attn, kv_cache, logits_rows, lora)

    model.forward = spy
    for _ in range(steps):
        engine.step()
        if compared:
            break
    return compared


def test_a_gguf_mix_with_group_offsets_runs_the_same_both_ways(tmp_path):
    """A GGUF file's affine types (Q4_K, Q4_1, Q5_K) hold group offsets, which each projection's
    `Kernels.linear` adds in its kernel: the call equals the loop bit for bit (the same kernels), and
    both equal the loop on the torch reference (each weight dequantized with its offsets, then
    F.linear) within 1e-5 of each row's largest magnitude (fp32 sums in another order, and the
    kernel rounding d * c + o once where the reference rounds the product, then the sum, through
    every layer: about 1e-6 here), where the offsets' term is a fifth of it and more."""
    from tests.unit.test_gguf import write_gguf
    from tests.unit.test_gguf_mixes import MIX, SHAPE

    import gguf

    model = build_model(tmp_path / "hf", "llama", **SHAPE)
    path = write_gguf(model, tmp_path / "mix.gguf", gguf.GGMLQuantizationType.Q4_K, types=MIX)
    engine = start(path, {}, "float32", [None] * 3)
    assert engine.model.offsets  # the mix has them
    seen = decode_step_both_ways(engine, 3, reference=True)
    for a, b in zip(seen["loop"], seen["call"]):
        assert same_bits(a, b)
    for want, got in zip(seen["torch"], seen["call"]):
        scale = want.abs().amax(-1, keepdim=True)
        assert ((got - want).abs() <= 1e-5 * scale).all(), float(((got - want).abs() / scale).max())
