"""`lorafleet bench decode-bound`: the weight bytes a decode step reads, and the report's figures
against each other (micro model: seconds, not minutes)."""

from __future__ import annotations

import json
import statistics
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from lorafleet.bench import lora_decode
from lorafleet.bench.decode_bound import matmul_cached_time, matmul_weights, run_decode_bound, step_weight_bytes


@pytest.mark.unit
def test_weight_bytes_count_each_storage_once_and_the_embedding_only_as_the_head():
    embed, head, qkv = torch.zeros(100, 8), torch.zeros(100, 8), torch.zeros(24, 8)
    untied = {"embed": embed, "lm_head": head, "layers.0.qkv": qkv, "norm": torch.zeros(8)}
    assert step_weight_bytes(untied) == (head.numel() + qkv.numel() + 8) * 4
    tied = {"embed": embed, "lm_head": embed, "layers.0.qkv": qkv, "norm": torch.zeros(8)}
    assert step_weight_bytes(tied) == (embed.numel() + qkv.numel() + 8) * 4


@pytest.fixture(scope="module")
def report():
    return run_decode_bound("micro", batches=(1, 4), steps=3, rounds=3, threads=1)


@pytest.mark.heavy  # a whole benchmark run
def test_the_report_sets_each_rounds_steps_against_that_rounds_bound(report):
    nbytes, bws = report["weight_bytes"], report["round_bandwidths_gb_s"]
    assert nbytes > 0 and len(bws) == 3 and all(bw > 0 for bw in bws)
    assert report["bandwidth_gb_s"] == pytest.approx(statistics.median(bws))
    assert report["bound_ms"] == pytest.approx(nbytes / (report["bandwidth_gb_s"] * 1e9) * 1e3)
    assert [r["batch"] for r in report["batches"]] == [1, 4]
    for r in report["batches"]:
        steps = r["round_step_ms"]
        assert len(steps) == 3 and all(t > 0 for t in steps)
        assert r["round_ratios"] == pytest.approx([t / 1e3 * bw * 1e9 / nbytes for t, bw in zip(steps, bws)])
        assert r["ratio"] == pytest.approx(statistics.median(r["round_ratios"]))
        assert r["step_ms"] == pytest.approx(statistics.median(steps))
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / r["step_ms"] * 1e3)
        matmuls = r["round_matmul_ms"]  # the profile of a miss: the step's matmuls alone, each round
        assert len(matmuls) == 3 and all(0 < m < t for m, t in zip(matmuls, steps))
        assert r["round_matmul_ratios"] == pytest.approx([m / 1e3 * bw * 1e9 / nbytes for m, bw in zip(matmuls, bws)])
        assert r["matmul_ms"] == pytest.approx(statistics.median(matmuls))
        assert r["matmul_ratio"] == pytest.approx(statistics.median(r["round_matmul_ratios"]))
        cached = r["round_cached_ms"]  # and their compute floor: the same matmuls on weights in cache
        assert len(cached) == 3 and all(c > 0 for c in cached)
        assert r["round_cached_ratios"] == pytest.approx([c / 1e3 * bw * 1e9 / nbytes for c, bw in zip(cached, bws)])
        assert r["cached_ms"] == pytest.approx(statistics.median(cached))
        assert r["cached_ratio"] == pytest.approx(statistics.median(r["round_cached_ratios"]))
        hosts = r["round_host_ms"]  # and the engine's part of each round's steps
        assert len(hosts) == 3 and all(0 < h < t for h, t in zip(hosts, steps))
        assert r["host_ms"] == pytest.approx(statistics.median(hosts))
    assert report["target_met"] == all(r["ratio"] <= 1.5 for r in report["batches"] if r["batch"] in (1, 8))
    others = report["round_other_cores"]  # other work on the machine, each round
    assert len(others) == 3 and all(o is None or o >= 0 for o in others)


@pytest.mark.heavy  # a whole benchmark run
def test_a_round_beside_other_work_is_named_under_the_table(monkeypatch):
    from rich.console import Console

    from lorafleet.bench import decode_bound, suite_tables

    clock = {"busy": 0.0, "ours": 0.0}

    def cpu_seconds():  # the machine busy 1.5 cores' worth per call beyond this process: other work
        clock["busy"] += 1.5
        return clock["busy"], clock["ours"]

    monkeypatch.setattr(decode_bound, "cpu_seconds", cpu_seconds)
    monkeypatch.setattr(decode_bound, "other_cores", lambda cpu_s, seconds: cpu_s / 2.0)  # as over 2 s
    noisy = run_decode_bound("micro", batches=(1,), steps=2, rounds=2, threads=1)
    assert noisy["round_other_cores"] == [0.75, 0.75] and noisy["other_cores"] == 0.75
    console = Console(width=400, record=True)
    console.print(suite_tables.decode_bound_table([noisy]))
    text = " ".join(console.export_text().split())  # the caption wraps at the table's width
    assert "noisy: micro: other work" in text and "kept 0.8 cores busy in its busiest round" in text


