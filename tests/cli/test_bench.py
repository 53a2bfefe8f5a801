"""`lorafleet bench`: deterministic workloads, cached random models, one subcommand per
benchmark run end to end, and a CLI that answers without importing torch."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lorafleet.bench import fixtures
from lorafleet.bench.fixtures import SHAPES, build_base
from lorafleet.bench.workloads import WORKLOADS, Workload, get_workload, make_requests
from lorafleet.cli.main import app
from lorafleet.errors import ConfigError

runner = CliRunner()


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A LORAFLEET_HOME whose bench cache already holds the micro model."""
    path = tmp_path_factory.mktemp("home")
    build_base("micro", root=path / "bench")
    return path


def test_requests_are_the_same_for_the_same_seed_and_differ_for_another():
    load = get_workload("base-only")
    assert make_requests(load, 8192) == make_requests(load, 8192)
    other = Workload("other", load.num_requests, load.prompt_len, load.output_len, seed=load.seed + 1)
    assert make_requests(other, 8192) != make_requests(load, 8192)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_requests_respect_the_workload_ranges_and_the_vocabulary(name):
    load = WORKLOADS[name]
    requests = make_requests(load, vocab_size=100)
    assert len(requests) == load.num_requests
    for r in requests:
        assert load.prompt_len[0] + load.system_len <= len(r.prompt) <= load.prompt_len[1] + load.system_len
        assert load.output_len[0] <= r.max_tokens <= load.output_len[1]
        assert all(3 <= t < 100 for t in r.prompt)


def test_request_lengths_do_not_depend_on_the_vocabulary():
    load = get_workload("base-only")
    def lengths(vocab):
        return [(len(r.prompt), r.max_tokens) for r in make_requests(load, vocab)]
    assert lengths(512) == lengths(49152)


def test_a_workload_with_an_empty_range_is_refused():
    with pytest.raises(ConfigError, match="prompt_len"):
        Workload("bad", 4, (10, 5), (1, 2))


