"""The CPU decode matmul computes `F.linear`: within 1e-5 relative in fp32 and within bf16's
rounding in bf16, on odd shapes, every tile remainder, x rows wide enough to go by chunks of K,
strided rows and with biases, on every CPU kernel variant this CPU can execute (`variant`:
other tile shapes and layouts); past `max_rows()` rows it is torch's GEMM itself; and the engine on it gives
the torch path's greedy tokens on every parity family and on the demo fleet. (Weights packed
into panels: `test_panels_cpu.py`.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lorafleet import Engine, SamplingParams
from lorafleet.engine.request import Request
from lorafleet.engine.scheduler import Chunk
from lorafleet.kernels import build, linear_cpu
from tests.fixtures import ALL7, FAMILIES, assert_demo_fleet_matches_torch, build_adapter, build_model

# with LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI), load() raises instead: a broken build fails, never skips
# a string, read as each test starts: collecting the tree builds nothing (a session of unit tests builds no kernel)
pytestmark = pytest.mark.skipif("linear_cpu.load() is None", reason="the kernel does not build here")

ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 24, 31, 64]  # every tile and remainder shape, to max_rows()
# (N, K); with AVX-512, 6-8 rows of 1,536 and 2 or more of 4,100 and 6,000 go by chunks of K (`run`)
SHAPES = [(1, 1), (5, 15), (7, 16), (13, 17), (97, 33), (64, 100), (33, 513), (200, 1536), (37, 4100), (9, 6000)]


AMD_LAYOUT = ("avx2", "avx512-panels")  # the variants built with AMD's layout (`cpu_module.FLAGS`)


def exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The product in float64 of the same (possibly bf16) values: the error-free answer."""
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_equals_the_exact_product_within_1e_5(n, k, bias, variant):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    for t in ROWS:
        x = torch.randn(t, k, generator=g)
        got = linear_cpu.linear(x, w, b)
        ref = exact(x, w, b)
        assert got.dtype == torch.float32 and got.shape == (t, n)
        scale = (x.double().abs() @ w.double().abs().T).max().item() + 1e-30
        assert (got.double() - ref).abs().max().item() <= 1e-5 * scale, (t, n, k)
        assert (got - F.linear(x, w, b)).abs().max().item() <= 1e-5 * scale


@pytest.mark.parametrize("n, k", SHAPES)
def test_bf16_rounds_the_fp32_sum_once(n, k, variant):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    for t in ROWS:
        x = torch.randn(t, k, generator=g).bfloat16()
        got = linear_cpu.linear(x, w, b)
        ref = exact(x, w, b)
        assert got.dtype == torch.bfloat16
        # one rounding to bf16 (half an ulp: 2^-9 relative) plus fp32 accumulation error
        slack = (x.double().abs() @ w.double().abs().T) * 1e-6 + b.double().abs() * 1e-6
        assert ((got.double() - ref).abs() <= ref.abs() * 2 ** -8 + slack).all(), (t, n, k)


