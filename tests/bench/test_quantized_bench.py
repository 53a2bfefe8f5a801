"""The bench on quantized bases (issue 51): `--quantize int8|int4` from the command line to the
engine of every lorafleet system, the systems that serve full precision only skipped, the
Llama-3.2-1B and Llama-3-8B shapes (8b on the CPU in int4 only), and llama.cpp's side: the same
model as Q8_0 (the converter) or Q4_0 (`llama-quantize --pure`, built beside llama-server). The
runs and conversions here are on the micro shape (seconds); the ones that need llama.cpp's
tools are heavy (tests/bench/test_llamacpp.py says how they skip)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lorafleet.bench import fixtures, llamacpp_build, llamacpp_convert
from lorafleet.bench.fixtures import SHAPES, build_base, check_cpu_fit, weight_gib
from lorafleet.bench.jobs import Job
from lorafleet.cli.main import app
from lorafleet.errors import ConfigError

runner = CliRunner()


# -- the option, from the command line to the engine --------------------------------------------

@pytest.mark.parametrize("verb", ["run", "quick", "full"])
def test_the_throughput_verbs_pass_quantize_to_the_runner(verb, tmp_path, monkeypatch):
    import lorafleet.bench.runner

    seen = {}

    def bench(shapes, load, systems, out, **kwargs):
        seen.update(kwargs)
        return {"results": [], "duration_s": 1.0}

    def suite(shapes, out, **kwargs):
        seen.update(kwargs)
        return {"suite": verb, "reports": [], "across": [], "duration_s": 1.0}
    monkeypatch.setattr(lorafleet.bench.runner, "run_bench", bench)
    monkeypatch.setattr(lorafleet.bench.runner, "run_suite", suite)
    result = runner.invoke(app, ["bench", verb, "-m", "micro", "--systems", "lorafleet", "--quantize", "int4",
                                 "--out", str(tmp_path / "r.json"), "--json"])
    assert result.exit_code == 0, result.output
    assert seen["quantize"] == "int4"


def test_llama_cpp_passes_quantize_to_the_suite_and_builds_the_quantize_tool_first_for_int4(tmp_path, monkeypatch):
    import lorafleet.bench.runner

    seen, built = {}, []

    def suite(shapes, out, **kwargs):
        seen.update(kwargs)
        return {"suite": "llama-cpp", "reports": [], "duration_s": 1.0}
    monkeypatch.setattr(lorafleet.bench.runner, "run_suite", suite)
    monkeypatch.setattr(llamacpp_build, "server_binary", lambda say: built.append("server"))
    monkeypatch.setattr(llamacpp_build, "quantize_binary", lambda say: built.append("quantize"))
    for scheme, tools in (("int8", ["server"]), ("int4", ["server", "quantize"])):
        built.clear()
        result = runner.invoke(app, ["bench", "llama-cpp", "-m", "micro", "--quantize", scheme,
                                     "--out", str(tmp_path / "r.json"), "--json"])
        assert result.exit_code == 0, result.output
        assert seen["quantize"] == scheme and seen["device"] == "cpu" and built == tools


@pytest.mark.parametrize("args", [["run", "--quantize", "int3"], ["llama-cpp", "--quantize", "fp8"],
                                  ["decode-bound", "--quantize", "q4_0"], ["lora-decode", "--quantize", "int2"],
                                  ["overhead", "--quantize", "nf4"]])
def test_an_unknown_scheme_is_a_usage_error(args):
    result = runner.invoke(app, ["bench", *args])
    assert result.exit_code == 2 and "int8, int4" in result.output


@pytest.mark.parametrize("args", [["decode-bound", "-m", "8b"], ["decode-bound", "-m", "8b", "--quantize", "int8"],
                                  ["llama-cpp", "-m", "8b", "--quantize", "int8"],
                                  ["run", "-m", "8b", "--device", "cpu"], ["lora-decode", "-m", "8b"],
                                  ["overhead", "-m", "8b", "--device", "cpu", "--quantize", "int8"]])
def test_8b_on_the_cpu_without_int4_is_refused_before_anything_runs(args, monkeypatch):
    import lorafleet.bench.runner

    monkeypatch.setattr(lorafleet.bench.runner, "run_suite", lambda *a, **k: pytest.fail("ran"))
    monkeypatch.setattr(lorafleet.bench.runner, "run_bench", lambda *a, **k: pytest.fail("ran"))
    result = runner.invoke(app, ["bench", *args], env={"COLUMNS": "400"})
    assert result.exit_code == 2
    assert "8b shape runs on the CPU only with --quantize int4" in " ".join(result.output.split())


def test_the_runner_refuses_8b_on_the_cpu_without_int4_before_building_it(tmp_path, monkeypatch):
    from lorafleet.bench import runner as bench_runner

    monkeypatch.setattr(bench_runner, "build_base", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(ConfigError, match="do not fit in 24 GiB"):
        bench_runner.run_bench(["8b"], "peer-base", ["lorafleet"], tmp_path / "r.json", device="cpu")
    with pytest.raises(ConfigError, match="int8, int4 or a GGUF file type"):
        bench_runner.run_bench(["micro"], "peer-base", ["lorafleet"], tmp_path / "r.json", quantize="int2")


def test_the_engine_is_built_with_the_jobs_scheme_and_the_full_precision_baselines_skip(micro_dir):
    from lorafleet.bench.lorafleet_system import LorafleetInProcess
    from lorafleet.bench.static_batch import TransformersGenerate
    from lorafleet.bench.systems import MergedAccounting

    from lorafleet.bench.adapters import workload_adapters
    from lorafleet.bench.workloads import BenchRequest, Workload

    [(name, path)] = workload_adapters(micro_dir, Workload("one", 1, (4, 4), (4, 4), num_adapters=1, ranks=(8,)))
    requests = [BenchRequest([5, 17, 300], 4, adapter) for adapter in (None, name)]
    job = Job("lorafleet", str(micro_dir), requests, {name: str(path)}, threads=1, quantize="int4")
    result = LorafleetInProcess(threads=1).run(job)
    assert result.status == "ok", result.reason
    assert result.details["quantization"] == "int4"
    assert result.generated_tokens == sum(r.max_tokens for r in requests)
    for system in (TransformersGenerate(threads=1), MergedAccounting()):
        skipped = system.run(job)
        assert skipped.status == "skipped" and "quantized in int4" in skipped.reason


def test_the_daemon_is_started_with_the_jobs_scheme(tmp_path):
    from lorafleet.bench.daemon_system import serve_command

    job = Job("lorafleet-daemon", "/m", [], quantize="int8")
    cmd = serve_command(job, tmp_path / "d.sock", "cpu", "float32", 1 << 20)
    assert cmd[cmd.index("serve") + 1] == "/m" and cmd[cmd.index("--quantize") + 1] == "int8"
    assert "--quantize" not in serve_command(Job("lorafleet-daemon", "/m", []), tmp_path / "d.sock", "cpu",
                                             "float32", 1 << 20)


def test_the_serve_command_line_the_daemon_system_builds_parses(tmp_path, monkeypatch):
    """`lorafleet serve` takes every flag of it (--print-config: parsed, nothing started)."""
    from lorafleet.bench.daemon_system import serve_command

    monkeypatch.setenv("LORAFLEET_HOME", str(tmp_path / "home"))
    cmd = serve_command(Job("lorafleet-daemon", str(tmp_path), [], quantize="int4"), tmp_path / "d.sock", "cpu",
                        "float32", 1 << 26)
    result = runner.invoke(app, [*cmd[cmd.index("serve"):], "--print-config"])
    assert result.exit_code == 0, result.output
    assert 'quantize = "int4"' in result.output


@pytest.mark.heavy  # a whole benchmark run
def test_decode_bound_quick_with_quantize_reports_the_bound_and_the_memory(tmp_path):
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["bench", "decode-bound", "-m", "micro", "--quick", "--batch", "1", "--threads", "1",
                                 "--quantize", "int8", "--out", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    [row] = json.loads(out.read_text())["results"]
    assert row["quantization"] == "int8" and row["memory_target"] == 0.27
    assert row["memory_ratio"] == pytest.approx(row["model_weight_bytes"] / row["fp32_weight_bytes"])
    assert "micro float32 int8" in result.stdout and "memory" in result.stdout


@pytest.mark.heavy  # a whole benchmark run, twice
def test_lora_decode_with_quantize_times_the_fp32_adapters_on_the_quantized_base(tmp_path, monkeypatch):
    """The run quantizes the base (its weight bytes a quarter of fp32's and less), keeps the
    adapters fp32, and leaves PEFT out: it would run the fp32 base. No module of PEFT's is
    needed, even where it is missing."""
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` fails, as when not installed
    rows = {}
    for scheme in ("int4", None):
        out = tmp_path / f"{scheme}.json"
        args = ["bench", "lora-decode", "-m", "micro", "--batch", "4", "--threads", "1", "--out", str(out)]
        result = runner.invoke(app, args + (["--quantize", scheme] if scheme else ["--no-peft"]),
                               env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        [rows[scheme]] = json.loads(out.read_text())["results"]
    q, full = rows["int4"], rows[None]
    assert q["quantization"] == "int4" and full["quantization"] is None
    assert q["weight_bytes"] < full["weight_bytes"] / 4
    assert q["distinct_adapter_bytes"] == full["distinct_adapter_bytes"]  # the same fp32 adapters
    assert "fp32 base" in q["peft_mixed_skipped"] and "lorafleet_vs_peft_mixed" not in q
    assert set(q["decode_step_ms"]) == {"none", "one", "distinct"} and q["lora_op_ms"] > 0


def test_overhead_with_quantize_runs_on_the_quantized_base_and_judges_no_target(tmp_path):
    """The host's share beside a quantized forward pass: the report and the table name the
    scheme, and the targets (stated for fp32) are not judged."""
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["bench", "overhead", "-m", "micro", "--running", "4", "--adapters", "2", "--steps",
                                 "2", "--burst", "8", "--quantize", "int4", "--device", "cpu", "--threads", "1",
                                 "--out", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    [row] = json.loads(out.read_text())["results"]
    assert row["quantization"] == "int4" and row["decode"]["mean_host_ms"] > 0
    assert row["decode"]["target_met"] is None and row["burst"]["target_met"] is None
    assert "micro int4" in result.stdout


def test_the_peer_table_says_which_precisions_it_sets_against_each_other():
    from rich.console import Console

    from lorafleet.bench.tables import peer_tables

    def suite(quantize):
        row = {"model": "micro", "system": "llama.cpp", "status": "skipped", "reason": "r"}
        return {"reports": [{"workload": {"name": "peer-base-8-in-flight", "concurrency": 8},
                             "options": {"quantize": quantize}, "results": [row]}]}
    for quantize, words in ((None, "micro, f32:"), ("int8", "micro, int8 against Q8_0:"),
                            ("int4", "micro, int4 against Q4_0 (--pure):")):
        console = Console(width=300, record=True)
        for table in peer_tables(suite(quantize)):
            console.print(table)
        assert words in console.export_text()


# -- the shapes ---------------------------------------------------------------------------------

def test_the_1b_and_8b_shapes_are_llamas(tmp_path):
    from lorafleet.model.config import ModelConfig

    one, eight = SHAPES["1b"], SHAPES["8b"]
    assert (one.hidden_size, one.intermediate_size, one.num_layers, one.num_heads, one.num_kv_heads, one.head_dim,
            one.vocab_size, one.tie_word_embeddings, one.rope_theta) == (2048, 8192, 16, 32, 8, 64, 128256, True, 5e5)
    assert (eight.hidden_size, eight.intermediate_size, eight.num_layers, eight.num_heads, eight.num_kv_heads,
            eight.head_dim, eight.vocab_size, eight.tie_word_embeddings) == (4096, 14336, 32, 32, 8, 128, 128256, False)
    assert one.params() == pytest.approx(1.236e9, rel=1e-3) and eight.params() == pytest.approx(8.03e9, rel=1e-3)
    cfg = ModelConfig.from_folder(build_base("1b", tmp_path, on_device=True))  # the config as the engine reads it
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (2048, 16, 8, 64, 128256)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg8 = ModelConfig.from_folder(build_base("8b", tmp_path, on_device=True))
    assert not cfg8.tie_word_embeddings and cfg8.rope_scaling is None and cfg8.rope_theta == 500000.0


def test_the_cache_keys_of_shapes_without_rope_scaling_did_not_move():
    # the folders built before `rope_scaling` was a field stay the cache's (sizes unchanged)
    assert fixtures.cache_key("micro") == "micro-40a1f509-seed0"
    assert fixtures.cache_key("smol") == "smol-25231e4f-seed0"
    assert fixtures.cache_key("tiny") == "tiny-a436cf28-seed0"


def test_8b_fits_the_cpu_only_in_int4_and_the_memory_estimates_follow_the_layout():
    check_cpu_fit("8b", "int4")
    for scheme in (None, "int8"):
        with pytest.raises(ConfigError, match="30 GiB in float32.*4.2 GiB in int4"):
            check_cpu_fit(shape="8b", quantize=scheme)
    for shape in ("micro", "smol", "1b"):
        check_cpu_fit(shape, None)
    for name in ("1b", "8b"):  # tied or not, every matrix quantized: int4 a half byte and 2/32 of scales a weight
        one = SHAPES[name]
        assert weight_gib(one, "int4") / weight_gib(one, None) == pytest.approx(0.5625 / 4, rel=1e-3)
        assert weight_gib(one, "int8") / weight_gib(one, None) == pytest.approx(0.25, rel=2e-3)


# -- llama.cpp's side: the command lines, the cache --------------------------------------------

def test_int4_is_llama_quantize_pure_q4_0_from_the_f32_file():
    cmd = llamacpp_convert.quantize_command(Path("/b/llama-quantize"), Path("/m/f32.gguf"), Path("/m/q.gguf"), 2)
    assert list(map(str, cmd)) == ["/b/llama-quantize", "--pure", "/m/f32.gguf", "/m/q.gguf", "Q4_0", "2"]
    assert list(map(str, llamacpp_convert.quantize_command(Path("q"), Path("a"), Path("b"))))[-1] == "Q4_0"


def test_int8_is_the_converters_q8_0_and_each_scheme_its_own_cached_file(micro_dir, monkeypatch, tmp_path):
    calls = []

    def convert(args, what):
        calls.append(("convert", [str(a) for a in args]))
        Path(args[args.index("--outfile") + 1]).write_bytes(b"GGUF")

    def run(cmd, what):
        calls.append(("quantize", [str(a) for a in cmd]))
        Path(cmd[3]).write_bytes(b"GGUF")
    model = tmp_path / "model"
    model.mkdir()
    for f in micro_dir.iterdir():
        (model / f.name).symlink_to(f)
    monkeypatch.setattr(llamacpp_build, "converters", lambda say: Path("/conv"))
    monkeypatch.setattr(llamacpp_build, "quantize_binary", lambda say: Path("/bin/llama-quantize"))
    monkeypatch.setattr(llamacpp_convert, "_convert", convert)
    monkeypatch.setattr(llamacpp_convert, "_run", run)
    q8 = llamacpp_convert.convert_model(model, quantize="int8")
    assert q8.name.startswith("model-q8_0-") and calls[-1][0] == "convert"
    args = calls[-1][1]
    assert args[0] == "/conv/convert_hf_to_gguf.py" and args[args.index("--outtype") + 1] == "q8_0"
    calls.clear()
    q4 = llamacpp_convert.convert_model(model, quantize="int4", threads=2)
    f32 = llamacpp_convert.convert_model(model)
    assert [c[0] for c in calls] == ["convert", "quantize"]  # the f32 file first, then the tool on it
    assert calls[0][1][calls[0][1].index("--outtype") + 1] == "f32"
    assert calls[1][1] == ["/bin/llama-quantize", "--pure", str(f32), calls[1][1][3], "Q4_0", "2"]
    assert q4.name == f32.name.replace("model-f32-", "model-q4_0-pure-") and q4.is_file()
    assert len({q8, q4, f32}) == 3
    calls.clear()
    assert llamacpp_convert.convert_model(model, quantize="int4") == q4 and calls == []  # cached
    with pytest.raises(ValueError):
        llamacpp_convert.convert_model(model, quantize="int2")


def test_the_quantize_tool_has_a_cache_entry_of_its_own_and_a_servers_cache_keeps_its_key(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAFLEET_HOME", str(tmp_path))
    monkeypatch.delenv(llamacpp_build.SERVER_ENV, raising=False)
    monkeypatch.delenv(llamacpp_build.QUANTIZE_ENV, raising=False)
    inputs = llamacpp_build.build_inputs()
    server_key = llamacpp_build.build_key("llama-server", inputs)
    assert server_key == llamacpp_build._digest_json(inputs)  # as before the quantize tool: no rebuild
    assert llamacpp_build.build_key("llama-quantize", inputs) != server_key
    server = llamacpp_build.cache_root() / f"server-{server_key}" / "llama-server"
    server.parent.mkdir(parents=True)
    server.write_text("")
    assert llamacpp_build.server_binary() == server
    with monkeypatch.context() as m, \
            pytest.raises(llamacpp_build.LlamaCppUnavailable, match="cannot build llama-quantize: cmake, ninja"):
        m.setattr(llamacpp_build, "build_inputs", lambda: inputs)
        m.setattr(llamacpp_build, "_tool", lambda name: None)  # no cmake: what a build would need
        llamacpp_build.quantize_binary()  # the server's cache alone is not the tool: it is built
    tool = llamacpp_build.cache_root() / f"quantize-{llamacpp_build.build_key('llama-quantize', inputs)}"
    (tool / "llama-quantize").parent.mkdir()
    (tool / "llama-quantize").write_text("")
    assert llamacpp_build.quantize_binary() == tool / "llama-quantize"


def test_a_quantize_tool_of_ones_own_or_beside_ones_own_server(tmp_path, monkeypatch):
    monkeypatch.delenv(llamacpp_build.QUANTIZE_ENV, raising=False)
    server, tool = tmp_path / "llama-server", tmp_path / "llama-quantize"
    for f in (server, tool):
        f.write_text("")
        f.chmod(0o755)
    monkeypatch.setenv(llamacpp_build.SERVER_ENV, str(server))
    assert llamacpp_build.quantize_binary() == tool
    monkeypatch.setenv(llamacpp_build.QUANTIZE_ENV, str(tmp_path / "nope"))
    with pytest.raises(llamacpp_build.LlamaCppUnavailable, match="LORAFLEET_LLAMA_QUANTIZE"):
        llamacpp_build.quantize_binary()


def test_a_base_made_in_memory_is_no_model_for_llama_cpps_converter(tmp_path):
    folder = build_base("micro", tmp_path, on_device=True)
    with pytest.raises(llamacpp_build.LlamaCppUnavailable, match="made in memory"):
        llamacpp_convert._model_files(folder)


# -- with llama.cpp's tools ---------------------------------------------------------------------

@pytest.mark.heavy  # converts with llama.cpp's converter, builds and runs llama-quantize (minutes the first time)
def test_the_micro_base_converts_to_q8_0_and_to_pure_q4_0(micro_dir):
    import gguf

    from tests.bench.test_llamacpp import need

    q8 = need(lambda: llamacpp_convert.convert_model(micro_dir, quantize="int8"))
    q4 = need(lambda: llamacpp_convert.convert_model(micro_dir, quantize="int4", threads=1))
    Q = gguf.GGMLQuantizationType
    for path, kind in ((q8, Q.Q8_0), (q4, Q.Q4_0)):
        types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
        matrices = {n: k for n, k in types.items() if not n.endswith("norm.weight")}
        assert set(matrices.values()) == {kind}, matrices  # every matrix, the output one included
        assert "output.weight" in matrices and "token_embd.weight" in matrices
        assert {types[n] for n in types if n.endswith("norm.weight")} == {Q.F32}


@pytest.mark.heavy  # lorafleet's daemon and llama-server on the same quantized micro base
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_llama_cpp_with_quantize_serves_both_on_the_same_quantized_base(scheme, tmp_path):
    from tests.bench.test_llamacpp import need

    need(llamacpp_build.server_binary)
    need(llamacpp_build.quantize_binary)
    # the default bench cache, where the tools above are: the micro base is built there if need be
    out = tmp_path / "peer.json"
    result = runner.invoke(app, ["bench", "llama-cpp", "-m", "micro", "-w", "peer-one-adapter", "--in-flight", "8",
                                 "--threads", "1", "--quantize", scheme, "--out", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    [report] = json.loads(out.read_text())["reports"]
    assert report["options"]["quantize"] == scheme
    rows = {r["system"]: r for r in report["results"]}
    for row in rows.values():
        assert row["status"] == "ok", row["reason"]
        assert row["generated_tokens"] == 64 * 64
    assert rows["llama.cpp"]["details"]["model_gguf_type"] == {"int8": "q8_0", "int4": "q4_0"}[scheme]
    assert rows["lorafleet-daemon"]["details"]["quantization"] == scheme
    assert "--quantize" in rows["lorafleet-daemon"]["details"]["command"]
    assert {"int8": "int8 against Q8_0", "int4": "int4 against Q4_0"}[scheme] in result.stdout


def test_llama_server_is_built_with_llama_quantize_beside_it(tmp_path, monkeypatch):
    """One cmake build makes both tools (the shared ggml compiles once); the quantize tool is then
    found beside the cached server, with no build of its own. The build's steps are faked here:
    the real build runs in the heavy tier (test_llamacpp.py)."""
    steps = []

    def step(cmd, log, what):
        steps.append([str(c) for c in cmd])
        if "--build" in cmd:
            for tool in cmd[cmd.index("--target") + 1:cmd.index("-j")]:
                (Path(cmd[cmd.index("--build") + 1]) / "bin").mkdir(parents=True, exist_ok=True)
                (Path(cmd[cmd.index("--build") + 1]) / "bin" / tool).write_text("#!/bin/sh\n")

    monkeypatch.setattr(llamacpp_build, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(llamacpp_build, "_step", step)
    monkeypatch.setattr(llamacpp_build, "_download_sdist", lambda into, log: into)
    monkeypatch.setattr(llamacpp_build, "_extract", lambda tarball, dest: dest)
    monkeypatch.setattr(llamacpp_build, "_tool", lambda name: f"/usr/bin/{name}")
    monkeypatch.delenv(llamacpp_build.SERVER_ENV, raising=False)
    monkeypatch.delenv(llamacpp_build.QUANTIZE_ENV, raising=False)
    server = llamacpp_build.server_binary()
    builds = [s for s in steps if "--build" in s]
    assert len(builds) == 1 and builds[0][builds[0].index("--target") + 1:][:2] == ["llama-server", "llama-quantize"]
    assert llamacpp_build.quantize_binary() == server.with_name("llama-quantize")
    assert len([s for s in steps if "--build" in s]) == 1  # nothing more built