@pytest.mark.heavy  # a whole benchmark run
def test_the_cli_runs_it_and_writes_the_report(tmp_path):
    from lorafleet.cli.main import app

    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["bench", "decode-bound", "--model", "micro", "--batch", "2", "--quick",
                                      "--threads", "1", "--out", str(out)], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    [row] = json.loads(out.read_text())["results"]
    assert row["shape"] == "micro" and [b["batch"] for b in row["batches"]] == [2] and row["dtype"] == "float32"
    assert "decode-bound" in result.stdout


@pytest.mark.unit
def test_the_matmuls_timed_are_each_weight_matrix_once_and_no_embedding():
    embed, qkv, head = torch.zeros(10, 4), torch.zeros(12, 4), torch.zeros(10, 4)
    untied = {"embed": embed, "layers.0.qkv": qkv, "layers.0.norm": torch.zeros(4), "lm_head": head}
    assert [(t.data_ptr(), s, o) for t, s, o in matmul_weights(untied)] == \
        [(qkv.data_ptr(), None, None), (head.data_ptr(), None, None)]
    panels = torch.zeros(2, 4, 16)  # a weight packed by `Kernels.pack` is a matrix too
    assert [t.data_ptr() for t, _, _ in matmul_weights({**untied, "layers.0.down": panels})] == \
        [qkv.data_ptr(), head.data_ptr(), panels.data_ptr()]
    tied = {"embed": embed, "layers.0.qkv": qkv, "layers.1.qkv": qkv, "lm_head": embed}
    assert [t.data_ptr() for t, _, _ in matmul_weights(tied)] == [qkv.data_ptr(), embed.data_ptr()]


@pytest.mark.heavy  # a whole benchmark run
def test_bf16_halves_the_bytes_a_step_reads(report):
    bf16 = run_decode_bound("micro", batches=(1,), steps=2, rounds=1, threads=1, dtype="bfloat16")
    assert bf16["dtype"] == "bfloat16" and report["dtype"] == "float32"
    assert bf16["weight_bytes"] * 2 == report["weight_bytes"]


