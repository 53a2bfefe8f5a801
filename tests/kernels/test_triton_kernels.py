"""The Triton kernels (kernels/lora_triton.py, kernels/attention_triton.py) compute exactly the torch
references' semantics.

CI has no GPU: these tests run the kernels under the Triton interpreter (TRITON_INTERPRET=1, set
below unless the environment says otherwise, before the kernel modules are imported: triton picks
interpreted or compiled when a kernel is decorated), which executes every program of the grid on
CPU torch tensors; shapes are kept small for that reason. With TRITON_INTERPRET=0 on a CUDA
machine the same tests check the compiled kernels on the GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from lorafleet.kernels import attention_triton, lora_triton, reference  # noqa: E402
from tests.kernels import lora_cases as cases  # noqa: E402

if os.environ["TRITON_INTERPRET"] in ("", "0") and not torch.cuda.is_available():
    pytest.skip("compiled Triton needs a GPU (set TRITON_INTERPRET=1)", allow_module_level=True)
DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] not in ("", "0") else "cuda"

# the three slowest interpreted cases' bf16 runs are heavy: the default tier checks bf16's rounding
# in their own tests (`..._in_bf16_is_rounded_once`) and on the other cases
BF16_HEAVY = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.heavy)]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-2, rtol=2e-2)}


# -- LoRA through row tables ------------------------------------------------------------------

DESIGNS = {c.design: c for c in reversed(lora_triton.CANDIDATES)}  # each design, at its first candidate's config


def lora_case(seed, fan_in, outs, ranks, rows, *, E=1024, dtype=torch.float32, gaps=True, pad_cols=0, **kw):
    """tests/kernels/lora_cases.py's case on DEVICE."""
    return cases.lora_case(seed, fan_in, outs, ranks, rows, page_elems=E, dtype=dtype, gaps=gaps, pad_cols=pad_cols,
                           device=DEVICE, **kw)


def check_lora(case, design="split", **bounds):
    """The op as the engine calls it: with its group's `out_align`."""
    ref, got = case.base.clone(), case.base.clone()
    reference.lora(*case.args(ref))
    lora_triton.lora(*case.args(got), config=DESIGNS[design], out_align=case.out_align, **bounds)
    assert not torch.isnan(got).any()
    if case.x.dtype == torch.float32:
        # fp32 sums in another order (the interpreter's matmuls on this CPU): within 1e-5 of the
        # sum of the terms' magnitudes, which a rank-256 row exceeds by far its absolute 1e-5
        mag = case.base.abs()
        reference.lora(case.x.abs(), mag, _abs_weights(case), _abs_scales(case.seg), case.entry, case.slots)
        assert ((got - ref).abs() <= 1e-5 * mag).all(), (got - ref).abs().max().item()
    else:
        torch.testing.assert_close(got.float(), ref.float(), **TOL[case.x.dtype])
    assert torch.equal(got[~case.covered], case.base[~case.covered]), "rows in no segment must stay untouched"
    return got


def _abs_scales(seg):
    """The segments with each scale's magnitude (its fp32 sign bit cleared)."""
    seg = seg.clone()
    seg[:, 3] &= 0x7FFFFFFF
    return seg


