"""`lorafleet bench` without its optional dependencies: every subcommand says, in one line before
anything runs, which module is missing and `pip install 'lorafleet[bench]'`; and its tables,
written to a file or a pipe, are never cut to 80 columns."""

from __future__ import annotations

import io
import json
import sys
import types

import pytest
from rich.console import Console
from typer.testing import CliRunner

from lorafleet.bench import fixtures, suite_tables, tables
from lorafleet.cli import bench_suites
from lorafleet.cli.main import app

pytestmark = pytest.mark.unit

runner = CliRunner()
HINT = "pip install 'lorafleet[bench]' (from a clone: pip install -e '.[bench]')"  # both forms (issue 64, 13)
SUBCOMMANDS = [["run"], ["quick"], ["full"], ["llama-cpp"], ["lora-decode"], ["decode-bound"], ["switch"],
               ["overhead"], ["store-load"], ["stats-cost"], ["gpu"]]


@pytest.fixture
def nothing_runs(monkeypatch, tmp_path):
    """An empty bench cache (every model still to build), and every way a subcommand could start
    its work refused."""
    monkeypatch.setenv("LORAFLEET_HOME", str(tmp_path / "home"))

    def ran(*args, **kwargs):
        raise AssertionError("a run started before its modules were checked")
    import lorafleet.bench.runner
    from lorafleet import openmp

    monkeypatch.setattr(lorafleet.bench.runner, "run_bench", ran)
    monkeypatch.setattr(lorafleet.bench.runner, "run_suite", ran)
    monkeypatch.setattr(openmp, "set_defaults", ran)  # the first thing `suite` does after its checks


def missing(monkeypatch, *modules):
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` fails, as when not installed


def one_line_error(result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("error: ") and line.endswith(HINT)  # `[bench]` as typed, not eaten as markup
    return line


@pytest.mark.parametrize("args", SUBCOMMANDS, ids=[a[0] for a in SUBCOMMANDS])
def test_every_subcommand_without_transformers_says_so_in_one_line(nothing_runs, monkeypatch, args):
    missing(monkeypatch, "transformers")
    line = one_line_error(runner.invoke(app, ["bench", *args]))
    assert "transformers (to build the" in line


def test_the_systems_name_the_modules_they_need(nothing_runs, monkeypatch):
    missing(monkeypatch, "peft")
    line = one_line_error(runner.invoke(app, ["bench", "run", "--systems", "lorafleet,peft-mixed"]))
    assert "peft (for the peft-mixed system)" in line and "transformers" not in line
    usage = runner.invoke(app, ["bench", "run", "--systems", "lorafleet,peft-mixed", "--workload", "nope"])
    assert usage.exit_code == 2  # a bad choice is a usage error first


def test_plots_need_matplotlib_once_the_models_are_built(nothing_runs, monkeypatch):
    missing(monkeypatch, "matplotlib", "transformers")
    built = fixtures.cache_root() / fixtures.cache_key("micro")
    built.mkdir(parents=True)
    (built / "config.json").write_text("{}")
    line = one_line_error(runner.invoke(app, ["bench", "run", "--model", "micro", "--systems", "lorafleet"]))
    assert "matplotlib (for the plots)" in line and "transformers" not in line


def test_lora_decode_needs_peft_only_for_its_peft_comparison(nothing_runs, monkeypatch):
    missing(monkeypatch, "peft")
    line = one_line_error(runner.invoke(app, ["bench", "lora-decode"]))
    assert "peft (for PEFT's mixed-adapter batch, which --no-peft leaves out)" in line
    bench_suites.require(["micro"], needs=None)  # --no-peft: nothing of peft's needed (transformers is here)


def test_llama_cpp_needs_its_converters_modules_and_its_server(nothing_runs, monkeypatch):
    missing(monkeypatch, "sentencepiece")
    line = one_line_error(runner.invoke(app, ["bench", "llama-cpp", "--systems", "llama.cpp"]))
    assert "sentencepiece (for the llama.cpp system)" in line
    monkeypatch.delitem(sys.modules, "sentencepiece")
    monkeypatch.setenv("LORAFLEET_LLAMA_SERVER", "/nowhere/llama-server")
    for args in (["llama-cpp", "--systems", "llama.cpp"], ["run", "--systems", "lorafleet,llama.cpp"]):
        result = runner.invoke(app, ["bench", *args])
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert result.stderr.strip() == ("error: llama.cpp cannot run: LORAFLEET_LLAMA_SERVER=/nowhere/llama-server "
                                         "is not an executable file")


def test_with_json_the_missing_module_is_a_json_error(nothing_runs, monkeypatch):
    missing(monkeypatch, "transformers")
    result = runner.invoke(app, ["bench", "switch", "--json"])
    assert result.exit_code == 1 and result.stdout == ""
    error = json.loads(result.stderr)["error"]
    assert error["code"] == "missing_dependency" and "transformers" in error["message"]
    assert error["message"].endswith(HINT)


LONG = "a-model-shape-whose-name-goes-on-and-on-past-eighty-columns"


def store_load_result(shape: str) -> dict:
    return {"shape": LONG, "rank": 16, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"], "bytes": 123456789,
            "store_cpu_ms": 1234567.891, "folder_cpu_ms": 7654321.123, "speedup": 6.2, "target_ms": 3.0,
            "target_met": False}


def test_tables_in_a_file_or_a_pipe_are_never_cut(monkeypatch):
    table = suite_tables.store_load_table([store_load_result("micro")] * 2)
    cut = io.StringIO()
    Console(file=cut, width=80).print(table)  # what rich does to a table in a file: cells cut
    assert "…" in cut.getvalue()
    whole = io.StringIO()
    tables.console(whole).print(table)
    text = whole.getvalue()
    assert "…" not in text
    for value in (LONG, "1234567.89 ms", "7654321.12 ms", "117.7 MiB", "rank 16 on q,k,v,o"):
        assert value in text


def test_a_terminal_keeps_its_width(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setenv("COLUMNS", "100")
    assert tables.console(Terminal()).width == 100
    assert tables.console(io.StringIO()).width == tables.UNBOUNDED_WIDTH


def test_a_subcommands_table_printed_into_a_pipe_keeps_every_cell(monkeypatch, tmp_path):
    from lorafleet import openmp

    monkeypatch.setattr(openmp, "set_defaults", lambda: None)
    monkeypatch.setitem(sys.modules, "lorafleet.bench.store_load",
                        types.SimpleNamespace(run_store_load=lambda shape, **kw: store_load_result(shape)))
    result = runner.invoke(app, ["bench", "store-load", "--model", "micro", "--out", str(tmp_path / "r.json")],
                           env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout and LONG in result.stdout and "7654321.12 ms" in result.stdout
