"""`kernels/gpu_micro.py` runs end to end without a GPU (the toy shape, on the CPU kernels): every
case, each with its bytes, its read ceiling and its parity against the reference, in its JSON."""

from __future__ import annotations

import json

from lorafleet.kernels import gpu_micro


def test_the_microbenchmark_writes_every_case_with_its_ceiling_and_parity(tmp_path):
    report = gpu_micro.run(["toy"], tmp_path, device="cpu")
    saved = json.loads((tmp_path / "gpu_micro.json").read_text())
    assert saved["shapes"] == report["shapes"] and saved["copy_GB/s"] > 0
    rows = saved["shapes"]["toy"]
    assert [r["case"] for r in rows] == ["r16 x 64", "ranks 8-256", "1 r16 layer", "64 r8-64", "decode attention b4 ctx 64"]
    for r in rows:
        assert r["us"] > 0 and r["bytes"] > 0 and r["error"] < 1e-5, r
    assert all(r["of_read"] > 0 and r["read_GB/s"] > 0 for r in rows[:4])


def test_the_case_bytes_are_the_adapters_rows_and_the_activations():
    shape = gpu_micro.SHAPES["toy"]
    case, pool = gpu_micro.make_case("one", shape, [16], ("q_proj", "v_proj"), [3], ("qkv",), gpu_micro.torch.float32,
                                     "cpu")
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    rows = 16 * (h + h) + 16 * (h + kv)                           # q and v, A and Bt
    activations = 3 * h + 2 * 3 * (h + 2 * kv)                    # x read, out read and written
    assert case.moved == 4 * (rows + activations)
    assert case.seg.tolist() == [[0, 3, pool.tables[0]]]
