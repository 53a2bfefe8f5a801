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

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-2, rtol=2e-2)}


# -- LoRA over pool pages ---------------------------------------------------------------------

def lora_case(seed, fan_in, outs, ranks, rows, *, E=100, dtype=torch.float32, gaps=True, pad_cols=0):
    """tests/kernels/lora_cases.py's case as (x, out, w, seg, meta, tables, covered) on DEVICE."""
    c = cases.lora_case(seed, fan_in, outs, ranks, rows, page_elems=E, dtype=dtype, gaps=gaps, pad_cols=pad_cols,
                        device=DEVICE)
    return c.x, c.base, c.w, c.seg, c.meta, c.tables, c.covered


def check_lora(case, E=100, **bounds):
    x, out, w, seg, meta, tables, covered = case
    ref, got = out.clone(), out.clone()
    reference.lora_paged(x, ref, w, E, seg, meta, tables)
    lora_triton.lora_paged(x, got, w, E, seg, meta, tables, **bounds)
    assert not torch.isnan(got).any()
    if x.dtype == torch.float32:
        # fp32 sums in another order (the interpreter's matmuls on this CPU): within 1e-5 of the
        # sum of the terms' magnitudes, which a rank-256 row exceeds by far its absolute 1e-5
        mag = out.abs()
        reference.lora_paged(x.abs(), mag, w.abs(), E, seg, meta, tables)
        assert ((got - ref).abs() <= 1e-5 * mag).all(), (got - ref).abs().max().item()
    else:
        torch.testing.assert_close(got.float(), ref.float(), **TOL[x.dtype])
    assert torch.equal(got[~covered], out[~covered]), "rows in no segment must stay untouched"
    return got


@pytest.mark.parametrize("rank", [1, 3, 8, 24, 64, 128, 256])
def test_lora_each_rank_matches_reference(rank):
    # rank in two of three module slots, a different one in the third; 1 row and 5 rows
    case = lora_case(rank, 40, [32, 16, 48], [[rank, 0, rank], [5, rank, rank]], [1, 5])
    check_lora(case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lora_half_dtypes(dtype):
    case = lora_case(7, 64, [32, 24, 40], [[8, 3, 0], [64, 64, 64], [1, 0, 17]], [3, 1, 18], dtype=dtype)
    check_lora(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_many_adapters_of_mixed_ranks_in_one_batch(dtype):
    rng = random.Random(12)
    ranks = [[rng.choice([0, 1, 3, 8, 16, 24, 64]) for _ in range(3)] for _ in range(12)]
    ranks[3] = [0, 0, 0]  # an adapter targeting none of this group's modules
    rows = [rng.choice([0, 1, 1, 2, 4, 17]) for _ in range(12)]
    case = lora_case(12, 48, [32, 16, 16], ranks, rows, dtype=dtype, pad_cols=8)
    check_lora(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_long_rows_are_reduced_by_several_programs(dtype):
    # in = 2 K_SPLIT + 40: three programs add their partial sums into one t row, the last a partial slice
    fan_in = 2 * lora_triton.K_SPLIT + 40
    case = lora_case(21, fan_in, [32, 16, 48], [[16, 0, 3], [1, 64, 8], [24, 24, 24]], [1, 17, 4], dtype=dtype)
    check_lora(case)
    check_lora(case, max_rows=32, max_rank=256)


def test_lora_meta_of_a_groups_slots_as_a_strided_view():
    # the engine hands each projection group its own module slots: meta[:, :2] of [S, 3, 5]
    x, out, w, seg, meta, tables, covered = lora_case(32, 48, [32, 16], [[8, 3], [0, 24], [16, 16]], [1, 4, 2])
    view = meta[:, :2]
    assert not view.is_contiguous()
    check_lora((x, out, w, seg, view, tables, covered))
    check_lora((x, out, w, seg, view, tables, covered), max_rows=16, max_rank=256)


def test_lora_offsets_wider_than_int32(monkeypatch):
    # the int64 address path, which only a page table spanning 2**31 elements takes otherwise
    monkeypatch.setattr(lora_triton, "INT32_SPAN", 1)
    case = lora_case(22, lora_triton.K_SPLIT + 8, [32, 16], [[8, 3], [0, 24]], [2, 5], E=16)
    check_lora(case, E=16)


def test_lora_scattered_pages_small_page_size():
    # E=16: every A row and Bt row straddles page boundaries, adapters span many pages
    case = lora_case(3, 40, [24, 40], [[24, 7], [3, 0], [128, 128]], [2, 3, 4], E=16)
    check_lora(case, E=16)


def test_lora_single_token():
    case = lora_case(5, 32, [32], [[8]], [1], gaps=False)
    check_lora(case)


def test_lora_strided_views():
    case = lora_case(9, 48, [32, 32, 32], [[8, 8, 8], [3, 0, 24]], [4, 2], pad_cols=16)
    assert case[0].stride(0) != case[0].shape[1] and case[1].stride(0) != case[1].shape[1]
    check_lora(case)


def test_lora_without_adapters_changes_nothing():
    # no segments at all
    x, out, w, seg, meta, tables, _ = lora_case(1, 32, [32, 16], [[4, 4]], [3])
    got = out.clone()
    lora_triton.lora_paged(x, got, w, 100, seg[:0], meta[:0], tables[:0])
    assert torch.equal(got, out)
    lora_triton.lora_paged(x, got, w, 100, seg[:0], meta[:0], tables[:0], max_rows=8, max_rank=16)
    assert torch.equal(got, out)
    # segments whose adapters lack every module of the group, and empty segments
    x, out, w, seg, meta, tables, _ = lora_case(2, 32, [32, 16], [[0, 0], [0, 0], [5, 3]], [3, 2, 0])
    got = out.clone()
    lora_triton.lora_paged(x, got, w, 100, seg, meta, tables)
    assert torch.equal(got, out)
    lora_triton.lora_paged(x, got, w, 100, seg, meta, tables, max_rows=16, max_rank=32)
    assert torch.equal(got, out)


def test_lora_static_bounds_larger_than_needed_give_the_same_result():
    case = lora_case(4, 40, [32, 16, 24], [[3, 24, 0], [8, 8, 8], [1, 0, 0]], [2, 0, 7])
    first = check_lora(case)
    second = check_lora(case, max_rows=40, max_rank=200)
    torch.testing.assert_close(second, first, atol=1e-6, rtol=1e-6)


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
