"""The fused row-wise CPU ops compute their references (`reference.rms_norm`, `add_rms_norm`,
`rope_`, `silu_mul`): within fp32 rounding in fp32, and in bf16 to the reference's last bit but
where the norm's sum order decides it; strided rows (views of a fused projection) included."""

from __future__ import annotations

import pytest
import torch

from lorafleet.kernels import pointwise_cpu, reference

# with LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI), load() raises instead: a broken build fails, never skips
# a string, read as each test starts: collecting the tree builds nothing (a session of unit tests builds no kernel)
pytestmark = pytest.mark.skipif("pointwise_cpu.load() is None", reason="the kernel does not build here")
DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 3, 8, 17, 40]  # 40: more than one task (threads at prefill sizes)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """fp32: 1e-5 relative; bf16: at most one bf16 step apart (the norm's fp32 sum order)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double(), want.double()
    if got.dtype == torch.float32:
        return bool(((g - w).abs() <= 1e-5 * w.abs().max() + 1e-7).all())
    return bool(((g - w).abs() <= w.abs() * 2 ** -7 + 1e-30).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1, 15, 64, 577])
def test_rms_norm_and_the_residual_add_before_it(dtype, hidden, variant):
    g = torch.Generator().manual_seed(hidden)
    for t in ROWS:
        wide = torch.randn(t, hidden + 5, generator=g).to(dtype)
        x = wide[:, 2:2 + hidden]  # strided rows
        w = torch.randn(hidden, generator=g).to(dtype)
        assert close(pointwise_cpu.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
        delta = torch.randn(t, hidden, generator=g).to(dtype)
        mine, ref = x.clone(), x.clone()
        h = pointwise_cpu.add_rms_norm(mine, delta, w, 1e-6)
        assert torch.equal(mine, ref + delta)  # the residual stream, updated in place, exactly
        assert close(h, reference.add_rms_norm(ref, delta, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 8), (9, 3, 64), (2, 2, 2)])
def test_rope_in_place_on_views_of_the_fused_qkv(dtype, heads, kv_heads, dim, variant):
    g = torch.Generator().manual_seed(heads * dim)
    positions_max = 50
    angles = torch.rand(positions_max, dim // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    for t in ROWS:
        qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
        pos = torch.randint(0, positions_max, (t,), generator=g)
        mine, ref = qkv.clone(), qkv.clone()
        views = []
        for buf in (mine, ref):
            q = buf[:, :heads * dim].view(t, heads, dim)
            k = buf[:, heads * dim:(heads + kv_heads) * dim].view(t, kv_heads, dim)
            views.append((q, k))
        pointwise_cpu.rope_(*views[0], cos, sin, pos)
        reference.rope_(*views[1], cos, sin, pos)
        assert close(mine, ref)
        assert torch.equal(mine[:, (heads + kv_heads) * dim:], qkv[:, (heads + kv_heads) * dim:])  # v untouched
        if dtype == torch.bfloat16:
            assert torch.equal(mine, ref)  # every product and sum rounded where the reference rounds


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_times_up(dtype, variant):
    g = torch.Generator().manual_seed(7)
    for t in ROWS:
        for inter in (1, 33, 1536):
            gu = (torch.randn(t, 2 * inter + 3, generator=g) * 4).to(dtype)[:, 3:]  # strided rows
            assert close(pointwise_cpu.silu_mul(gu), reference.silu_mul(gu))


def test_bad_inputs_are_refused_with_the_reason():
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="rows of 8 contiguous elements"):
        pointwise_cpu.rms_norm(torch.randn(2, 9), w, 1e-6)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        pointwise_cpu.rms_norm(x.half(), w.half(), 1e-6)
    q = torch.randn(1, 2, 4)
    tables = torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="position out of range"):
        pointwise_cpu.rope_(q, q.clone(), tables, tables, torch.tensor([4]))
    with pytest.raises(RuntimeError, match=r"gu \[T, 2I\]"):
        pointwise_cpu.silu_mul(torch.randn(2, 7))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_rows_land_in_their_slots_and_nowhere_else(dtype, variant):
    g = torch.Generator().manual_seed(11)
    pages, layers, block, kvh, dim, t = 6, 3, 4, 2, 8, 5
    pool = torch.randn(pages, layers, 2, block, kvh, dim, generator=g).to(dtype)
    kv = pool[:, 1]  # one layer's strided view, as the model passes it
    qkv = torch.randn(t, 3 * kvh * dim, generator=g).to(dtype)
    k = qkv[:, kvh * dim:2 * kvh * dim].view(t, kvh, dim)  # views of the fused projection
    v = qkv[:, 2 * kvh * dim:].view(t, kvh, dim)
    slot_pages, slot_offsets = torch.tensor([5, 0, 5, 2, 3]), torch.tensor([3, 0, 0, 1, 3])
    mine, ref = pool.clone(), pool.clone()
    pointwise_cpu.write_kv(mine[:, 1], k, v, slot_pages, slot_offsets)
    reference.write_kv(ref[:, 1], k, v, slot_pages, slot_offsets)
    assert torch.equal(mine, ref) and not torch.equal(mine, pool)
    with pytest.raises(RuntimeError, match="slot out of range"):
        pointwise_cpu.write_kv(kv, k, v, torch.tensor([6, 0, 0, 0, 0]), slot_offsets)


def test_greedy_takes_the_first_largest_and_flags_non_finite_rows(variant):
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(7, 1000, generator=g)
    logits[1, [17, 400]] = 50.0                  # a tie: the first wins
    logits[2, 999] = 60.0                        # the last element
    logits[3, 5] = float("nan")
    logits[4, 6] = float("inf")
    logits[5, 7] = float("-inf")
    logits[6] = -3.0                             # all equal
    tokens, finite = pointwise_cpu.greedy(logits)
    ref_tokens, ref_finite = reference.greedy(logits)
    assert finite.tolist() == ref_finite.tolist() == [True, True, True, False, False, False, True]
    keep = ref_finite
    assert torch.equal(tokens[keep], ref_tokens[keep])
    assert tokens[1].item() == 17 and tokens[2].item() == 999 and tokens[6].item() == 0
    big = torch.randn(33, 49152, generator=g)  # pieces of many rows, spread over threads
    assert torch.equal(pointwise_cpu.greedy(big)[0], torch.argmax(big, -1))


def test_greedy_over_pieces_of_a_row_keeps_the_first_largest(variant):
    """On 2 threads a row of 5,000 goes as two pieces of 2,500 (each with a tail past its last full
    vector): a tie across the pieces, across lanes or within a lane goes to the first index; a
    NaN or an infinity in either piece flags the row."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(13)
        logits = torch.randn(7, 5000, generator=g)
        logits[0, [2499, 2500]] = 40.0     # the first piece's tail and the second piece's first
        logits[1, [3, 9]] = 40.0           # two lanes of one vector: 3
        logits[2, [19, 3]] = 40.0          # one lane, two vectors apart (16 lanes): 3
        logits[3, 4999] = 40.0             # the second piece's tail
        logits[4, [4000, 100]] = 40.0      # a tie across the pieces: the first piece's
        logits[5, 3000] = float("nan")
        logits[6, 10] = float("-inf")
        tokens, finite = pointwise_cpu.greedy(logits)
        assert finite.tolist() == [True] * 5 + [False, False]
        assert tokens[:5].tolist() == [2499, 3, 3, 4999, 100]
        assert torch.equal(tokens[:5], reference.greedy(logits)[0][:5])
    finally:
        torch.set_num_threads(before)
