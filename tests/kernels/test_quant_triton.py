"""The GPU quantized projection (kernels/quant_triton.py) computes `reference.linear(x, q, bias,
scales, offsets)`: every form (T = 1, decode, prefill), K split or not, int8 per channel and in
groups of 32, int4 in groups of 32, 64 and 128, fp32, bf16 and fp16 activations, with and without
a bias, with and without group offsets (a GGUF file's affine types); and the Triton backend serves
a quantized model with it, end to end, without ever dequantizing a whole weight.

Run under the Triton interpreter (TRITON_INTERPRET=1, set below unless the environment says
otherwise, before the kernel module is imported), shapes small for it; with TRITON_INTERPRET=0
on a CUDA machine the same tests check the compiled kernel.

Tolerances: fp32 activations, within 1e-5 of the sum of the terms' magnitudes (|x| @ |w|^T: the
same products summed in another order); bf16/fp16, within 1e-2 of the output's largest magnitude
(the reference rounds each dequantized weight to the activations' dtype before its GEMM and its
output once more; the kernel multiplies the exact codes and rounds once: they differ by about
two roundings of 2^-8).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lorafleet.kernels import quant_triton, reference  # noqa: E402
from lorafleet.model import quant  # noqa: E402

if os.environ["TRITON_INTERPRET"] in ("", "0") and not torch.cuda.is_available():
    pytest.skip("compiled Triton needs a GPU (set TRITON_INTERPRET=1)", allow_module_level=True)
DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] not in ("", "0") else "cuda"

NO_SPLIT = quant_triton.Config(waves=0)          # every launch writes y directly
MAX_SPLIT = quant_triton.Config(waves=10 ** 6)   # K split into as many ranges as it has steps


def weight(seed, n, k, scheme, group=None):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[:, :k // 3] *= 4                       # groups of different scales
    q, s = quant.quantize(w, scheme, group)
    return q.to(DEVICE), s.to(DEVICE)


def check(x, q, s, bias=None, config=None, offsets=None):
    got = quant_triton.linear(x, q, bias, s, offsets, config=config)
    want = reference.linear(x, q, bias, s, offsets)
    assert got.dtype == x.dtype and got.shape == want.shape and not torch.isnan(got).any()
    if x.dtype == torch.float32:
        terms = reference.dequantize(q, s).abs()
        if offsets is not None:  # each weight's terms |d * q| + |o|
            terms += offsets.abs().repeat_interleave(terms.shape[1] // offsets.shape[1], 1)
        mag = x.abs() @ terms.t() + (0 if bias is None else bias.abs())
        assert ((got - want).abs() <= 1e-5 * mag + 1e-6).all(), (got - want).abs().max().item()
    else:
        err = (got.float() - want.float()).abs().max().item()
        assert err <= 1e-2 * want.float().abs().max().item(), err
    return got


def acts(seed, t, k, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(t, k, generator=g).to(DEVICE, dtype)


SCHEMES = [("int8", None), ("int8", 32), ("int4", 32), ("int4", 64), ("int4", 128)]


@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("t", [1, 3, 16, 17, 40])
def test_each_form_matches_the_reference_fp32(scheme, group, t):
    k = 256 if group == 128 else 192      # 6 steps of 32 (3 of 64, 2 of 128), 1.5 tiles of 128 codes
    q, s = weight(t, 37, k, scheme, group)
    x = acts(t, t, k)
    bias = acts(t + 1, 1, 37)[0]
    check(x, q, s, bias if t % 2 else None)


@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("config", [NO_SPLIT, MAX_SPLIT], ids=["whole-k", "split-k"])
@pytest.mark.parametrize("t", [1, 5, 33])
def test_split_and_unsplit_k_agree_with_the_reference(scheme, group, config, t):
    k = {64: 192, 128: 384}.get(group, 160)   # 5 steps of 32: a tile of 256 codes cut short
    q, s = weight(7 * t, 61, k, scheme, group)
    x = acts(t, t, k)
    check(x, q, s, acts(2, 1, 61)[0], config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme,group", [("int8", None), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("t", [1, 6, 24])
def test_half_activations_give_their_dtype_within_a_rounding(dtype, scheme, group, t):
    q, s = weight(t, 45, 256, scheme, group)
    x = acts(t, t, 256, dtype)
    bias = acts(3, 1, 45, dtype)[0]
    check(x, q, s, bias if t > 1 else None)


@pytest.mark.parametrize("scheme,group", [("int4", 32), ("int4", 64), ("int8", 32), ("int8", 64)])
@pytest.mark.parametrize("config", [NO_SPLIT, MAX_SPLIT], ids=["whole-k", "split-k"])
@pytest.mark.parametrize("t,dtype", [(1, torch.float32), (5, torch.float32), (33, torch.float32),
                                     (1, torch.bfloat16), (6, torch.bfloat16), (24, torch.bfloat16)])
def test_group_offsets_are_added_in_the_kernel(scheme, group, config, t, dtype):
    """A GGUF file's affine types: offsets float32 [N, K / G], w = d * q + o, in every form, K split or not."""
    k = 192
    q, s = weight(3 * t, 29, k, scheme, group)
    offsets = 2 * acts(t + 5, 29, k // group)
    check(acts(t, t, k, dtype), q, s, acts(2, 1, 29, dtype)[0] if t > 1 else None, config, offsets)


def test_row_strided_activations_and_one_unrolled_tail():
    """x a row-strided view (as a step's rows can be); K = 96: one tile of 256 cut to 3 steps."""
    q, s = weight(3, 19, 96, "int4", 32)
    big = acts(4, 9, 200)
    check(big[:, 40:136], q, s)
    check(big[:1, 40:136], q, s)


def test_the_launch_depends_on_shapes_only_and_splits_a_thin_grid():
    """What a CUDA graph needs: the plan is host arithmetic on the shapes (and the SM count); a
    decode step on a wide GPU splits K, a long prefill does not."""
    cfg = quant_triton.CONFIG
    one = quant_triton.plan(1, 4096, 4096, 32, False, 132, cfg)
    assert one.block_m == 1 and one.splits > 1 and one.k_split % one.gk == 0 and one.k_split * one.splits >= 4096
    assert quant_triton.plan(8, 6144, 4096, 4096, False, 132, cfg).block_m == 16
    long = quant_triton.plan(2048, 14336 * 2, 4096, 32, False, 132, cfg)
    assert long.splits == 1 and long.block_m == 64
    # a step never crosses a group: GK divides G
    for g in (32, 64, 96, 128, 160, 4096):
        assert g % quant_triton.plan(1, 64, g * 2, g, False, 132, cfg).gk == 0


def test_misfit_shapes_are_refused():
    q, s = weight(0, 8, 64, "int4", 32)
    with pytest.raises(ValueError):
        quant_triton.linear(acts(0, 2, 128), q, None, s)
    with pytest.raises(TypeError):
        quant_triton.linear(acts(0, 2, 64).to(torch.int32), q, None, s)
    for offsets in (acts(0, 8, 2).half(), acts(0, 8, 1)):
        with pytest.raises(ValueError):
            quant_triton.linear(acts(0, 2, 64), q, None, s, offsets)
    assert quant_triton.linear(acts(0, 0, 64), q, None, s).shape == (0, 8)


def test_the_triton_backend_serves_quantized_weights_without_a_full_copy(monkeypatch):
    """`Kernels.linear` with scales runs this kernel: `reference.dequantize` (the full copy) is
    never called; without scales the weight goes to torch's GEMM as before."""
    from lorafleet.kernels import backend
    kernels = backend.triton_kernels()
    q, s = weight(5, 24, 128, "int8")
    x = acts(5, 3, 128)
    want = reference.linear(x, q, None, s)
    offsets = acts(7, 24, 1)
    want_offsets = reference.linear(x, q, None, s, offsets)

    def whole_copy(*a, **kw):
        raise AssertionError("a quantized weight was dequantized whole")
    monkeypatch.setattr(reference, "dequantize", whole_copy)
    got = kernels.linear(x, q, None, s)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kernels.linear(x, q, None, s, offsets), want_offsets, atol=1e-4, rtol=1e-4)
    w = acts(6, 24, 128)
    torch.testing.assert_close(kernels.linear(x, w), x @ w.t())


