"""LoraBatch hands each projection group's LoRA op its fields in the row tables, and a step's
segments as one small [S, 3] array."""

from __future__ import annotations

import numpy as np
import torch

from lorafleet.kernels.reference import TABLE_FIELDS, lora_entry
from lorafleet.lora.batch import GROUPS, MODULE_SLOTS, LoraBatch


class Recorder:
    def __init__(self):
        self.calls = []

    def lora(self, x, out, w, seg, entry, slots, max_rows, max_rank, max_n_out):
        self.calls.append((seg, entry, slots, max_rows, max_rank, max_n_out))


def test_each_group_gets_its_own_fields_and_bounds():
    kernels = Recorder()
    widths = {"qkv": 48, "o": 32, "gate_up": 64, "down": 32}
    batch = LoraBatch(kernels, torch.zeros(4, 8), widths)
    batch.add_rows(0, 2, 40, 8)
    batch.add_rows(2, 3, 100, 24)
    batch.finish().to_device()
    assert batch.seg.tolist() == [[0, 2, 40], [2, 3, 100]]
    assert (batch.max_rows, batch.max_rank) == (2, 24)
    x = torch.zeros(3, 8)
    layers = 2
    entries = set()
    for layer in range(layers):
        for gi, (group, modules) in enumerate(GROUPS.items()):
            batch.apply(layer, group, x, x)
            seg, entry, slots, max_rows, max_rank, n_out = kernels.calls[-1]
            assert seg is batch.seg and (slots, max_rows, max_rank, n_out) == (len(modules), 2, 24, widths[group])
            assert entry == ((layer * len(GROUPS) + gi) * MODULE_SLOTS) * TABLE_FIELDS
            entries.add(entry)
    assert len(entries) == layers * len(GROUPS)  # no two (layer, group) share fields
    assert lora_entry(1, 0, len(GROUPS), MODULE_SLOTS) == len(GROUPS) * MODULE_SLOTS * TABLE_FIELDS


def test_split_cuts_segments_into_runs_of_at_most_the_row_block():
    batch = LoraBatch(Recorder(), torch.zeros(4, 8), {})
    for start, end, table in ((0, 1, 7), (1, 35, 9), (35, 35, 3), (40, 56, 11)):
        batch.add_rows(start, end, table, 16)
    split = batch.finish().split(16)
    assert split.tolist() == [[0, 1, 7], [1, 17, 9], [17, 33, 9], [33, 35, 9], [40, 56, 11]]
    assert np.array_equal(LoraBatch(Recorder(), torch.zeros(4, 8), {}).finish().split(16), np.zeros((0, 3)))
