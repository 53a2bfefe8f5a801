"""The CPU LoRA kernel and the torch reference compute the same LoRA through row tables, and both
equal the dense computation (tests/kernels/lora_cases.py); the kernel in the build for this CPU
and on every other variant this CPU can execute (`variant`: other tile shapes)."""

from __future__ import annotations

import random

import pytest
import torch

from lorafleet.kernels import lora_cpu, reference
from tests.kernels.lora_cases import lora_case

# with LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI), load() raises instead: a broken build fails, never skips
# a string, read as each test starts: collecting the tree builds nothing (a session of unit tests builds no kernel)
pytestmark = pytest.mark.skipif("lora_cpu.load() is None", reason="the kernel does not build here")
OPS = {"cpu": lora_cpu.lora, "reference": reference.lora}  # "cpu": on every variant (`variant`)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("seed", range(6))
def test_random_heterogeneous_segments_on_scattered_pages(op, variant, seed):
    rng = random.Random(seed)
    outs = [rng.choice([8, 24, 96]) for _ in range(3)]
    n_seg = rng.randint(1, 12)
    ranks = [[rng.choice([0, 1, 3, 8, 24, 64]) for _ in range(3)] for _ in range(n_seg)]
    rows = [rng.choice([0, 1, 1, 2, 4, 5, 9]) for _ in range(n_seg)]  # decode, prefill and empty segments
    case = lora_case(seed, rng.choice([16, 40, 64]), outs, ranks, rows, page_elems=rng.choice([384, 512, 1040]))
    got = case.base.clone()
    OPS[op](*case.args(got))
    assert (got - case.expected).abs().max().item() < 1e-4
    assert torch.equal(got[~case.covered], case.base[~case.covered])


@pytest.mark.parametrize("rank", [1, 3, 8, 24, 64, 128, 256])
def test_every_rank_with_matrices_across_page_boundaries(rank, variant):
    case = lora_case(rank, 48, [32, 16, 16], [[rank, rank, 0], [0, 0, rank]], [1, 7], page_elems=528)
    got = case.base.clone()
    lora_cpu.lora(*case.args(got))
    assert torch.allclose(got, case.expected, atol=1e-4, rtol=1e-5)


def test_no_segments_and_empty_segments_change_nothing():
    case = lora_case(0, 16, [8, 8, 8], [[3, 0, 2]], [0])
    got = case.base.clone()
    lora_cpu.lora(*case.args(got))
    assert torch.equal(got, case.base)
    lora_cpu.lora(case.x, got, case.w, case.seg[:0], case.entry, case.slots)
    assert torch.equal(got, case.base)
    padding = torch.zeros(4, 5, dtype=torch.long)  # a captured step's unused segments: all zero
    lora_cpu.lora(case.x, got, case.w, padding, case.entry, case.slots)
    assert torch.equal(got, case.base)


