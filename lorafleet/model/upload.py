"""Host numbers sent to the device: the one way a step's inputs, its LoRA segments and its
sampler's per-row numbers cross to a GPU."""

from __future__ import annotations

import numpy as np
import torch

_NUMPY = {torch.long: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.float64: np.float64,
          torch.bool: np.bool_}
_ALIGN = 8  # bytes: every column starts where any dtype's view may


class Upload:
    """Columns of host numbers gathered for one copy. On a GPU: one pinned buffer and one
    non-blocking copy (a pageable `.to(device)` waits for the stream, and a step's one wait must
    stay the read of its tokens), each column a view of the copy at its dtype. On the CPU: views
    of the arrays themselves, no copy. Once sent, `sent` holds the columns where they went."""

    def __init__(self):
        self.columns: list[tuple[np.ndarray, torch.dtype]] = []
        self.sent: list[torch.Tensor] = []

    def add(self, values, dtype: torch.dtype = torch.long) -> int:
        """A column (an array or a list) sent at `dtype` (one numpy lacks, bfloat16 say, travels as
        float32 and is converted on the device); returns its index in `send`'s list."""
        self.columns.append((np.ascontiguousarray(values, dtype=_NUMPY.get(dtype, np.float32)), dtype))
        return len(self.columns) - 1

    def send(self, dev: torch.device) -> list[torch.Tensor]:
        if dev.type != "cuda":
            self.sent = [_at(torch.from_numpy(a), dtype) for a, dtype in self.columns]
            return self.sent
        host = torch.empty(self.nbytes(), dtype=torch.uint8, pin_memory=True)
        spans = self.write(host.numpy())
        return self.views(host.to(dev, non_blocking=True), spans)

    def nbytes(self) -> int:
        """The bytes `write` fills: every column, each padded to a multiple of 8."""
        return sum(-(-a.nbytes // _ALIGN) * _ALIGN for a, _ in self.columns)

    def write(self, raw: np.ndarray) -> list[tuple[int, int]]:
        """Every column's bytes into `raw` (uint8, at least `nbytes()` long, starting at a multiple
        of 8), each column at a multiple of 8; returns each column's (start, bytes) in `raw`."""
        spans, at = [], 0
        for a, _ in self.columns:
            spans.append((at, a.nbytes))
            raw[at:at + a.nbytes] = a.reshape(-1).view(np.uint8)
            at += -(-a.nbytes // _ALIGN) * _ALIGN
        return spans

    def views(self, flat: torch.Tensor, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Each column as a view of `flat` (uint8: `write`'s buffer, or its copy on a device) at
        its dtype; kept as `sent`."""
        self.sent = [_at(flat[start:start + n].view(torch.from_numpy(a[:0]).dtype).view(a.shape), dtype)
                     for (a, dtype), (start, n) in zip(self.columns, spans)]
        return self.sent


def _at(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)