def test_build_base_makes_a_folder_transformers_loads_and_reuses_it(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    folder = build_base("micro", root=tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.hidden_size == SHAPES["micro"].hidden_size
    assert model.config.vocab_size == SHAPES["micro"].vocab_size
    assert (folder / "model.safetensors").is_file()

    def no_rebuild(*args):
        raise AssertionError("the cached model was rebuilt")
    monkeypatch.setattr(fixtures, "_save_random_llama", no_rebuild)
    assert build_base("micro", root=tmp_path) == folder


def test_the_cache_key_follows_the_sizes_not_the_note(monkeypatch):
    key = fixtures.cache_key("micro")
    micro = SHAPES["micro"]
    monkeypatch.setitem(SHAPES, "micro", dataclasses.replace(micro, note="reworded"))
    assert fixtures.cache_key("micro") == key
    monkeypatch.setitem(SHAPES, "micro", dataclasses.replace(micro, num_layers=3))
    assert fixtures.cache_key("micro") != key


def test_a_failed_build_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    def crash(spec, seed, folder, on_device):
        (folder / "config.json").write_text("{}")
        raise RuntimeError("killed halfway")
    monkeypatch.setattr(fixtures, "_save_random_llama", crash)
    with pytest.raises(RuntimeError):
        build_base("micro", root=tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.heavy  # a whole benchmark run end to end
def test_bench_quick_runs_every_system_warmed_up_and_writes_the_json_report_and_plots(home, tmp_path, monkeypatch):
    monkeypatch.setenv("LORAFLEET_HOME", str(home))
    out = tmp_path / "report.json"
    result = runner.invoke(app, ["bench", "quick", "--model", "micro", "--threads", "1", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(out.read_text())
    assert json.loads(result.stdout) == report
    assert report["workload"]["name"] == "quick" and report["duration_s"] > 0
    rows = {r["system"]: r for r in report["results"]}
    assert set(rows) == {"lorafleet", "transformers", "peft-groups", "peft-mixed", "merged"}
    wanted = sum(r.max_tokens for r in make_requests(WORKLOADS["quick"], SHAPES["micro"].vocab_size))
    for name, row in rows.items():
        assert row["status"] == "ok", row["reason"]
        assert row["model"] == "micro"
        if name != "merged":
            assert row["tokens_per_s"] > 0 and row["peak_rss_bytes"] > 0
            assert row["details"]["warm_up"]["requests"] == 2 and row["details"]["repeats"]
            assert row["generated_tokens"] == wanted
            assert row["latency"]["ttft_s"]["p99"] >= row["latency"]["ttft_s"]["p50"] > 0
    assert rows["lorafleet"]["details"]["pool"]["peak_adapter_pages"] > 0
    assert {r["baseline"] for r in report["ratios"]} == {"transformers", "peft-groups", "peft-mixed"}
    assert all(r["tokens_per_s_ratio"] > 0 for r in report["ratios"])
    [memory] = report["memory"]
    assert memory["merged_bytes"] > memory["base_bytes"] > 0
    [switch] = report["switch"]
    assert {r["x"] for r in switch["regressions"]} >= {"distinct_adapters"}
    assert [p["num_adapters"] for p in report["sweep"]] == [1, 4]
    assert all(p["tokens_per_s"] > 0 and p["repeats"] for p in report["sweep"])
    assert "warm_up" in report["options"] and isinstance(report["warnings"], list)
    png = report["plots"]["sweep"]
    assert png.endswith("report-sweep.png") and open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    # the switch plot compares steps of one shape, or says there are none to compare
    assert report["plots"].get("switch") or any("same shape" in n for n in report["plots"]["notes"])


@pytest.mark.heavy  # a whole benchmark run
def test_the_tables_render_a_quick_report_for_people(home, tmp_path, monkeypatch):
    """Also: --out naming a directory (here a new one, ending in /) gets the report and PNGs inside."""
    monkeypatch.setenv("LORAFLEET_HOME", str(home))
    result = runner.invoke(app, ["bench", "run", "--workload", "quick", "--model", "micro", "--threads", "1",
                                 "--systems", "lorafleet,merged", "--sweep", "2", "--out", f"{tmp_path / 'results'}/"],
                           env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.stderr
    for heading in ("workload quick", "latency", "memory", "switch regression", "throughput against"):
        assert heading in result.stdout
    assert "sweep plot:" in result.stderr and "took" in result.stderr
    [report] = (tmp_path / "results").glob("*.json")
    assert {p.name for p in report.parent.iterdir()} - {f"{report.stem}-switch.png"} == {
        report.name, f"{report.stem}-sweep.png"}


def test_out_may_name_a_file_or_a_directory_for_a_report_named_like_the_default(tmp_path):
    from lorafleet.bench.report import resolve_out_path

    def timestamped(path, parent):
        return path.parent == parent and re.fullmatch(r"\d{8}-\d{6}\.json", path.name)
    assert resolve_out_path(tmp_path / "r.json") == tmp_path / "r.json"
    assert resolve_out_path(str(tmp_path / "r")) == tmp_path / "r"  # new, no trailing /: a file, as before
    assert timestamped(resolve_out_path(tmp_path), tmp_path)
    assert timestamped(resolve_out_path(f"{tmp_path / 'new'}/"), tmp_path / "new")
    assert timestamped(resolve_out_path(None), Path("bench-results"))


def test_importing_the_cli_does_not_import_torch_or_the_engine():
    code = ("import sys, lorafleet.cli.main; "
            "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'transformers') "
            "or m.startswith(('lorafleet.engine', 'lorafleet.bench'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_version_prints_the_package_version():
    from lorafleet import __version__

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"lorafleet {__version__}"


def test_bench_run_help_names_every_shape_and_workload():
    result = runner.invoke(app, ["bench", "run", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for name in [*SHAPES, *WORKLOADS]:
        assert name in result.stdout


def test_bench_lists_one_subcommand_per_benchmark():
    result = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for name in ("run", "quick", "full", "lora-decode", "switch", "overhead"):
        assert re.search(rf"^\W*{name}\s+\w", result.stdout, flags=re.M), name


@pytest.mark.parametrize("args", [["run", "--model", "huge"], ["run", "--workload", "nope"],
                                  ["run", "--systems", "vllm"], ["run", "--sweep", "0"], ["run", "--sweep", "a,b"],
                                  ["run", "--max-baseline-requests", "0"], ["quick", "--workload", "base-only"],
                                  ["quick", "--sweep", "1"], ["full", "--workload", "quick"], ["nope"],
                                  ["lora-decode", "--model", "huge"], ["switch", "--batch", "8"],
                                  ["overhead", "--running", "0"], ["overhead", "--model", "huge"]])
def test_bad_choices_and_options_of_another_subcommand_are_usage_errors(args):
    result = runner.invoke(app, ["bench", *args])
    assert result.exit_code == 2


def test_a_lorafleet_error_prints_one_line_and_exits_with_its_code(tmp_path, monkeypatch):
    import lorafleet.bench.runner

    def refuse(*args, **kwargs):
        raise ConfigError("pool_bytes=1 holds no page")
    monkeypatch.setattr(lorafleet.bench.runner, "run_bench", refuse)
    result = runner.invoke(app, ["bench", "quick", "--out", str(tmp_path / "r.json")])
    assert result.exit_code == ConfigError.exit_code
    assert result.stderr.strip() == "error: pool_bytes=1 holds no page"
    assert "Traceback" not in result.output


@pytest.mark.heavy  # a whole benchmark run end to end
def test_lora_decode_quick_reports_the_ratios_issue_3_asks_for(home, tmp_path, monkeypatch):
    monkeypatch.setenv("LORAFLEET_HOME", str(home))
    out = tmp_path / "lora.json"
    result = runner.invoke(app, ["bench", "lora-decode", "--quick", "--batch", "8", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.stderr
    [row] = json.loads(out.read_text())["results"]
    assert row["shape"] == "micro" and row["batch"] == 8
    assert set(row["decode_step_ms"]) == {"none", "one", "distinct"}
    assert row["distinct_adapter_bytes"] > 0 and row["bandwidth_gb_s"] > 0
    assert row["lora_op_ms"] > 0 and row["lora_efficiency"] > 0
    assert row["one_vs_none_throughput"] > 0


@pytest.mark.heavy  # a whole benchmark run end to end
def test_switch_quick_regresses_latency_on_adapters_landed(home, tmp_path, monkeypatch):
    monkeypatch.setenv("LORAFLEET_HOME", str(home))
    out = tmp_path / "switch.json"
    result = runner.invoke(app, ["bench", "switch", "--quick", "--out", str(out)], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.stderr
    [row] = json.loads(out.read_text())["results"]
    assert row["shape"] == "micro" and row["decode_steps"] > 0
    assert row["adapters_landed"] >= 1  # cold adapters landed while the batch decoded
    assert sum(r["steps"] for r in row["table"]) == row["decode_steps"]
    assert "adapters landed" in result.stdout


@pytest.mark.heavy  # a whole benchmark run end to end
def test_the_daemon_system_serves_the_same_requests_through_the_socket(home, tmp_path, monkeypatch):
    monkeypatch.setenv("LORAFLEET_HOME", str(home))
    out = tmp_path / "daemon.json"
    result = runner.invoke(app, ["bench", "run", "--model", "micro", "--workload", "quick",
                                 "--systems", "lorafleet,lorafleet-daemon", "--out", str(out)])
    assert result.exit_code == 0, result.stderr
    rows = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["lorafleet-daemon"]["status"] == "ok", rows["lorafleet-daemon"]["reason"]
    wanted = sum(r.max_tokens for r in make_requests(WORKLOADS["quick"], SHAPES["micro"].vocab_size))
    assert rows["lorafleet-daemon"]["generated_tokens"] == rows["lorafleet"]["generated_tokens"] == wanted
    assert rows["lorafleet-daemon"]["details"]["warm_up"]["adapter_loaded"]


@pytest.mark.heavy  # a whole benchmark run end to end
def test_llama_cpp_runs_a_peer_workload_at_each_count_in_flight_and_tabulates_it(home, tmp_path, monkeypatch):
    """The verb through the daemon alone (llama-server's runs: tests/bench/test_llamacpp.py): the
    closed loop served at each count, one report each, the comparison's table printed."""
    monkeypatch.setenv("LORAFLEET_HOME", str(home))
    out = tmp_path / "peer.json"
    result = runner.invoke(app, ["bench", "llama-cpp", "--model", "micro", "-w", "peer-base", "--in-flight", "2",
                                 "--in-flight", "8", "--systems", "lorafleet-daemon", "--threads", "1",
                                 "--out", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    suite = json.loads(out.read_text())
    assert [r["workload"]["name"] for r in suite["reports"]] == ["peer-base-2-in-flight", "peer-base-8-in-flight"]
    assert [r["workload"]["concurrency"] for r in suite["reports"]] == [2, 8]
    for report in suite["reports"]:
        [row] = report["results"]
        assert row["status"] == "ok", row["reason"]
        assert row["generated_tokens"] == 64 * 64 and row["details"]["device"] == "cpu"
    assert "against llama.cpp" in result.stdout and "peer-base" in result.stdout


def test_overhead_reports_the_host_share_of_decode_steps_and_the_cost_of_a_burst(home, tmp_path, monkeypatch):
    monkeypatch.setenv("LORAFLEET_HOME", str(home))
    out = tmp_path / "overhead.json"
    result = runner.invoke(app, ["bench", "overhead", "--model", "micro", "--running", "8", "--adapters", "2",
                                 "--steps", "4", "--burst", "50", "--threads", "1", "--out", str(out)],
                           env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.stderr
    [row] = json.loads(out.read_text())["results"]
    decode, burst = row["decode"], row["burst"]
    assert 0 < decode["host_share"] < 1 and 0 < decode["p50_host_ms"] <= decode["p50_time_ms"]
    assert burst["requests"] == 50 and burst["add_s"] > 0 and burst["first_step_seqs"] > 0
    assert decode["target_met"] is None and burst["target_met"] is None  # targets are for tiny, 64 x 8, 1000
    assert "host share" in result.stdout and "adding 50 requests" in result.stdout


def test_full_runs_every_workload_and_system_with_baselines_capped_at_64(tmp_path, monkeypatch):
    import lorafleet.bench.runner

    seen = {}

    def suite(shapes, out, **kwargs):
        seen.update(kwargs, shapes=shapes)
        return {"suite": "full", "reports": [], "across": [], "duration_s": 1.0}
    monkeypatch.setattr(lorafleet.bench.runner, "run_suite", suite)
    result = runner.invoke(app, ["bench", "full", "--out", str(tmp_path / "r.json"), "--json"])
    assert result.exit_code == 0, result.stderr
    assert seen["shapes"] == ["tiny"] and seen["max_baseline_requests"] == 64 and "workloads" not in seen
    assert set(seen["systems"]) == {"lorafleet", "lorafleet-daemon", "transformers", "peft-groups", "peft-mixed",
                                    "merged"}
