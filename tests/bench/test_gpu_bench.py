"""`lorafleet bench gpu` runs end to end on the CPU at a small shape (on a GPU it is
kernels/gpu_check.sh's third part): every figure it reports is there and sane."""

from __future__ import annotations

from lorafleet.bench.gpu import run_gpu_bench
from lorafleet.bench.tables import gpu_table


def test_the_gpu_bench_reports_kernels_engine_cases_and_ratios(tmp_path):
    report = run_gpu_bench("micro", "cpu", batch=4, max_tokens=3, many=10, context=32, root=tmp_path)
    copy, *kernels = report["kernels"]
    assert copy["copy_GB/s"] > 0
    assert [k["kernel"] for k in kernels] == ["lora decode r16", "lora decode ranks 8-256", "paged decode attention ctx 32"]
    assert all(k["backend"] == "cpu" and k["us"] > 0 and k["bytes"] > 0 for k in kernels)
    cases = report["engine"]["cases"]
    assert set(cases) == {"no adapter", "1 adapter r16", "8 adapters r8-64", "10 adapters r8-64",
                          "mixed ranks 8-256", "uniform rank 30"}
    assert all(c["tokens_per_s"] > 0 and c["kernels"] == "cpu" for c in cases.values())
    assert set(report["engine"]["ratios"]) == {"1 adapter r16 / no adapter", "10 adapters / 8 adapters",
                                               "mixed ranks / uniform rank"}
    assert report["engine"]["recaptures"] == 0
    assert gpu_table([report]).row_count == 3 + len(cases) + 3
