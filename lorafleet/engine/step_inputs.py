"""StepInputs: a step's numbers on the host, built once a step (`ModelRunner.inputs`) and read by
every way to run it: `upload` sends them for the eager forward (the CPU's one-call forward
included), `DecodeGraphs.run` writes a pure decode step's into the captured graphs' staging buffer;
either way with the step's LoRA segments and sampler numbers, in one copy to a GPU.
Why one type: the eager, captured and CPU paths each built their own before, and drifted."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lorafleet.kernels.reference import AttentionMetadata, PrefillSeq
from lorafleet.model.upload import Upload


@dataclass
class Prefill:
    """Per prefill chunk (the sequences after the decode ones, in row order)."""

    starts: np.ndarray     # [P] its first flat row
    lens: np.ndarray       # [P] its tokens this step
    positions: np.ndarray  # [P] its first token's position
    tables: np.ndarray     # [P, width] block tables
    blocks: np.ndarray     # [P] blocks each holds (its table's columns attention reads)


@dataclass
class StepInputs:
    """int64 arrays, rows in `ModelRunner.order()`'s order: the first `num_decode` sequences decode
    one token each (flat rows 0 .. num_decode - 1), the prefill chunks follow."""

    ids: np.ndarray              # [T] token ids; -1 - j: the last step's j-th draw, not read yet
    positions: np.ndarray        # [T]
    slot_pages: np.ndarray       # [T] the KV page each row writes
    slot_offsets: np.ndarray     # [T] and its offset in that page
    lens: np.ndarray             # [D] decode rows' context lengths, the new token counted
    tables: np.ndarray           # [D, width] decode rows' block tables
    out_rows: np.ndarray | None  # flat rows whose logits are wanted; None: every row
    prefill: Prefill | None = None

    @property
    def num_decode(self) -> int:
        return len(self.lens)

    @property
    def pure_decode(self) -> bool:
        return self.prefill is None

    def upload(self, dev: torch.device, up: Upload) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                             torch.Tensor]:
        """(input ids [T], positions [T], AttentionMetadata, logits rows [S]) on `dev`, sent with
        the columns `up` already holds (the LoRA segments', the sampler's) in one copy (`Upload`;
        on the CPU, views of these arrays and no copy)."""
        cols = [self.ids, self.positions, self.slot_pages, self.slot_offsets, self.lens, self.tables]
        p = self.prefill
        if p is not None:
            cols += [p.starts, p.lens, p.positions, p.tables]
        if self.out_rows is not None:
            cols.append(self.out_rows)
        if dev.type == "cpu":  # the arrays themselves (int64 already): `Upload`'s checks cost more than a step's build
            t = [torch.from_numpy(a) for a in cols]
            up.send(dev)
        else:
            at = [up.add(a) for a in cols]
            sent = up.send(dev)
            t = [sent[i] for i in at]
        ids, pos, pages, offsets, lens, tables = t[:6]
        meta = AttentionMetadata(slot_pages=pages, slot_offsets=offsets)
        if self.num_decode:
            meta.num_decode, meta.decode_block_tables, meta.decode_context_lens = self.num_decode, tables, lens
        if p is not None:
            meta.prefill_starts, meta.prefill_lens, meta.prefill_positions, meta.prefill_block_tables = t[6:10]
            meta.max_prefill_len = int(p.lens.max())
            meta.prefills = [PrefillSeq(int(s), int(k), int(q), meta.prefill_block_tables[i, :b])
                             for i, (s, k, q, b) in enumerate(zip(p.starts, p.lens, p.positions, p.blocks))]
        out_rows = torch.arange(len(self.ids), device=dev) if self.out_rows is None else t[-1]
        return ids, pos, meta, out_rows
