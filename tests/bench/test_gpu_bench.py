"""`lorafleet bench gpu` runs end to end on the CPU at a small shape (on a GPU it is
kernels/gpu_check.sh's third part): every figure it reports is there and sane."""

from __future__ import annotations

import pytest

from lorafleet.bench.gpu import run_gpu_bench
from lorafleet.bench.suite_tables import gpu_table


@pytest.mark.heavy  # a whole benchmark run
def test_the_gpu_bench_reports_kernels_engine_cases_and_ratios(tmp_path):
    report = run_gpu_bench("micro", "cpu", batches=[4], max_tokens=3, many=10, context=32, root=tmp_path)
    copy, *kernels = report["kernels"]
    assert copy["copy_GB/s"] > 0
    assert [k["kernel"] for k in kernels] == ["lora r16 x 64", "lora ranks 8-256", "lora 1 r16 layer",
                                              "decode attention b4 ctx 32"]
    assert all(k["backend"] == "cpu" and k["us"] > 0 and k["bytes"] > 0 and k["of_read"] > 0 for k in kernels)
    assert all(k["error"] < 1e-5 for k in kernels)  # the C++ kernels against the references
    run = report["engine"]["batches"][4]
    cases = run["cases"]
    assert set(cases) == {"no adapter", "1 adapter r16", "1 adapter r16, async_decode", "8 adapters r8-64",
                          "4 distinct adapters r8-64", "10 registered r8-64", "mixed ranks 8-256", "uniform rank 30"}
    assert all(c["tokens_per_s"] > 0 and c["kernels"] == "cpu" and 0 < c["host_share"] < 1 for c in cases.values())
    assert cases["4 distinct adapters r8-64"]["bound_ms"] > 0
    assert set(run["ratios"]) == {"1 adapter r16 / no adapter", "1 adapter r16: async_decode / off",
                                  "10 registered / 8 adapters", "mixed ranks / uniform rank",
                                  "4 distinct adapters r8-64 step / its bound",
                                  "4 distinct adapters r8-64 step: host share",
                                  "1 adapter r16, async_decode step: host share"}
    assert run["recaptures"] == 0
    assert gpu_table([report]).row_count == 4 + len(cases) + 7


@pytest.mark.heavy  # a whole benchmark run
def test_the_gpu_bench_on_a_quantized_base_at_batch_8(tmp_path):
    """`--quantize int4` reaches the engine (what gpu_check.sh's 8b-int4 stage compares with bf16),
    and batch 8, --quick's, keeps its 8 distinct adapters apart from the 8-adapter case."""
    report = run_gpu_bench("micro", "cpu", batches=[8], max_tokens=2, many=10, context=32, root=tmp_path,
                           quantize="int4")
    engine = report["engine"]
    assert engine["quantization"] == "int4"
    cases = engine["batches"][8]["cases"]
    assert {"8 adapters r8-64", "8 distinct adapters r8-64"} <= set(cases)
    assert cases["8 distinct adapters r8-64"]["bound_ms"] > 0