def test_rows_with_a_stride_and_columns_with_one(variant):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=g)
    wide = torch.randn(6, 50, generator=g)
    x = wide[:, 3:27]                      # rows 50 apart: read in place
    assert linear_cpu.linear(x, w).sub(F.linear(x, w)).abs().max().item() < 1e-5
    xt = torch.randn(24, 6, generator=g).T  # column-major: copied first
    assert linear_cpu.linear(xt, w).sub(F.linear(xt, w)).abs().max().item() < 1e-5
    assert linear_cpu.linear(torch.randn(0, 24), w).shape == (0, 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_past_max_rows_it_is_torchs_gemm_onednns_in_fp32_in_amds_layout(variant, dtype):
    """Past `max_rows()` rows (prefill): torch's `linear`, or in fp32 in AMD's layout oneDNN's GEMM
    (faster there than torch's MKL), which gives the product within 1e-5 relative."""
    onednn = variant in AMD_LAYOUT and dtype == torch.float32
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(40, 96, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    x = torch.randn(linear_cpu.max_rows(dtype) + 3, 96, generator=g).to(dtype)
    for bias in (None, b):
        with torch.profiler.profile() as prof:
            y = linear_cpu.linear(x, w, bias)
        ops = {e.name for e in prof.events()}
        assert ("mkldnn::_linear_pointwise" in ops) == onednn and ("aten::linear" in ops) == (not onednn)
        if onednn:
            scale = (x.double().abs() @ w.double().abs().T).max().item()
            assert (y.double() - exact(x, w, bias)).abs().max().item() <= 1e-5 * scale
        else:
            assert torch.equal(y, F.linear(x, w, bias))


def test_where_torchs_gemm_takes_over_per_variant(variant):
    """Where torch's GEMM takes over, per variant: 64 rows without AVX-512 (on the AMD host it was
    measured on, torch's GEMM ran at about half the kernel's rate up to there), and in fp32 in
    AMD's layout with AVX-512 (the same there), else 24; in bf16, 12 with AMX (torch's bf16 GEMM
    runs on its tiles, where the kernel grants this process their state)."""
    amx = variant == "amx" and linear_cpu.max_rows(torch.bfloat16) == 12
    assert linear_cpu.max_rows() == {"avx2": 64, "avx512": 24, "avx512-panels": 64, "amx": 24}[variant]
    assert linear_cpu.max_rows(torch.bfloat16) == (12 if amx else 64 if variant == "avx2" else 24)


def test_mismatched_inputs_are_refused_with_the_reason():
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="differ in dtype"):
        linear_cpu.linear(torch.randn(2, 16, dtype=torch.float64), w)
    with pytest.raises(RuntimeError, match=r"x \[T, K\] and w \[N, K\]"):
        linear_cpu.linear(torch.randn(2, 15), w)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        linear_cpu.linear(torch.randn(2, 16).half(), w.half())


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# a prefill of 92 rows (past max_rows() in both builds: torch's GEMM, or the kernel on packed weights),
# then decode steps on the kernel
PROMPTS = [[5, 6, 7, 8, 9, 10, 11] * 10, [20, 21, 22], [30] * 17, [40, 41]]


def greedy(kernels: str, monkeypatch, folder, **options):
    monkeypatch.setenv("LORAFLEET_KERNELS", kernels)
    engine = Engine(folder, pool_bytes=4 << 20, **options)
    assert engine.model.kernels.name == kernels
    return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)], engine


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gives_the_torch_paths_tokens(family, tmp_path, monkeypatch):
    folder = build_model(tmp_path, family)
    got, engine = greedy("cpu", monkeypatch, folder)
    assert engine.model.kernels.linear is linear_cpu.linear
    assert got == greedy("torch", monkeypatch, folder)[0]


def test_bf16_models_run_on_the_kernel(llama_dir, monkeypatch):
    """bf16 weights on the kernel (a 12-token prefill, then decode steps): the logits are the
    torch path's within bf16 noise."""
    ids = list(range(5, 17))
    logits = {}
    for kernels in ("cpu", "torch"):
        monkeypatch.setenv("LORAFLEET_KERNELS", kernels)
        engine = Engine(llama_dir, pool_bytes=4 << 20, dtype="bfloat16")
        assert (engine.model.kernels.linear is linear_cpu.linear) == (kernels == "cpu")
        req = Request("bf16", ids, SamplingParams())
        engine.kv.grow(req.request_id, len(ids))
        logits[kernels] = engine.runner.execute([Chunk(req, len(ids))], all_logits=True).float()
    assert (logits["cpu"] - logits["torch"]).abs().max().item() < 0.05


def test_bf16_mixed_adapters_match_the_torch_path(llama_dir, tmp_path, monkeypatch):
    """A bf16 engine, one prefill batch mixing two adapters of different ranks and the base: the
    CPU kernels (matmul, row-wise ops, LoRA over bf16 pages) give the torch path's logits within
    bf16 noise, and each adapter visibly moves its rows."""
    adapters = {f"r{r}": build_adapter(llama_dir, tmp_path / f"r{r}", seed=r, r=r, lora_alpha=4 * r,
                                       target_modules=ALL7) for r in (4, 16)}
    names = ["r4", None, "r16", "r4"]
    logits = {}
    for kernels in ("cpu", "torch"):
        monkeypatch.setenv("LORAFLEET_KERNELS", kernels)
        engine = Engine(llama_dir, pool_bytes=8 << 20, dtype="bfloat16")
        for name, path in adapters.items():
            engine.load_adapter(name, path)
        reqs = [Request(f"q{i}", PROMPTS[0][:9], SamplingParams(), a,
                            loras=(engine.adapters.get(a),) if a else (), scales=(1.0,) if a else ())
                for i, a in enumerate(names)]
        chunks = [Chunk(r, len(r.prompt_token_ids)) for r in reqs]  # kept in this order: rows line up
        for c in chunks:
            engine.kv.grow(c.request.request_id, c.num_tokens)
        logits[kernels] = engine.runner.execute(chunks, engine.runner.lora_batch(chunks), all_logits=True).float()
    scale = logits["torch"].abs().max().item()
    assert (logits["cpu"] - logits["torch"]).abs().max().item() < 0.02 * scale
    rows = logits["cpu"].view(len(names), 9, -1)
    assert (rows[0] - rows[1]).abs().max().item() > 0.1 * scale  # r4 and the base: same prompt, other answer


def test_the_demo_fleet_answers_through_the_kernel(monkeypatch):
    """The base and four skills in one batch: the torch path's tokens, the skills' answers."""
    assert_demo_fleet_matches_torch("cpu", monkeypatch, skills=4, max_tokens=12)