@pytest.mark.parametrize("scheme", ["int4", pytest.param("int8", marks=pytest.mark.heavy)])
def test_an_engine_quantized_on_the_triton_path_gives_the_torch_paths_tokens(scheme, tmp_path, monkeypatch):
    """`Engine(folder, quantize=...)` on the Triton kernels (interpreted) generates the greedy
    tokens of the torch reference path on the same quantized weights."""
    if DEVICE != "cpu":
        monkeypatch.setenv("LORAFLEET_DEVICE", "cuda")
    from lorafleet import Engine, SamplingParams
    from tests.fixtures import build_model

    folder = build_model(tmp_path, "llama")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11] * 3, [20, 21, 22], [30] * 17]
    tokens = {}
    for kernels in ("torch", "triton"):
        monkeypatch.setenv("LORAFLEET_KERNELS", kernels)
        engine = Engine(folder, pool_bytes=4 << 20, quantize=scheme)
        assert engine.model.kernels.name == kernels and engine.model.quantization == scheme
        tokens[kernels] = [o.token_ids for o in engine.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]


COMPILE = r'''
import re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from lorafleet.kernels import quant_triton as Q

ALIGNED = ("K", "QK", "SG", "G", "K_SPLIT", "stride_x", "stride_y", "N")  # as Llama's shapes are

def signature(kernel, dtype, codes, constexprs):
    types = {"q_ptr": codes, "s_ptr": "*fp16", "p_ptr": "*fp32"}
    return {n: "constexpr" if n in constexprs else types.get(n, "*" + dtype if n.endswith("_ptr") else "i32")
            for n in kernel.arg_names}

cases = set()
for dtype in ("bf16", "fp16", "fp32"):
    for cfg in Q.CANDIDATES if dtype == "bf16" else Q.CANDIDATES[:1]:
        for codes, int4 in (("*u8", True), ("*i8", False)):
            for t in (1, 8, 64, 512):
                for group in (32, 128, 4096):
                    lp = Q.plan(t, 4096, 4096, group, dtype == "fp32", 132, cfg)
                    cases.add((Q._qmm_kernel, dtype, codes, (("INT4", int4), ("HAS_BIAS", True), ("PARTIAL", lp.splits > 1),
                               ("UPCAST", dtype == "fp32"), ("BLOCK_M", lp.block_m), ("BLOCK_N", lp.block_n), ("GK", lp.gk),
                               ("W", lp.gk // 2 if int4 else lp.gk), ("SUB", lp.sub)), lp.warps, cfg.stages))
    cases.add((Q._sum_kernel, dtype, "*i8", (("HAS_BIAS", True), ("BLOCK", Q.SUM_BLOCK)), 4, 3))
spills = []
for kernel, dtype, codes, constexprs, warps, stages in sorted(cases, key=str):
    constexprs = dict(constexprs)
    sig = signature(kernel, dtype, codes, constexprs)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if sig[n].startswith("*") or n in ALIGNED}
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        info = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name, "-o", "/dev/null"],
                              capture_output=True, text=True, check=True).stderr
    spilled = int(re.search(r"(\d+) bytes spill stores", info).group(1))
    print(f"{kernel.__name__} {dtype} {codes} {constexprs} {warps} warps: {spilled} spills: ok")
    if spilled:
        spills.append(f"{kernel.__name__} {dtype} {codes} {constexprs}: {spilled} spills")
print(f"cases: {len(cases)}")
assert not spills, spills
'''


@pytest.mark.heavy  # compiles every launch of the kernel (each candidate in bf16) for sm_90
def test_every_launch_compiles_for_sm90_without_spilling(tmp_path):
    """What the interpreter does not check: the compiled bf16/fp16 dots, the layouts, registers.
    At the plans `linear` makes for Llama-3-8B's shapes at T = 1, 8, 64, 512 and groups 32, 128
    and a channel, on an H100's 132 SMs (test_triton_compile.py's method)."""
    import subprocess
    import sys
    from pathlib import Path
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", COMPILE], cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-4000:]
    cases = int(done.stdout.rsplit("cases: ", 1)[1])
    assert done.stdout.count(": ok") == cases > 0
