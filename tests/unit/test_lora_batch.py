"""LoraBatch hands each projection group's LoRA op its fields in the row tables, and a step's
segments as one small [S, SEG_FIELDS] array: (start, end, row table, scale, mix)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lorafleet.kernels.reference import SEG_FIELDS, TABLE_FIELDS, lora_entry, scale_bits, seg_scale
from lorafleet.adapters.batch import GROUPS, MODULE_SLOTS, OUT_ALIGN_MAX, LoraBatch, group_shapes

pytestmark = pytest.mark.unit


class Recorder:
    def __init__(self):
        self.calls = []

    def lora(self, x, out, w, seg, entry, slots, max_rows, max_rank, max_n_out, out_align):
        self.calls.append((seg, entry, slots, max_rows, max_rank, max_n_out, out_align))


def test_each_group_gets_its_own_fields_and_bounds():
    kernels = Recorder()
    shapes = {"qkv": (48, 16), "o": (32, 32), "gate_up": (64, 64), "down": (32, 32)}
    batch = LoraBatch(kernels, torch.zeros(4, 8), shapes)
    batch.add_rows(0, 2, [(40, 1.0)], 8)
    batch.add_rows(2, 3, [(100, 1.0)], 24)
    batch.finish().to_device()
    one = scale_bits(1.0)
    assert batch.seg.tolist() == [[0, 2, 40, one, 1], [2, 3, 100, one, 1]]
    assert (batch.max_rows, batch.max_rank) == (2, 24)
    x = torch.zeros(3, 8)
    layers = 2
    entries = set()
    for layer in range(layers):
        for gi, (group, modules) in enumerate(GROUPS.items()):
            batch.apply(layer, group, x, x)
            seg, entry, slots, max_rows, max_rank, n_out, align = kernels.calls[-1]
            assert seg is batch.seg and (slots, max_rows, max_rank) == (len(modules), 2, 24)
            assert (n_out, align) == shapes[group]
            assert entry == ((layer * len(GROUPS) + gi) * MODULE_SLOTS) * TABLE_FIELDS
            entries.add(entry)
    assert len(entries) == layers * len(GROUPS)  # no two (layer, group) share fields
    assert lora_entry(1, 0, len(GROUPS), MODULE_SLOTS) == len(GROUPS) * MODULE_SLOTS * TABLE_FIELDS


def test_a_groups_alignment_divides_every_width_and_first_column_of_its_fused_output():
    """Llama-3.2-1B's shapes: every group aligned to the cap; widths of 6 and 10 (columns 0, 6, 16
    of the fused qkv) leave 2; an odd width leaves 1. The widest output bounds the grid."""
    def features(q, kv, h=2048, i=8192):
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
                "up_proj": (h, i), "down_proj": (i, h)}
    assert group_shapes(features(2048, 512)) == {"qkv": (2048, OUT_ALIGN_MAX), "o": (2048, OUT_ALIGN_MAX),
                                                 "gate_up": (8192, OUT_ALIGN_MAX), "down": (2048, OUT_ALIGN_MAX)}
    assert group_shapes(features(6, 10))["qkv"] == (10, 2)
    assert group_shapes(features(2048, 512, i=8191))["gate_up"] == (8191, 1)
    for feats in (features(6, 10), features(96, 40, h=72, i=200)):
        for group, (width, align) in group_shapes(feats).items():
            outs = [feats[m][1] for m in GROUPS[group]]
            assert width == max(outs) and all(c % align == 0 for c in np.cumsum([0] + outs))


def test_split_cuts_segments_into_runs_of_at_most_the_row_block():
    batch = LoraBatch(Recorder(), torch.zeros(4, 8), {})
    for start, end, table in ((0, 1, 7), (1, 35, 9), (35, 35, 3), (40, 56, 11)):
        batch.add_rows(start, end, [(table, 1.0)], 16)
    split = batch.finish().split(16)
    one = scale_bits(1.0)
    assert split.tolist() == [[0, 1, 7, one, 1], [1, 17, 9, one, 1], [17, 33, 9, one, 1], [33, 35, 9, one, 1],
                              [40, 56, 11, one, 1]]
    assert np.array_equal(LoraBatch(Recorder(), torch.zeros(4, 8), {}).finish().split(16),
                          np.zeros((0, SEG_FIELDS)))


def test_a_mix_is_a_run_of_segments_over_the_same_rows_each_with_its_scale():
    batch = LoraBatch(Recorder(), torch.zeros(4, 8), {})
    batch.add_rows(0, 1, [(7, 1.0)], 16)
    batch.add_rows(1, 3, [(9, 0.5), (11, -2.0), (13, 0.0)], 40)  # the rank bound: the sum of its members'
    batch.finish()
    h = batch.host
    assert h[:, :3].tolist() == [[0, 1, 7], [1, 3, 9], [1, 3, 11], [1, 3, 13]]
    assert [seg_scale(b) for b in h[:, 3]] == [1.0, 0.5, -2.0, 0.0]
    assert h[:, 4].tolist() == [1, 3, -1, -2]  # a lead says how many, its followers which they are
    assert (batch.max_rows, batch.max_rank) == (2, 40)


def test_split_keeps_each_run_of_a_mix_together():
    batch = LoraBatch(Recorder(), torch.zeros(4, 8), {})
    batch.add_rows(0, 20, [(9, 0.5), (11, 1.0)], 16)
    batch.add_rows(20, 21, [(7, 1.0)], 16)
    split = batch.finish().split(16)
    assert split[:, [0, 1, 2, 4]].tolist() == [[0, 16, 9, 2], [0, 16, 11, -1], [16, 20, 9, 2], [16, 20, 11, -1],
                                                [20, 21, 7, 1]]
    assert [seg_scale(b) for b in split[:, 3]] == [0.5, 1.0, 0.5, 1.0, 1.0]
