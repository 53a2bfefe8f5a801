"""`lorafleet/bench/gpu_micro.py` runs end to end without a GPU (the toy shape, on the CPU kernels): every
case, each with its bytes, its read ceiling and its parity against the reference, in its JSON."""

from __future__ import annotations

import json

from lorafleet.bench import gpu_micro, gpu_micro_quant
from lorafleet.kernels.reference import scale_bits


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
    assert case.seg.tolist() == [[0, 3, pool.tables[0], scale_bits(1.0), 1]]


def test_the_quantized_microbenchmark_writes_every_projection_and_form(tmp_path):
    """`--quant` on the CPU: every projection at T = 1, 8, 64, the full weight, int8 and int4 with
    their bytes, copy fraction and parity; torchao skipped with its reason (not measured off a GPU)."""
    report = gpu_micro_quant.run_quant(["toy"], tmp_path, device="cpu")
    saved = json.loads((tmp_path / "gpu_micro_quant.json").read_text())
    assert saved["shapes"] == report["shapes"] and saved["copy_GB/s"] > 0
    assert any("torchao" in line for line in saved["skipped"])
    rows = saved["shapes"]["toy"]
    want = [(p, t, f) for p in ("qkv", "o", "gate_up", "down") for t in gpu_micro_quant.QUANT_ROWS
            for f in ("float32 F.linear", "int8", "int4")]
    assert [(r["case"], r["rows"], r["form"]) for r in rows] == want
    for r in rows:
        assert r["us"] > 0 and r["GB/s"] > 0 and r["of_copy"] > 0 and r["error"] < 1e-5, r
    by = {(r["case"], r["rows"], r["form"]): r["bytes"] for r in rows}
    assert by[("down", 1, "int4")] < by[("down", 1, "int8")] < by[("down", 1, "float32 F.linear")]


def test_the_quantized_cases_are_llama_3_8b_projections_and_their_bytes():
    assert gpu_micro_quant.projections(gpu_micro.SHAPES["8b"]) == {
        "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    case = gpu_micro_quant.make_quant_case("o", 64, 96, 3, gpu_micro.torch.float32, gpu_micro.torch.device("cpu"))
    io = (3 * 96 + 3 * 64) * 4                                    # x read, y written
    assert case.moved["full"] == 64 * 96 * 4 + io
    assert case.moved["int8"] == 64 * 96 + 64 * 2 + io            # codes, a scale per channel
    assert case.moved["int4"] == 64 * 48 + 64 * 3 * 2 + io        # two codes a byte, a scale per 32