def test_writes_into_a_wider_output_through_its_row_stride(variant):
    case = lora_case(3, 32, [16, 8, 8], [[4, 2, 0], [1, 0, 7]], [1, 6])
    wide = torch.randn(case.x.shape[0], 64)
    view = wide[:, :32]             # the group's output inside a larger buffer
    view.copy_(case.base)
    lora_cpu.lora(*case.args(view))
    assert (view - case.expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("seed", range(4))
def test_bf16_pools_sum_in_fp32_and_round_once_like_the_reference(seed, variant):
    rng = random.Random(seed)
    n_seg = rng.randint(1, 8)
    ranks = [[rng.choice([0, 1, 8, 24, 64]) for _ in range(3)] for _ in range(n_seg)]
    rows = [rng.choice([0, 1, 2, 5, 9]) for _ in range(n_seg)]
    case = lora_case(seed, 40, [24, 8, 96], ranks, rows, page_elems=rng.choice([688, 1040]), dtype=torch.bfloat16)
    got, ref = case.base.clone(), case.base.clone()
    lora_cpu.lora(*case.args(got))
    reference.lora(*case.args(ref))
    assert got.dtype == torch.bfloat16
    g, r = got.double(), ref.double()
    assert ((g - r).abs() <= r.abs() * 2 ** -7 + 1e-6).all()  # one bf16 step at most: the sum order
    assert ((g - case.expected.double()).abs() <= case.expected.double().abs() * 2 ** -6 + 2e-2).all()
    assert torch.equal(got[~case.covered], case.base[~case.covered])


@pytest.mark.parametrize("op", OPS)
def test_each_layer_and_group_reads_its_own_fields_of_the_row_tables(op, variant):
    # two slots (gate_up) in layer 2 of 3, then one slot (o) in layer 0: the entry picks the fields
    for slots, layer in ((2, 2), (1, 0)):
        case = lora_case(4, 40, [16, 24][:slots], [[4, 2][:slots], [0, 7][:slots], [9, 9][:slots]], [1, 5, 2],
                         layers=3, layer=layer)
        got = case.base.clone()
        OPS[op](*case.args(got))
        assert (got - case.expected).abs().max().item() < 1e-4


def _random_mixes(rng: random.Random, adapters: int, n_mix: int) -> tuple[list[list[tuple[int, float]]], list[int]]:
    """Mixes of 1-4 distinct adapters with scales in [-4, 4] (0 and 1 among them), and their rows."""
    mixes = [[(i, rng.choice([1.0, 0.0, 0.5, -1.5, 4.0, -4.0, 0.3]))
              for i in rng.sample(range(adapters), rng.randint(1, min(4, adapters)))] for _ in range(n_mix)]
    return mixes, [rng.choice([0, 1, 1, 2, 5, 9]) for _ in range(n_mix)]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("seed", range(6))
def test_mixes_sum_their_adapters_deltas_times_their_scales(op, variant, seed):
    # mixes of several adapters of mixed ranks (some lacking modules), beside lone segments
    rng = random.Random(seed)
    ranks = [[rng.choice([0, 1, 3, 8, 24, 64]) for _ in range(3)] for _ in range(6)]
    mixes, rows = _random_mixes(rng, len(ranks), rng.randint(1, 8))
    case = lora_case(seed, rng.choice([16, 40, 64]), [rng.choice([8, 24, 96]) for _ in range(3)], ranks, rows,
                     page_elems=rng.choice([512, 1040]), mixes=mixes)
    got = case.base.clone()
    OPS[op](*case.args(got))
    assert (got - case.expected).abs().max().item() < 1e-4
    assert torch.equal(got[~case.covered], case.base[~case.covered])


@pytest.mark.parametrize("seed", range(4))
def test_bf16_mixes_sum_in_fp32_and_round_once_like_the_reference(seed, variant):
    rng = random.Random(seed)
    ranks = [[rng.choice([0, 1, 8, 24, 64]) for _ in range(3)] for _ in range(5)]
    mixes, rows = _random_mixes(rng, len(ranks), rng.randint(1, 6))
    case = lora_case(seed, 40, [24, 8, 96], ranks, rows, dtype=torch.bfloat16, mixes=mixes)
    got, ref = case.base.clone(), case.base.clone()
    lora_cpu.lora(*case.args(got))
    reference.lora(*case.args(ref))
    g, r = got.double(), ref.double()
    assert ((g - r).abs() <= r.abs() * 2 ** -7 + 1e-6).all()  # one bf16 step at most: the sum order
    assert torch.equal(got[~case.covered], case.base[~case.covered])


def test_a_mix_of_one_adapter_at_scale_one_is_that_adapter_bit_for_bit(variant):
    # and a zero-scale partner changes nothing: each delta joins the output once, in fp32
    ranks = [[8, 24, 3], [64, 0, 8]]
    alone = lora_case(7, 40, [24, 8, 96], ranks, [1, 6], dtype=torch.bfloat16, mixes=[[(0, 1.0)], [(0, 1.0)]])
    paired = lora_case(7, 40, [24, 8, 96], ranks, [1, 6], dtype=torch.bfloat16,
                       mixes=[[(0, 1.0), (1, 0.0)], [(1, 0.0), (0, 1.0)]])
    a, b = alone.base.clone(), paired.base.clone()
    lora_cpu.lora(*alone.args(a))
    lora_cpu.lora(*paired.args(b))
    assert torch.equal(a, b) and not torch.equal(a, alone.base)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_epilogues_of_dora_and_lora_bias_beside_plain_adapters(op, variant, dtype):
    # decode and prefill segments (the one-row and the column expands), widths off the column block
    ranks = [[8, 0, 3], [4, 16, 0], [5, 5, 5], [24, 1, 0]]
    case = lora_case(11, 40, [24, 8, 136], ranks, [1, 6, 1, 9], dtype=dtype, posts=["dora", "bias", None, "dora"])
    got, ref = case.base.clone(), case.base.clone()
    OPS[op](*case.args(got))
    reference.lora(*case.args(ref))
    if dtype == torch.float32:
        assert (got - case.expected).abs().max().item() < 1e-4
    g, r = got.double(), ref.double()
    assert ((g - r).abs() <= r.abs() * 2 ** -7 + 1e-6).all()
    assert torch.equal(got[~case.covered], case.base[~case.covered])


def test_an_epilogue_is_read_on_lone_segments_only():
    # the same adapters in a mix: plain sums (the engine never mixes adapters with an epilogue)
    ranks = [[8, 0, 3], [4, 16, 0]]
    case = lora_case(12, 40, [24, 8, 40], ranks, [3], posts=["dora", "bias"], mixes=[[(0, 1.0), (1, 1.0)]])
    got = case.base.clone()
    lora_cpu.lora(*case.args(got))
    assert (got - case.expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("held", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(4))
def test_adapters_held_in_16_bits_under_fp32_x(op, variant, held, seed):
    # `--lora-dtype`: the pool's adapters in bf16 or fp16, x and the output fp32: each weight widened
    # exactly, so the sums are the fp32 sums of the rounded weights (the dense expectation rounds them
    # too); lone and mixed segments, decode and prefill rows, epilogues, pages of an odd size
    rng = random.Random(seed)
    ranks = [[rng.choice([0, 1, 3, 8, 24, 64]) for _ in range(3)] for _ in range(5)]
    rows = [rng.choice([0, 1, 1, 2, 5, 9]) for _ in range(len(ranks))]
    posts = [rng.choice([None, None, "dora", "bias"]) for _ in ranks]
    lone = lora_case(seed, 40, [24, 8, 136], ranks, rows, page_elems=rng.choice([1376, 2080]), held=held, posts=posts)
    mixes, mix_rows = _random_mixes(rng, len(ranks), rng.randint(1, 6))
    mixed = lora_case(seed, 64, [96, 8, 24], ranks, mix_rows, held=held, mixes=mixes)
    for case in (lone, mixed):
        assert case.w.dtype == held and case.x.dtype == torch.float32
        got = case.base.clone()
        OPS[op](*case.args(got))
        assert got.dtype == torch.float32
        assert (got - case.expected).abs().max().item() < 1e-4
        assert torch.equal(got[~case.covered], case.base[~case.covered])


def test_a_16_bit_pool_holds_its_own_dtype_only():
    case = lora_case(3, 16, [8, 8, 8], [[3, 0, 2]], [2], dtype=torch.bfloat16, held=torch.float16)
    with pytest.raises(RuntimeError, match="bfloat16 or float16 under float32 x"):
        lora_cpu.lora(*case.args(case.base.clone()))
