"""`model/upload.py`: a step's host numbers packed into one buffer for one copy, and read back
at their dtypes (the GPU path's packing, checked on the CPU: the copy is the only part left out)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lorafleet.model.upload import Upload

pytestmark = pytest.mark.unit


def columns() -> tuple[Upload, list]:
    up = Upload()
    want = [(np.arange(5, dtype=np.int64) - 2, torch.long), ([0.5, 1 / 3, float("inf")], torch.float32),
            ([], torch.long), (np.arange(12).reshape(3, 4), torch.long), ([True, False, True], torch.bool),
            ([0.1, 2.5], torch.bfloat16), ([7], torch.int32)]
    for values, dtype in want:
        up.add(values, dtype)
    return up, want


def test_the_packed_buffer_reads_back_every_column_at_its_dtype_and_shape():
    up, want = columns()
    host = torch.full((up.nbytes() + 8,), 255, dtype=torch.uint8)  # a byte past the end: never written
    spans = up.write(host.numpy())
    assert all(start % 8 == 0 for start, _ in spans) and up.nbytes() == spans[-1][0] + 8
    assert (host[up.nbytes():] == 255).all()
    for got, (values, dtype) in zip(up.views(host, spans), want):
        ref = torch.tensor(np.asarray(values, dtype=np.float32 if dtype == torch.bfloat16 else None)).to(dtype)
        assert got.dtype == dtype and got.shape == ref.shape and torch.equal(got, ref.reshape(got.shape))
    assert len(up.sent) == len(want)  # what the step's readers take their columns from


def test_on_the_cpu_columns_are_the_arrays_themselves():
    up = Upload()
    a = np.arange(4, dtype=np.int64)
    up.add(a)
    (t,) = up.send(torch.device("cpu"))
    assert t.data_ptr() == a.ctypes.data  # no copy
