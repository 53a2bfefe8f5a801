"""The CPU LoRA kernel computes exactly the torch reference's semantics."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lorafleet.kernels import lora_cpu
from lorafleet.kernels.reference import LoraSegment, lora_shrink_expand

# with LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI), load() raises instead: a broken build fails, never skips
pytestmark = pytest.mark.skipif(lora_cpu.load() is None, reason="the kernel does not build here")


def random_case(seed, fan_in, outs, ranks_per_segment, rows_per_segment, gaps=True):
    """A flat 'pool' with each segment's adapter laid out as residency does (A stacked, then
    Bt per module), the matching reference segments and kernel metadata."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    cols = np.concatenate([[0], np.cumsum(outs)[:-1]]).tolist()
    chunks, segs, metas, row, off = [], [], [], 0, 0
    for ranks, n in zip(ranks_per_segment, rows_per_segment):
        if gaps:
            row += rng.randint(0, 2)  # rows in no segment: must stay untouched
        rows_total = sum(ranks)
        a = torch.randn(rows_total, fan_in, generator=g)
        a_off = off
        chunks.append(a.reshape(-1))
        off += a.numel()
        bs, meta, r_off = [], np.zeros((3, lora_cpu.META_FIELDS), dtype=np.int64), 0
        for j, r in enumerate(ranks):
            if r == 0:
                continue
            bt = torch.randn(r, outs[j], generator=g)
            meta[j] = (a_off + r_off * fan_in, r, off, outs[j], cols[j])
            chunks.append(bt.reshape(-1))
            off += bt.numel()
            bs.append((cols[j], r_off, bt))
            r_off += r
        segs.append(LoraSegment(row, row + n, a, bs))
        metas.append(meta)
        row += n
    pool = torch.cat(chunks) if chunks else torch.zeros(1)
    total_rows = row + 2
    x = torch.randn(total_rows, fan_in, generator=g)
    seg = torch.tensor([(s.start, s.end) for s in segs], dtype=torch.long).reshape(-1, 2)
    meta = torch.from_numpy(np.stack(metas)) if metas else torch.zeros(0, 3, 5, dtype=torch.long)
    return x, pool, segs, meta, seg


@pytest.mark.parametrize("seed", range(6))
def test_kernel_matches_reference_on_random_heterogeneous_segments(seed):
    rng = random.Random(seed)
    outs = [rng.choice([8, 24, 96]) for _ in range(3)]
    n_seg = rng.randint(1, 12)
    ranks = [[rng.choice([0, 1, 3, 8, 24, 64]) for _ in range(3)] for _ in range(n_seg)]
    for r in ranks:
        if not any(r):
            r[rng.randrange(3)] = 5
    rows = [rng.choice([1, 1, 2, 4]) for _ in range(n_seg)]
    x, pool, segs, meta, seg = random_case(seed, rng.choice([16, 40, 64]), outs, ranks, rows)
    base = torch.randn(x.shape[0], sum(outs))
    ref, got = base.clone(), base.clone()
    lora_shrink_expand(x, ref, segs)
    lora_cpu.lora_segments(x, got, pool, meta, seg)
    assert (got - ref).abs().max().item() < 1e-4
    untouched = torch.ones(x.shape[0], dtype=torch.bool)
    for s in segs:
        untouched[s.start:s.end] = False
    assert torch.equal(got[untouched], base[untouched])


def test_kernel_with_no_segments_and_empty_segments_changes_nothing():
    x, pool, segs, meta, seg = random_case(0, 16, [8, 8, 8], [[3, 0, 2]], [0])
    base = torch.randn(x.shape[0], 24)
    got = base.clone()
    lora_cpu.lora_segments(x, got, pool, meta, seg)
    assert torch.equal(got, base)
    empty = torch.zeros(0, 2, dtype=torch.long)
    lora_cpu.lora_segments(x, got, pool, torch.zeros(0, 3, 5, dtype=torch.long), empty)
    assert torch.equal(got, base)


def test_kernel_writes_into_a_wider_output_through_its_row_stride():
    x, pool, segs, meta, seg = random_case(3, 32, [16, 8, 8], [[4, 2, 0], [1, 0, 7]], [1, 2])
    wide = torch.randn(x.shape[0], 64)
    view = wide[:, :32]             # the group's output inside a larger buffer
    ref = view.clone()
    lora_shrink_expand(x, ref, segs)
    lora_cpu.lora_segments(x, view, pool, meta, seg)
    assert (view - ref).abs().max().item() < 1e-4