def _abs_weights(case):
    """The pool with every weight's magnitude, the epilogues' rows g and c included (its row tables
    kept: they are int64 words, not weights)."""
    w = case.w.clone()
    wi = reference.as_int64(case.w)
    F = reference.TABLE_FIELDS
    for _, end, table, _, _ in case.seg.tolist():
        for m in range(case.slots):
            r, n_out, _, a_rows, b_rows, g_row, c_row = wi[table + case.entry + F * m:][:F].tolist()
            posts = torch.tensor([g_row, c_row] if g_row >= 0 else [], dtype=torch.long, device=w.device)
            for ptrs, n in ((wi[a_rows:a_rows + r], case.x.shape[1]), (wi[b_rows:b_rows + r], n_out), (posts, n_out)):
                idx = (ptrs[:, None] + torch.arange(n, device=w.device)).reshape(-1)
                w[idx] = w[idx].abs()
    return w


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("rank", [1, 3, 8, 24, 64, 128, 256])
def test_lora_each_rank_matches_reference(design, rank):
    # rank in two of three module slots, a different one in the third; 1 row and 5 rows
    case = lora_case(rank, 40, [32, 16, 48], [[rank, 0, rank], [5, rank, rank]], [1, 5], E=1024)
    check_lora(case, design)


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize(("outs", "align"), [([32, 16, 48], 16), ([20, 12, 4], 4), ([6, 10, 14], 2), ([7, 9, 5], 1)])
def test_lora_out_align_divides_the_groups_columns_and_moves_none(design, outs, align):
    """The engine's `out_align` (`group_shapes`: the power of two dividing every width and first
    column) rounds each slot's n_out and col to itself, a no-op; one that does not divide them
    (8 on columns aligned to 4 or less) moves columns: the rounding is what the kernels read."""
    case = lora_case(61, 40, outs, [[8, 3, 5], [16, 0, 2]], [1, 5], dtype=torch.bfloat16)
    assert case.out_align == align
    check_lora(case, design)
    if align < 8:
        ref, wrong = case.base.clone(), case.base.clone()
        reference.lora(*case.args(ref))
        lora_triton.lora(*case.args(wrong), config=DESIGNS[design], out_align=8)
        assert not torch.allclose(wrong.float(), ref.float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lora_half_dtypes(design, dtype):
    case = lora_case(7, 64, [32, 24, 40], [[8, 3, 0], [64, 64, 64], [1, 0, 17]], [3, 1, 18], dtype=dtype)
    check_lora(case, design)


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("held", [torch.bfloat16, torch.float16])
def test_lora_adapters_held_in_16_bits_under_fp32_x(design, held):
    # `--lora-dtype`: the pool's adapters in 16 bits, x and out fp32 (the loads upcast)
    case = lora_case(9, 64, [32, 24, 40], [[8, 3, 0], [64, 64, 64], [1, 0, 17]], [3, 1, 18], E=2048, held=held,
                     posts=[None, "dora", "bias"])
    assert case.w.dtype == held and case.x.dtype == torch.float32
    check_lora(case, design)
    half = lora_case(9, 16, [8, 8, 8], [[3, 0, 2]], [2], dtype=torch.bfloat16, held=torch.float16)
    with pytest.raises(TypeError, match="16-bit under float32 x"):
        lora_triton.lora(*half.args(half.base.clone()))


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_many_adapters_of_mixed_ranks_in_one_batch(design, dtype):
    rng = random.Random(12)
    ranks = [[rng.choice([0, 1, 3, 8, 16, 24, 64]) for _ in range(3)] for _ in range(12)]
    ranks[3] = [0, 0, 0]  # an adapter targeting none of this group's modules
    rows = [rng.choice([0, 1, 1, 2, 4, 17]) for _ in range(12)]
    case = lora_case(12, 48, [32, 16, 16], ranks, rows, dtype=dtype, pad_cols=8)
    check_lora(case, design)


@pytest.mark.parametrize("dtype", BF16_HEAVY)
def test_lora_long_rows_are_reduced_by_several_programs(dtype):
    # in = 2 k_split + 48: three shrink programs write partials for one row, the last a partial slice
    fan_in = 2 * lora_triton.CONFIG.k_split + 48
    case = lora_case(21, fan_in, [32, 16, 48], [[16, 0, 3], [1, 64, 8], [24, 24, 24]], [1, 17, 4], dtype=dtype,
                     E=2048)
    assert torch.equal(check_lora(case), check_lora(case))  # partials summed in a fixed order: the same bits
    check_lora(case, max_rows=32, max_rank=256)
    check_lora(case, "fused")


@pytest.mark.parametrize("design", DESIGNS)
def test_lora_each_layer_and_group_reads_its_own_fields(design):
    for slots, layer in ((2, 2), (1, 0), (3, 1)):
        case = lora_case(32 + slots, 48, [32, 16, 24][:slots], [[8, 3, 5][:slots], [0, 24, 1][:slots]], [1, 4],
                         layers=3, layer=layer)
        check_lora(case, design)


@pytest.mark.parametrize("design", DESIGNS)
def test_lora_matrices_across_many_small_pages(design):
    # pages of 128 elements: every matrix spans pages, rows are moved to the next page's start
    case = lora_case(3, 40, [24, 40], [[24, 7], [3, 0], [128, 128]], [2, 3, 4], E=256, layers=1, layer=0)
    check_lora(case, design)


def test_lora_single_token():
    case = lora_case(5, 32, [32], [[8]], [1], gaps=False)
    for design in DESIGNS:
        check_lora(case, design)


def test_lora_strided_views():
    case = lora_case(9, 48, [32, 32, 32], [[8, 8, 8], [3, 0, 24]], [4, 2], pad_cols=16)
    assert case.x.stride(0) != case.x.shape[1] and case.base.stride(0) != case.base.shape[1]
    for design in DESIGNS:
        check_lora(case, design)


@pytest.mark.parametrize("design", DESIGNS)
def test_lora_without_adapters_changes_nothing(design):
    config = DESIGNS[design]
    case = lora_case(1, 32, [32, 16], [[4, 4]], [3])
    got = case.base.clone()
    lora_triton.lora(case.x, got, case.w, case.seg[:0], case.entry, case.slots, config=config)
    lora_triton.lora(case.x, got, case.w, case.seg[:0], case.entry, case.slots, 8, 16, config=config)
    # a captured step's unused segments: all-zero rows (end <= start, mix 0)
    padding = torch.zeros(4, reference.SEG_FIELDS, dtype=torch.long, device=DEVICE)
    lora_triton.lora(case.x, got, case.w, padding, case.entry, case.slots, 16, 16, config=config)
    assert torch.equal(got, case.base)
    # segments whose adapters lack every module of the group, and empty segments
    case = lora_case(2, 32, [32, 16], [[0, 0], [0, 0], [5, 3]], [3, 2, 0])
    got = case.base.clone()
    lora_triton.lora(*case.args(got), config=config)
    lora_triton.lora(*case.args(got), 16, 32, config=config)
    assert torch.equal(got, case.base)


@pytest.mark.parametrize("design", DESIGNS)
def test_lora_static_bounds_larger_than_needed_give_the_same_result(design):
    case = lora_case(4, 40, [32, 16, 24], [[3, 24, 0], [8, 8, 8], [1, 0, 0]], [2, 0, 7])
    first = check_lora(case, design)
    second = check_lora(case, design, max_rows=40, max_rank=200, max_n_out=64)
    torch.testing.assert_close(second, first, atol=1e-6, rtol=1e-6)


# -- mixes: one request on several adapters, each delta scaled, summed and added once ----------

def check_mix(case, design, dtype, **bounds):
    """check_lora, and the result against the dense matrices' (summed in float64, in x's dtype)."""
    got = check_lora(case, design, **bounds)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(got.float(), case.expected.float(), **tol)
    return got


def stored(t32, dtype):
    """fp32 values as the kernels' last store rounds them to `dtype`: to nearest even, but the
    interpreter's fp32 -> bf16 cast truncates (it drops the low 16 bits)."""
    if dtype == torch.bfloat16 and os.environ["TRITON_INTERPRET"] not in ("", "0"):
        return (t32.contiguous().view(torch.int32) & -(1 << 16)).view(torch.float32).to(dtype)
    return t32.to(dtype)


def rounded_once(case):
    """The reference's fp32 sum (out + the mix's summed deltas: it adds them to an fp32 out as
    is), stored as the kernels store it."""
    out = case.base.float()
    reference.lora(case.x, out, case.w, case.seg, case.entry, case.slots)
    return stored(out, case.base.dtype)


def rounded_per_member(case):
    """Each of a mix's segments applied as a segment alone, one after another: each member's
    delta rounded into out on its own (what summing once must not do)."""
    out = case.base.clone()
    for row in case.seg.tolist():
        out32 = out.float()
        one = torch.tensor([row[:4] + [1]], dtype=torch.long, device=DEVICE)
        reference.lora(case.x, out32, case.w, one, case.entry, case.slots)
        out = stored(out32, out.dtype)
    return out


# adapters (ranks per slot of the qkv group) and mixes of them ((adapter, scale) each)
MIX_RANKS = [[8, 3, 16], [24, 24, 24], [1, 0, 5], [64, 8, 0], [3, 3, 3]]
MIXES = [[(0, 1.0)],                             # a plain segment
         [(1, 0.5), (2, -1.25)],                 # two adapters, a negative scale
         [(3, 1.0)],
         [(0, 0.0), (4, 2.0), (1, -0.75)],       # three, one of them at scale 0
         [(4, 1.0), (3, 1.0)],                   # empty (0 rows)
         [(2, 0.3)],                             # a segment alone with a scale
         [(3, 0.3), (4, 1.0), (0, 1.5)],         # ranks 64 + 3 + 8 in slot 0: past one rank block of 64
         [(1, 1.0), (1, 1.0)]]                   # the same adapter twice
MIX_ROWS = [1, 3, 2, 1, 0, 5, 4, 1]


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_mixes_of_adapters_of_different_ranks_and_scales(design, dtype):
    case = lora_case(41, 48, [32, 16, 24], MIX_RANKS, MIX_ROWS, dtype=dtype, mixes=MIXES)
    assert case.seg[:, 4].tolist() == [1, 2, -1, 1, 3, -1, -2, 2, -1, 1, 3, -1, -2, 2, -1]
    # the host's bound: the largest sum of one mix's ranks in one slot (64 + 3 + 8)
    assert lora_triton._max_rank(case.w, case.seg, case.entry, case.slots) == 75
    check_mix(case, design, dtype)


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_mix_members_without_some_modules(design, dtype):
    # a member lacking a slot has zeros for its fields there: n_out and col come from the others
    ranks = [[8, 0, 0], [0, 5, 0], [0, 0, 0], [3, 0, 7]]
    mixes = [[(0, 1.0), (1, 0.5)],                # slot 2 in no member: its columns untouched
             [(2, 1.0), (3, -1.0)],               # a lead with no module of the group
             [(1, 1.0), (2, 2.0), (0, -0.5)],     # slot 1 only from the first, slot 0 only from the last
             [(2, 1.0), (2, 0.5)]]                # no member with any module: nothing changes
    case = lora_case(42, 40, [32, 16, 24], ranks, [2, 3, 1, 2], dtype=dtype, mixes=mixes)
    got = check_mix(case, design, dtype)
    start, end = case.seg[0, :2].tolist()
    assert torch.equal(got[start:end, 48:], case.base[start:end, 48:])
    start, end = case.seg[-1, :2].tolist()
    assert torch.equal(got[start:end], case.base[start:end])


@pytest.mark.parametrize("design", DESIGNS)
def test_lora_mix_in_bf16_is_rounded_once(design):
    # the mix's deltas summed in fp32 and rounded into out once: the reference's bits (up to how
    # the store rounds: check_lora compares bf16 within a tolerance because the interpreter's
    # store truncates), which rounding each member's delta into out in turn does not give
    case = lora_case(43, 48, [32, 16, 24], MIX_RANKS, MIX_ROWS, dtype=torch.bfloat16, mixes=MIXES)
    got = case.base.clone()
    lora_triton.lora(*case.args(got), config=DESIGNS[design])
    once = rounded_once(case)
    assert torch.equal(got, once)
    assert (rounded_per_member(case) != once).sum() > 50


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_prefill_length_mixes(design, dtype):
    # 40 rows: row blocks over 16 (the split kernels for either design, their prefill blocks);
    # in = k_split + 40: two shrink programs write partials of each rank block of a mix
    fan_in = lora_triton.CONFIG.k_split + 40
    ranks = [[40, 3, 16], [8, 0, 24], [5, 17, 0]]
    mixes = [[(0, 0.5), (1, -1.0)], [(2, 1.0)], [(1, 2.0), (2, 1.0), (0, 0.25)]]
    case = lora_case(44, fan_in, [32, 16, 24], ranks, [40, 3, 21], dtype=dtype, mixes=mixes, E=2048)
    check_mix(case, design, dtype)


@pytest.mark.heavy  # three interpreted runs of each mix (the default tier checks each mix once, above)
@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_mixes_under_static_bounds_larger_than_needed(design, dtype):
    case = lora_case(45, 48, [32, 16, 24], MIX_RANKS, MIX_ROWS, dtype=dtype, mixes=MIXES)
    first = check_mix(case, design, dtype)
    second = check_mix(case, design, dtype, max_rows=16, max_rank=256, max_n_out=64)
    third = check_mix(case, design, dtype, max_rows=40, max_rank=96, max_n_out=32)
    torch.testing.assert_close(second, first, **TOL[dtype])
    torch.testing.assert_close(third, first, **TOL[dtype])


# -- epilogues (DoRA, lora_bias): out = g * (out + delta) + c on a lone segment ------------------

# adapters (ranks per slot of the qkv group: 136 columns in slot 0, not a multiple of any column
# block, so its last block is partial) and their epilogues
POST_OUTS = [136, 16, 24]
POST_RANKS = [[8, 3, 16], [24, 0, 5], [1, 8, 0], [16, 16, 16], [64, 3, 8]]
POSTS = [None, "dora", "bias", "dora", "bias"]


def check_post(case, design, dtype, **bounds):
    """check_mix, and the rows in no segment untouched (the epilogue included)."""
    assert (~case.covered).any()
    got = check_mix(case, design, dtype, **bounds)
    assert torch.equal(got[~case.covered], case.base[~case.covered])
    return got


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_epilogues_beside_plain_adapters_in_a_decode_step(design, dtype):
    # segments of at most 16 rows (the fused kernel for "fused"); one adapter per segment
    case = lora_case(51, 48, POST_OUTS, POST_RANKS, [1, 3, 1, 16, 2], dtype=dtype, posts=POSTS)
    assert (case.base != case.expected).any()
    check_post(case, design, dtype)
    # under static bounds larger than the step's (as a captured graph passes them)
    check_post(case, design, dtype, max_rows=16, max_rank=128, max_n_out=192)


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("dtype", BF16_HEAVY)
def test_lora_epilogues_on_prefill_length_segments(design, dtype):
    # 40 rows: row blocks over 16 (the split kernels, their prefill blocks: 64 columns, so 136
    # takes three); in = k_split + 40: the shrink's partials summed before the epilogue
    fan_in = lora_triton.CONFIG.k_split + 40
    case = lora_case(52, fan_in, POST_OUTS, POST_RANKS, [40, 1, 21, 0, 3], dtype=dtype, posts=POSTS, E=2048)
    check_post(case, design, dtype)
    check_post(case, design, dtype, max_rows=64, max_rank=96, max_n_out=256)


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("dtype", BF16_HEAVY)
def test_lora_epilogue_adapters_in_a_mix_are_summed_plainly(design, dtype):
    # a mix's members, its lead included, add their deltas with no epilogue; the same adapters
    # alone apply theirs
    mixes = [[(1, 1.0)],                          # DoRA alone: its epilogue
             [(1, 1.0), (2, 1.0)],                # a DoRA lead and a bias follower: plain sums
             [(2, 1.0)],                          # bias alone
             [(0, 0.5), (3, 1.0), (4, -1.0)],     # a plain lead, epilogue followers
             [(4, 1.0)],
             [(3, 1.0), (0, 2.0)]]                # 40 rows: the prefill blocks
    case = lora_case(53, 48, POST_OUTS, POST_RANKS, [1, 2, 3, 1, 4, 40], dtype=dtype, mixes=mixes, posts=POSTS)
    check_post(case, design, dtype)
    check_post(case, design, dtype, max_rows=64, max_rank=128, max_n_out=136)


@pytest.mark.parametrize("design", DESIGNS)
def test_lora_epilogue_in_bf16_is_rounded_once(design):
    # g * (out + delta) + c in fp32, rounded into out once: the reference's bits (as the kernels
    # store them), which rounding out + delta before the epilogue does not give. The kernel's fp32
    # sums and the reference's run in other orders (the interpreter's matmul is numpy's BLAS, whose
    # kernel depends on the CPU: bit-equal on some hosts, not on an AMD EPYC): a value on a bf16
    # boundary may round either way, one bf16 step apart, in a few elements; rounding twice moves many
    case = lora_case(54, 48, POST_OUTS, POST_RANKS, [1, 3, 1, 5, 2], dtype=torch.bfloat16, posts=POSTS)
    got = case.base.clone()
    lora_triton.lora(*case.args(got), config=DESIGNS[design])
    once = rounded_once(case)
    off = got != once
    assert off.sum() <= 4 and (bf16_steps(got, once)[off] <= 1).all()
    # out + delta rounded first, then the epilogue (the reference's, on a plain copy of the tables)
    twice = case.base.clone()
    reference.lora(case.x, twice, _plain(case), case.seg, case.entry, case.slots)
    twice32 = twice.float()
    wi = reference.as_int64(case.w)
    F = reference.TABLE_FIELDS
    for start, end, table, _, _ in case.seg.tolist():
        for m in range(case.slots):
            r, n_out, col, _, _, g_row, c_row = wi[table + case.entry + F * m:][:F].tolist()
            if r and g_row >= 0:
                o = twice32[start:end, col:col + n_out]
                o.copy_(case.w[g_row:g_row + n_out].float() * o + case.w[c_row:c_row + n_out].float())
    assert (stored(twice32, torch.bfloat16) != once).sum() > 20


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values apart a and b are, element by element (of one sign: their bits' distance)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def _plain(case):
    """The pool with every epilogue turned off (g_row = c_row = -1 in the row tables)."""
    w = case.w.clone()
    wi = reference.as_int64(w)
    F = reference.TABLE_FIELDS
    for _, _, table, _, _ in case.seg.tolist():
        for m in range(case.slots):
            wi[table + case.entry + F * m + 5:][:2] = -1
    return w


@pytest.mark.parametrize("design", DESIGNS)
def test_lora_epilogue_of_a_slot_the_adapter_lacks_is_not_applied(design):
    # a DoRA adapter without slot 1: those columns keep out as is (no delta, no epilogue)
    case = lora_case(55, 48, POST_OUTS, [[8, 0, 4], [0, 0, 0]], [3, 2], posts=["dora", "bias"])
    got = check_post(case, design, torch.float32)
    start, end = case.seg[0, :2].tolist()
    assert torch.equal(got[start:end, 136:152], case.base[start:end, 136:152])
    start, end = case.seg[1, :2].tolist()
    assert torch.equal(got[start:end], case.base[start:end])


def test_lora_takes_segments_of_seg_fields_only():
    case = lora_case(1, 32, [32, 16], [[4, 4]], [3])
    with pytest.raises(ValueError, match=f"\\[S, {reference.SEG_FIELDS}\\]"):
        lora_triton.lora(case.x, case.base.clone(), case.w, case.seg[:, :3], case.entry, case.slots)


# -- paged attention --------------------------------------------------------------------------

BLK = 16


def kv_pool(seed, pages, kvh, d, dtype, layers=2, layer=1, blk=BLK):
    """One layer's (strided) view of a random pool [P, L, 2, blk, KVH, D]."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(pages, layers, 2, blk, kvh, d, generator=g).to(DEVICE, dtype)
    kv = pool[:, layer]
    assert not kv.is_contiguous()
    return kv


def qkv_rows(seed, T, H, kvh, d, dtype):
    """q [T, H, D], k, v [T, KVH, D] as row-strided views of one fused projection output."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (H + 2 * kvh) * d, generator=g).to(DEVICE, dtype)
    q = qkv[:, :H * d].view(T, H, d)
    k = qkv[:, H * d:(H + kvh) * d].view(T, kvh, d)
    v = qkv[:, (H + kvh) * d:].view(T, kvh, d)
    return q, k, v


def tables_for(seed, ctx_lens, pages, blk=BLK):
    """Scattered page tables, [N, maxb], padding entries valid page ids."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(pages, generator=g)
    need = [-(-n // blk) for n in ctx_lens]
    maxb = max(need)
    assert sum(need) <= pages
    t = torch.empty(len(ctx_lens), maxb, dtype=torch.long)
    used = 0
    for i, n in enumerate(need):
        t[i, :n] = perm[used:used + n]
        t[i, n:] = perm[-1]
        used += n
    return t.to(DEVICE)


def test_write_kv_matches_reference_exactly():
    kv = kv_pool(0, 8, 2, 24, torch.float32)
    _, k, v = qkv_rows(1, 7, 4, 2, 24, torch.float32)
    pages = torch.tensor([3, 3, 0, 7, 5, 5, 1], device=DEVICE)
    offs = torch.tensor([0, 15, 4, 9, 1, 2, 15], device=DEVICE)
    ref, got = kv.clone(), kv.clone()
    reference.write_kv(ref, k, v, pages, offs)
    attention_triton.write_kv(got, k, v, pages, offs)
    assert torch.equal(got, ref)
    base = kv_pool(0, 8, 2, 24, torch.float32)
    attention_triton.write_kv(base, k[:0], v[:0], pages[:0], offs[:0])
    assert torch.equal(base, kv)


def decode_slots(lens, tables, blk=BLK):
    """Where decode rows write: this step's token is the last position of each sequence."""
    return tables[torch.arange(len(lens), device=DEVICE), (lens - 1) // blk], (lens - 1) % blk


@pytest.mark.parametrize("dtype,d,kvh", [(torch.float32, 8, 2), (torch.float32, 64, 2), (torch.bfloat16, 32, 2),
                                         (torch.float32, 128, 2), (torch.float16, 16, 1), (torch.float32, 16, 4)])
def test_paged_decode_matches_reference(dtype, d, kvh):
    """GQA (4 query heads over 2 kv heads), MQA (1 kv head) and plain multi-head attention."""
    H, P = 4, 24
    lens = torch.tensor([1, 15, 16, 17, 40], device=DEVICE)
    tables = tables_for(d, lens.tolist(), P)
    kv = kv_pool(d, P, kvh, d, dtype)
    q, k, v = qkv_rows(d + 1, len(lens), H, kvh, d, dtype)
    pages, offs = decode_slots(lens, tables)
    scale = d ** -0.5
    kv_ref = kv.clone()
    reference.write_kv(kv_ref, k, v, pages, offs)
    ref = reference.paged_decode(q, kv_ref, tables, lens, scale)
    attention_triton.write_kv(kv, k, v, pages, offs)
    assert torch.equal(kv, kv_ref)
    got = attention_triton.paged_decode(q, kv, tables, lens, scale)
    assert got.dtype == dtype and got.shape == (len(lens), H, d)
    torch.testing.assert_close(got.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("heads,kvh,dtype", [(6, 2, torch.float32), (16, 2, torch.bfloat16), (32, 8, torch.float32)])
def test_paged_decode_serves_every_query_head_of_a_kv_head_in_one_program(heads, kvh, dtype):
    """Groups of 3 (not a power of two), 8 and 4 query heads per kv head: each program reads its kv
    head's keys once for all of them."""
    d, P = 32, 24
    lens = torch.tensor([1, 16, 37, 80], device=DEVICE)
    tables = tables_for(heads, lens.tolist(), P)
    kv = kv_pool(heads, P, kvh, d, dtype)
    q, _, _ = qkv_rows(heads + 1, len(lens), heads, kvh, d, dtype)
    ref = reference.paged_decode(q, kv, tables, lens, d ** -0.5)
    got = attention_triton.paged_decode(q, kv, tables, lens, d ** -0.5)
    torch.testing.assert_close(got.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("blk,dtype", [(16, torch.float32), (24, torch.float32), (16, torch.bfloat16)])
def test_paged_decode_of_long_contexts_matches_reference(blk, dtype):
    """Contexts over several of the kernel's iterations (DECODE_TOKENS keys each, whole pages: with
    24-token pages an iteration reads 48), ending inside, at and just past an iteration's end."""
    H, kvh, d = 4, 2, 32
    step = blk * max(1, attention_triton.DECODE_TOKENS // blk)
    lens = torch.tensor([1, step - 1, step, step + 1, 3 * step + 5], device=DEVICE)
    pages = sum(-(-n // blk) for n in lens.tolist()) + 3
    tables = tables_for(blk, lens.tolist(), pages, blk)
    kv = kv_pool(blk + 1, pages, kvh, d, dtype, blk=blk)
    q, _, _ = qkv_rows(blk + 2, len(lens), H, kvh, d, dtype)
    ref = reference.paged_decode(q, kv, tables, lens, d ** -0.5)
    got = attention_triton.paged_decode(q, kv, tables, lens, d ** -0.5)
    torch.testing.assert_close(got.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype,d", [(torch.float32, 8), (torch.float32, 32), (torch.bfloat16, 64)])
def test_paged_prefill_and_decode_in_one_batch_match_reference(dtype, d):
    """Two decode rows, then four prefill sequences in one launch: fresh (start_pos 0) ones and
    chunks continuing a prefix already in the pages."""
    H, kvh, P = 4, 2, 40
    dec_lens = torch.tensor([5, 33], device=DEVICE)
    prefills = [(20, 0), (9, 17), (3, 40), (2, 0)]  # (q_len, start_pos)
    ctx = dec_lens.tolist() + [n + sp for n, sp in prefills]
    tables = tables_for(d + 2, ctx, P)
    nd = len(dec_lens)
    T = nd + sum(n for n, _ in prefills)
    kv = kv_pool(d + 3, P, kvh, d, dtype)
    q, k, v = qkv_rows(d + 4, T, H, kvh, d, dtype)
    dpages, doffs = decode_slots(dec_lens, tables[:nd])
    slot_pages, slot_offs, seqs, row = [dpages], [doffs], [], nd
    q_start, q_len, start_pos = [], [], []
    for i, (n, sp) in enumerate(prefills):
        table = tables[nd + i]
        pos = torch.arange(sp, sp + n, device=DEVICE)
        slot_pages.append(table[pos // BLK])
        slot_offs.append(pos % BLK)
        seqs.append(reference.PrefillSeq(row=row, num_tokens=n, start_pos=sp, block_table=table))
        q_start.append(row)
        q_len.append(n)
        start_pos.append(sp)
        row += n
    slot_pages, slot_offs = torch.cat(slot_pages), torch.cat(slot_offs)
    meta = reference.AttentionMetadata(slot_pages=slot_pages, slot_offsets=slot_offs, num_decode=nd,
                                       decode_block_tables=tables[:nd],
                                       decode_context_lens=dec_lens, prefills=seqs)
    scale = d ** -0.5
    kv_ref = kv.clone()
    ref = reference.paged_attention(q, k, v, kv_ref, meta, scale).view(T, H, d)

    attention_triton.write_kv(kv, k, v, slot_pages, slot_offs)
    assert torch.equal(kv, kv_ref)
    sentinel = torch.full((T, H, d), 7.0, dtype=dtype, device=DEVICE)
    out = sentinel.clone()
    out[:nd] = attention_triton.paged_decode(q[:nd], kv, tables[:nd], dec_lens, scale)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=DEVICE)  # noqa: E731
    attention_triton.paged_prefill(q, kv, as_long(q_start), as_long(q_len), as_long(start_pos),
                                   tables[nd:], scale, out)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])

    # only the listed sequences' rows are written; a static bound above the longest query works
    out2 = sentinel.clone()
    attention_triton.paged_prefill(q, kv, as_long(q_start[1:3]), as_long(q_len[1:3]),
                                   as_long(start_pos[1:3]), tables[nd + 1:nd + 3], scale, out2,
                                   max_q_len=64)
    rows = torch.zeros(T, dtype=torch.bool, device=DEVICE)
    for s in (1, 2):
        rows[q_start[s]:q_start[s] + q_len[s]] = True
    torch.testing.assert_close(out2[rows].float(), ref[rows].float(), **TOL[dtype])
    assert torch.equal(out2[~rows], sentinel[~rows])
