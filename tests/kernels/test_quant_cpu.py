"""The CPU matmul on quantized weights (`quant_cpu`, issue 51) against the reference (dequantize,
then F.linear): int8 per channel and in groups of 32, int4 in groups of 32, 64 and 128, fp32 and
bf16, with and without a bias, on every tile remainder of 1-70 rows (the kernel's tiles up to
`max_rows()`, the GEMM on blocks of dequantized rows beyond), odd N, K from one run to wide
(chunks of K); a GGUF file's affine types' group offsets (int4 and int8 codes, groups of 32 and 64)
added in the kernel on every path (the FMA tiles, the AMX tiles, the blocks past `max_rows()`); the
embedding's rows bit for bit; a quantized model's decode step in one C++ call equals the Python loop
bit for bit, and its greedy tokens equal the torch reference's. On every variant this CPU runs (`variant`).

Tolerances, per output element, of the sum of the terms' magnitudes S = |x| @ |dequantize(q)|^T:
fp32 1e-5 S (the same fp32 products summed in another order); bf16 2^-7 S (the reference rounds
each weight to bf16 before its GEMM, the kernel keeps it in fp32 or rounds it the same way: up to
2^-9 S apart, plus each side's rounding of the result to bf16). Where the build has AMX-BF16 (2-8 fp32 rows, 2-16
bf16 rows on its tiles) the same bounds hold: fp32 x goes as bf16 hi + lo (16 bits of its 24, about
2^-17 S), the weights exact (int8 per channel's codes; groups < K: the codes without their scale,
the scale in fp32 on each group's sums), bf16 x and the reference's bf16 weights are exact in the
tiles. The groups' tile path runs from 5 fp32 rows (`qt::GROUPS_FROM`, the FMA tiles below), up to 8:
its test takes 2-8 rows, across the switch wherever it lies. With offsets S counts each weight's terms,
|d * c| + |o| (the kernel rounds d * c + o once, the reference the product and then the sum), and the
same bounds hold; past `max_rows()` the weights are the reference's bit for bit."""

from __future__ import annotations

import pytest
import torch

from lorafleet import Engine, SamplingParams
from lorafleet.kernels import quant_cpu, reference
from lorafleet.model import quant
from tests.fixtures import build_model
from tests.kernels.test_decode_layers_cpu import compare_decode_forward

# with LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI), load() raises instead: a broken build fails, never skips
# a string, read as each test starts: collecting the tree builds nothing (a session of unit tests builds no kernel)
pytestmark = pytest.mark.skipif("quant_cpu.load() is None", reason="the kernel does not build here")

LAYOUTS = [("int8", None), ("int8", 32), ("int4", 32), ("int4", 64), ("int4", 128)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7}


