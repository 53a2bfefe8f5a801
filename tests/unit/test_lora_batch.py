"""LoraBatch hands each projection group's LoRA op the group's own module slots."""

from __future__ import annotations

import numpy as np
import torch

from lorafleet.kernels.reference import META_FIELDS
from lorafleet.lora.batch import GROUPS, MODULE_SLOTS, LoraBatch


class Recorder:
    def __init__(self):
        self.metas = []

    def lora(self, x, out, w, page_elems, seg, meta, tables, max_rows, max_rank):
        self.metas.append(meta)


def test_each_group_gets_a_view_of_its_own_slots():
    kernels = Recorder()
    layers = 2
    batch = LoraBatch(kernels, torch.zeros(4, 8))
    g = np.random.default_rng(0)
    for start, end in ((0, 2), (2, 3)):
        meta = g.integers(1, 9, size=(layers, len(GROUPS), MODULE_SLOTS, META_FIELDS))
        batch.add_rows(start, end, meta, np.array([1, 2]))
    batch.finish()
    x = torch.zeros(3, 8)
    for layer in range(layers):
        for gi, (group, modules) in enumerate(GROUPS.items()):
            batch.apply(layer, group, x, x)
            got = kernels.metas[-1]
            assert got.shape == (2, len(modules), META_FIELDS), group
            assert torch.equal(got, batch.meta[layer, gi, :, :len(modules)])
            assert got.data_ptr() == batch.meta[layer, gi].data_ptr()  # a view, not a copy