@pytest.mark.unit
def test_the_compute_floor_is_each_layouts_rate_in_cache_times_the_bytes_of_its_weights(monkeypatch):
    """A kernel that takes 1 ns a byte: the floor is the step's matmul bytes in ns, timed on
    slices no larger than asked, each layout (the dimensions after the first, the dtype) once.
    The kernel's time is on a clock of the test's (the timer's `perf_counter`), which only the
    kernel moves: a busy-waiting kernel on the wall clock missed the 15% it was given once in CI
    (+18%), on a machine whose host takes its CPUs now and then."""
    seen, now = [], [0.0]

    def linear(x, w):
        seen.append((tuple(w.shape), w.dtype))
        now[0] += w.numel() * w.element_size() * 1e-9
        return x.new_zeros(x.shape[0], w.shape[0])

    monkeypatch.setattr(lora_decode, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    w = {"embed": torch.zeros(50, 1024), "layers.0.up": torch.zeros(64, 1024), "layers.1.up": torch.zeros(96, 1024),
         "layers.0.down": torch.zeros(32, 512), "lm_head": torch.zeros(16, 512, dtype=torch.bfloat16)}
    model = SimpleNamespace(w=w, kernels=SimpleNamespace(linear=linear), dtype=torch.float32)
    floor = matmul_cached_time(model, rows=4, slice_bytes=64 << 10, calls=4, passes=2)
    nbytes = sum(t.numel() * t.element_size() for n, t in w.items() if n != "embed")
    assert floor == pytest.approx(nbytes * 1e-9, rel=1e-9)
    assert set(seen) == {((16, 1024), torch.float32), ((32, 512), torch.float32), ((16, 512), torch.bfloat16)}
    assert all(r * c * (2 if d == torch.bfloat16 else 4) <= 64 << 10 for (r, c), d in seen)


# -- quantized bases (issue 51) ----------------------------------------------------------------

def _quantized_micro(scheme: str) -> dict[str, torch.Tensor]:
    from lorafleet.model.quant import quantize

    g = torch.Generator().manual_seed(0)
    w = {"embed": torch.randn(96, 64, generator=g), "norm": torch.ones(64), "layers.0.in_norm": torch.ones(64)}
    for name, shape in (("layers.0.qkv", (128, 64)), ("layers.0.down", (64, 128)), ("lm_head", (96, 64))):
        w[name], w[name + "_s"] = quantize(torch.randn(shape, generator=g), scheme)
    return w


@pytest.mark.unit
def test_a_quantized_step_reads_its_codes_and_scales_and_the_norms_by_hand():
    int8, int4 = _quantized_micro("int8"), _quantized_micro("int4")
    norms = 2 * 64 * 4
    # int8: a byte a weight, one fp16 scale per output channel; the untied embedding not read
    assert step_weight_bytes(int8) == (128 * 64 + 64 * 128 + 96 * 64) + 2 * (128 + 64 + 96) + norms
    # int4: half a byte a weight, an fp16 scale per 32 weights
    assert step_weight_bytes(int4) == (128 * 64 + 64 * 128 + 96 * 64) // 2 + 2 * (128 * 2 + 64 * 4 + 96 * 2) + norms
    assert int4["layers.0.qkv"].dtype == torch.uint8 and int8["layers.0.qkv"].dtype == torch.int8
    tied = {**int4, "embed": int4["lm_head"], "embed_s": int4["lm_head_s"]}  # the head's storage: counted once
    assert step_weight_bytes(tied) == step_weight_bytes(int4)


@pytest.mark.unit
def test_the_matmuls_of_a_quantized_model_pass_each_weight_with_its_scales_and_offsets_at_its_input_width(monkeypatch):
    w = _quantized_micro("int4")
    w["layers.0.down_o"] = torch.zeros(64, 4)  # a GGUF file's affine type: its offsets go with it
    triples = matmul_weights(w)
    assert [(t.data_ptr(), s.data_ptr(), o) for t, s, o in triples[:1] + triples[2:]] == \
        [(w[n].data_ptr(), w[n + "_s"].data_ptr(), None) for n in ("layers.0.qkv", "lm_head")]
    assert triples[1][0] is w["layers.0.down"] and triples[1][2] is w["layers.0.down_o"] and len(triples) == 3
    seen = []

    def linear(x, q, bias=None, scales=None, offsets=None):
        from lorafleet.kernels.reference import linear as reference

        seen.append((x.shape[1], x.dtype, q.dtype, scales is not None, bias, offsets is not None))
        return reference(x, q, bias, scales, offsets)
    model = SimpleNamespace(w=w, kernels=SimpleNamespace(linear=linear), dtype=torch.float32)
    from lorafleet.bench.decode_bound import matmul_time

    assert matmul_time(model, rows=2, passes=1) > 0
    assert seen == [(64, torch.float32, torch.uint8, True, None, False),
                    (128, torch.float32, torch.uint8, True, None, True), (64, torch.float32, torch.uint8, True, None, False)]
    seen.clear()
    assert matmul_cached_time(model, rows=2, calls=1, passes=1) > 0
    assert {s[:4] for s in seen} == {(64, torch.float32, torch.uint8, True), (128, torch.float32, torch.uint8, True)}


@pytest.mark.heavy  # a whole benchmark run
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_base_is_measured_against_its_quantized_bytes_and_its_memory_against_fp32(scheme, report):
    q = run_decode_bound("micro", batches=(1,), steps=2, rounds=1, threads=1, quantize=scheme)
    assert q["quantization"] == scheme and report["quantization"] is None
    from lorafleet.bench.fixtures import SHAPES, build_base, weight_gib
    from lorafleet.model.loader import load_model

    model = load_model(build_base("micro"), quantize=scheme)
    assert q["weight_bytes"] == step_weight_bytes(model.w) < report["weight_bytes"]
    assert q["fp32_weight_bytes"] == report["fp32_weight_bytes"] == report["model_weight_bytes"]
    assert q["fp32_weight_bytes"] == SHAPES["micro"].params() * 4
    assert q["model_weight_bytes"] == pytest.approx(weight_gib(SHAPES["micro"], scheme) * 2 ** 30)
    assert q["memory_ratio"] == pytest.approx(q["model_weight_bytes"] / q["fp32_weight_bytes"])
    assert q["memory_target"] == {"int8": 0.27, "int4": 0.15}[scheme] and report["memory_target"] is None
    assert q["batches"][0]["matmul_ms"] > 0


@pytest.mark.unit
def test_8b_on_the_cpu_is_refused_unless_int4_before_anything_is_built(monkeypatch):
    from lorafleet.bench import decode_bound
    from lorafleet.errors import ConfigError

    monkeypatch.setattr(decode_bound, "build_base", lambda *a, **k: pytest.fail("built"))
    for scheme in (None, "int8"):
        with pytest.raises(ConfigError, match="8b shape runs on the CPU only with --quantize int4.*do not fit in 24 GiB"):
            run_decode_bound("8b", quantize=scheme)