def quantized(n: int, k: int, scheme: str, group: int | None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return quant.quantize(torch.randn(n, k, generator=g), scheme, group)


def affine(n: int, k: int, scheme: str, group: int, seed: int = 0):
    """Codes, scales and offsets as a GGUF file's affine types give them (`quant.from_affine`):
    each group's values scale * q + its minimum, q from 0 to 15 (int4, Q4_1 and Q4_K) or 31 (int8
    codes of Q5_1 and Q5_K's 5 bits); rows whose groups' means differ, so the offsets weigh."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) + 2 * torch.randn(n, k // group, generator=g).repeat_interleave(group, 1)
    levels, shift = (15, 8) if scheme == "int4" else (31, 16)
    groups = w.view(n, -1, group)
    lo, hi = groups.amin(-1), groups.amax(-1)
    d = (hi - lo) / levels
    q = ((groups - lo[..., None]) / d[..., None]).round().clamp(0, levels).view(n, k).long()
    return quant.from_affine(q, d, lo, scheme, shift)


def assert_close(y: torch.Tensor, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias, offsets=None):
    ref = reference.linear(x, q, bias, scales, offsets)
    assert y.dtype == x.dtype and y.shape == ref.shape
    bound = x.float().abs() @ reference.dequantize(q, scales).abs().t()
    if offsets is not None:  # each weight's terms |d * c| + |o|
        bound += x.float().abs() @ offsets.abs().repeat_interleave(quant.in_features(q) // offsets.shape[1], 1).t()
    if bias is not None:
        bound += bias.float().abs()
    err = (y.float() - ref.float()).abs()
    assert (err <= TOL[x.dtype] * bound + 1e-6).all(), float((err / (bound + 1e-6)).max())


@pytest.mark.parametrize("scheme,group", [("int8", 32), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("shape", [(37, 384), (67, 2048)])
def test_groups_on_the_amx_tiles(scheme, group, shape, variant):
    n, k = shape
    q, scales = quantized(n, k, scheme, group)
    g = torch.Generator().manual_seed(2)
    x, bias = torch.randn(8, k, generator=g), torch.randn(n, generator=g)
    for t in range(2, 9):  # the FMA tiles below GROUPS_FROM, the groups' tiles from it (amx)
        assert_close(quant_cpu.linear(x[:t], q, bias, scales), x[:t], q, scales, bias)


@pytest.mark.parametrize("scheme,group", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_the_reference_at_every_row_count(scheme, group, dtype, variant):
    n, k = 67, 384
    q, scales = quantized(n, k, scheme, group)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(70, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    assert quant_cpu.max_rows(dtype) < 70
    for t in range(1, 71):  # every remainder of the tiles, and past max_rows
        for b in (bias, None) if t <= 9 or t == 70 else (bias,):
            assert_close(quant_cpu.linear(x[:t], q, b, scales), x[:t], q, scales, b)


@pytest.mark.parametrize("scheme,group,shape", [(s, g, shape) for s, g in LAYOUTS
                                                 for shape in [(1, 32), (5, 64), (129, 4096), (33, 8192)]
                                                 if not g or shape[1] % g == 0])  # groups that divide K
def test_linear_on_narrow_and_wide_k(scheme, group, shape, variant):
    """One run of K, and K wide enough that the x rows go by chunks of K (x of more than 32 KB)."""
    n, k = shape
    q, scales = quantized(n, k, scheme, group, seed=n)
    g = torch.Generator().manual_seed(2)
    for t in (1, 3, 8, 11):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(t, k, generator=g).to(dtype)
            assert_close(quant_cpu.linear(x, q, None, scales), x, q, scales, None)


AFFINE = [("int4", 32), ("int4", 64), ("int8", 32), ("int8", 64)]


@pytest.mark.parametrize("scheme,group", AFFINE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offsets_are_added_in_the_kernel_on_every_path(scheme, group, dtype, variant):
    """Offsets on every path the row count picks: one row (FMA tiles), 2-9 (FMA or AMX tiles, fp32's
    groups' tiles from 5 rows), 16, 17 and past `max_rows()` (blocks of dequantized rows); with and
    without a bias; one group a row (G = K), K of 384, and K wide enough that x goes by chunks of K."""
    rows = [*range(1, 10), 16, 17, quant_cpu.max_rows(dtype) + 1]
    for n, k in ((5, group), (67, 384), (37, 10240)):
        q, scales, offsets = affine(n, k, scheme, group, seed=k)
        assert offsets is not None and offsets.dtype == torch.float32 and offsets.shape == scales.shape
        g = torch.Generator().manual_seed(k)
        x = torch.randn(max(rows), k, generator=g).to(dtype)
        bias = torch.randn(n, generator=g).to(dtype)
        for t in rows:
            for b in (bias, None):
                assert_close(quant_cpu.linear(x[:t], q, b, scales, offsets), x[:t], q, scales, b, offsets)


def test_linear_takes_strided_rows_and_refuses_bad_shapes():
    q, scales = quantized(40, 64, "int4", 32)
    x = torch.randn(4, 128)[:, :64]  # rows of stride 128
    assert_close(quant_cpu.linear(x, q, None, scales), x, q, scales, None)
    with pytest.raises(RuntimeError, match="features"):
        quant_cpu.linear(torch.randn(2, 32), q, None, scales)
    with pytest.raises(RuntimeError, match="scales"):
        quant_cpu.linear(torch.randn(2, 64), q, None, scales.float())
    with pytest.raises(RuntimeError, match="scales"):
        quant_cpu.linear(torch.randn(2, 64), q, None, scales[:, :1].repeat(1, 3).contiguous())
    for offsets in (torch.zeros(40, 2, dtype=torch.float16), torch.zeros(40, 1), torch.zeros(2, 40).t()):
        with pytest.raises(RuntimeError, match="offsets"):
            quant_cpu.linear(torch.randn(2, 64), q, None, scales, offsets)


@pytest.mark.parametrize("scheme,group", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_equal_the_reference_bit_for_bit(scheme, group, dtype, variant):
    q, scales = quantized(51, 256, scheme, group)
    ids = torch.tensor([0, 50, 7, 7, 23])
    got = quant_cpu.rows(q, ids, scales, dtype)
    assert got.dtype == dtype and torch.equal(got, reference.rows(q, ids, scales, dtype))
    with pytest.raises(RuntimeError, match="out of range"):
        quant_cpu.rows(q, torch.tensor([51]), scales, dtype)


# -- a quantized model ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-models")
    return {family: build_model(root / family, family) for family in ("llama", "qwen2")}  # untied, tied head


def start(model_dir, scheme: str, dtype: str, rows: int) -> Engine:
    engine = Engine(model_dir, pool_bytes=8 << 20, dtype=dtype, quantize=scheme)
    g = torch.Generator().manual_seed(rows)
    vocab = engine.model.cfg.vocab_size
    for i in range(rows):  # contexts of 3 to 40 tokens
        prompt = torch.randint(3, vocab, (3 + (i * 13) % 38,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    return engine


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("scheme", quant.SCHEMES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_forward_equals_the_python_forward_bit_for_bit(model_dirs, family, scheme, dtype, variant):
    """A quantized model's decode step in one C++ call (quantized projections, LM head, and the
    embedding's rows, tied to the head or not) gives the Python forward's logits and KV pages bit for bit."""
    engine = start(model_dirs[family], scheme, dtype, 5)
    model = engine.model
    assert model.quantization == scheme and model.layers[0].qkv_s is not None
    assert "embed_s" in model.w  # the embedding is quantized too (qwen2's is the head), its rows dequantized
    assert compare_decode_forward(engine, 5, steps=20) == [5]


@pytest.mark.parametrize("scheme", quant.SCHEMES)
def test_greedy_tokens_equal_the_torch_reference(model_dirs, scheme, monkeypatch):
    """Greedy tokens of a quantized model on the CPU kernels (decode steps in one call, prefill
    past `max_rows()` on dequantized blocks) equal the torch reference's, on both families."""
    for family in ("llama", "qwen2"):
        tokens = {}
        for kernels in ("cpu", "torch"):
            monkeypatch.setenv("LORAFLEET_KERNELS", kernels)
            engine = start(model_dirs[family], scheme, "float32", 4)
            assert engine.model.kernels.name == kernels
            outs = {}
            while engine.has_unfinished():
                for o in engine.step():
                    outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            tokens[kernels] = [outs[k] for k in sorted(outs)]
        assert tokens["cpu"] == tokens["torch"], family
