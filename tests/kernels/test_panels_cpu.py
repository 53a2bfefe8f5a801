"""fp32 weights packed into panels (AVX2, and AMD CPUs with AVX-512; `panels_cpu`) are laid out
in their own storage, give `F.linear`'s products within 1e-5 relative at every row count without
torch's GEMM, and refuse what they cannot serve; an fp32 model packs its projections and LM head,
a tied embedding with its head (its rows read out of the panels), an untied one never."""

from __future__ import annotations

import pytest
import torch

from lorafleet import Engine
from lorafleet.kernels import cpu_module, linear_cpu, panels_cpu
from tests.fixtures import build_model
from tests.kernels.test_linear_cpu import ROWS, exact

# with LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI), load() raises instead: a broken build fails, never skips
# a string, read as each test starts: collecting the tree builds nothing (a session of unit tests builds no kernel)
pytestmark = pytest.mark.skipif("panels_cpu.load() is None", reason="the kernels do not build here")


def test_pack_lays_a_weight_out_as_panels_in_its_own_storage(variant):
    """Panels of 16 outputs with AVX2, of 32 with AVX-512 in AMD's layout; none in Intel's, where
    they did not pay (the weight stays [N, K])."""
    pw = panels_cpu.load().panel_width()
    assert pw == {"avx2": 16, "avx512-panels": 32}.get(variant, 0)
    w = torch.randn(96, 37)
    before, ptr = w.clone(), w.data_ptr()
    packed = panels_cpu.pack(w)
    if not pw:
        assert packed is w and torch.equal(w, before)
        return
    assert packed.shape == (96 // pw, 37, pw) and packed.data_ptr() == ptr  # no memory added
    assert torch.equal(packed, before.view(96 // pw, pw, 37).transpose(1, 2))
    for other in (torch.randn(pw + 8, 37), torch.randn(96, 37).bfloat16(), torch.randn(96, 74)[:, ::2]):
        assert panels_cpu.pack(other) is other  # N not a multiple of the width, bf16, not contiguous


GEMMS = {"aten::linear", "aten::mm", "aten::addmm", "aten::matmul", "mkldnn::_linear_pointwise"}


@pytest.mark.parametrize("n, k", [(32, 1), (32, 33), (96, 100), (64, 513), (224, 1536), (32, 4100)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_panels_equal_the_exact_product_within_1e_5_at_every_row_count(n, k, bias, variant):
    """Every pass shape and its rest (4, 6 or 8 rows), then past `max_rows()` and past a block of
    64 rows (prefill): still the kernel on the panels, never torch's GEMM on a copy."""
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = panels_cpu.pack(w.clone())
    assert packed.dim() == (3 if panels_cpu.load().panel_width() else 2)
    for t in ROWS + [65, linear_cpu.max_rows() + 1, 137]:
        x = torch.randn(t, k, generator=g)
        with torch.profiler.profile() as prof:
            got = linear_cpu.linear(x, packed, b)
        if packed.dim() == 3:
            assert not {e.name for e in prof.events()} & GEMMS, t
        scale = (x.double().abs() @ w.double().abs().T).max().item() + 1e-30
        assert got.shape == (t, n) and (got.double() - exact(x, w, b)).abs().max().item() <= 1e-5 * scale, (t, n, k)


@pytest.mark.heavy  # the build without AVX-512
def test_packed_weights_refuse_what_they_cannot_serve():
    mod = cpu_module.load("avx2")  # a build with panels of 16, whatever this CPU has
    packed = torch.randn(32, 16).view(2, 16, 16).transpose(1, 2).contiguous()
    with pytest.raises(RuntimeError, match="packed w"):
        mod.linear(torch.randn(2, 15), packed, None, None, None)
    with pytest.raises(RuntimeError, match="packed w is float32"):
        mod.linear(torch.randn(2, 16).bfloat16(), packed.bfloat16(), None, None, None)
    with pytest.raises(RuntimeError, match="bias"):
        mod.linear(torch.randn(2, 16), packed, torch.randn(31), None, None)
    with pytest.raises(RuntimeError, match="packed w"):
        mod.linear(torch.randn(2, 16), torch.randn(2, 16, 8), None, None, None)  # panels of another width


@pytest.mark.parametrize("tied", [True, False])
def test_an_fp32_model_packs_its_projections_and_head_and_the_embedding_only_as_its_head(tmp_path, variant, tied):
    """The projections and the LM head are packed; the embedding too where it is the head (one
    storage), read by rows out of the panels (`rows`); an untied embedding stays [V, H]."""
    engine = Engine(build_model(tmp_path, "llama", tie_word_embeddings=tied), pool_bytes=4 << 20)
    w, dim = engine.model.w, 3 if panels_cpu.load().panel_width() else 2  # every N here is a multiple of 32
    assert [w[f"layers.{i}.{n}"].dim() for i in range(2) for n in ("qkv", "o", "gate_up", "down")] == [dim] * 8
    assert w["lm_head"].dim() == dim
    assert (w["lm_head"] is w["embed"]) if tied else w["embed"].dim() == 2
    assert engine.model.kernels.rows is panels_cpu.rows


def test_rows_reads_an_embedding_out_of_its_panels(variant):
    """`rows` is `w[ids]` whether w is [N, K] or packed (a tied embedding); an id out of range is
    refused with it, as indexing refuses it."""
    w = torch.randn(96, 37)
    ids = torch.tensor([0, 5, 31, 32, 95, 64, 64])
    packed = panels_cpu.pack(w.clone())
    assert packed.dim() == (3 if panels_cpu.load().panel_width() else 2)
    for t in (w, packed):
        assert torch.equal(panels_cpu.rows(t, ids), w[ids])
        assert panels_cpu.rows(t, ids[:0]).shape == (0, 37)
        with pytest.raises(IndexError, match="out of"):
            panels_cpu.rows(t, torch.tensor([3, 96]))
