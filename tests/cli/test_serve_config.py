"""`serve`'s defaults from `$LORAFLEET_HOME/config.toml` (flags win; one line naming the key and
the file when it is wrong; `--print-config`), vLLM's `--lora-modules` (both forms, several after
one flag), and the commands `serve --detach` names for a daemon on another socket."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from lorafleet import paths
from lorafleet.cli import detach
from lorafleet.cli import serve as serve_cli
from lorafleet.cli.main import app
from tests.daemons import POOL

runner = CliRunner()
SERVE = typer.main.get_command(app).commands["serve"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("LORAFLEET_HOME", str(home))
    monkeypatch.setenv("LORAFLEET_SOCKET", str(tmp_path / "run" / "default.sock"))
    for var in ("LORAFLEET_API_KEY", "LORAFLEET_URL"):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture
def started(monkeypatch):
    """Runs `serve` up to the daemon's start, and records what it would start it with."""
    calls = []
    monkeypatch.setattr(serve_cli, "_run", lambda model, config, engine_options, adapters, resolve:
                        calls.append({"config": config, "engine": engine_options, "adapters": adapters}))
    monkeypatch.setattr(serve_cli, "_setup_logging", lambda: None)
    monkeypatch.setattr("lorafleet.openmp.set_defaults", lambda: None)
    return calls


def serve(*args):
    return runner.invoke(app, ["serve", *args], catch_exceptions=False)


def write_config(home: Path, text: str) -> Path:
    path = home / "config.toml"
    path.write_text(text)
    return path


def test_a_value_from_the_file_is_used_and_a_flag_wins(home, started):
    write_config(home, '[serve]\npool-bytes = "3GiB"\nmax_num_seqs = 9\nprefix-cache = false\n'
                       'drain-timeout = 5\nadapter = ["sql=/a/sql"]\n')
    assert serve().exit_code == 0
    engine, config = started[-1]["engine"], started[-1]["config"]
    assert engine["pool_bytes"] == 3 << 30 and engine["max_num_seqs"] == 9 and engine["prefix_cache"] is False
    assert config.drain_timeout == 5.0 and started[-1]["adapters"] == {"sql": Path("/a/sql")}

    assert serve("--pool-bytes", "1GiB", "--prefix-cache", "-a", "chat=/a/chat").exit_code == 0
    engine = started[-1]["engine"]
    assert engine["pool_bytes"] == 1 << 30 and engine["prefix_cache"] is True  # the flags win
    assert engine["max_num_seqs"] == 9  # the rest still from the file
    assert started[-1]["adapters"] == {"chat": Path("/a/chat")}  # a list on the command line replaces the file's


@pytest.mark.parametrize("text,named", [
    ('[serve]\npool-byte = "1GiB"\n', "'pool-byte'"),
    ('[serve]\nmax-num-seqs = "many"\n', "max-num-seqs"),
    ('[serve]\nmax-num-seqs = 0\n', "max-num-seqs"),
    ('[serve]\nprefix-cache = "no"\n', "prefix-cache"),
    ('[serve]\ndetach = true\n', "'detach'"),
    ('[serv]\nport = 1\n', "'serv'"),
    ('[serve]\npool-bytes = \n', "not valid TOML"),
])
def test_a_wrong_file_is_one_line_naming_the_key_and_the_file(home, started, text, named):
    path = write_config(home, text)
    out = serve()
    assert out.exit_code == 2 and not started
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), out.stderr
    assert str(path) in lines[0] and named in lines[0]


def test_an_option_s_environment_variable_sits_between_the_flag_and_the_file(home, tmp_path, monkeypatch):
    write_config(home, f'[serve]\nsocket = "{tmp_path / "from-file.sock"}"\n')
    monkeypatch.delenv("LORAFLEET_SOCKET")
    assert SERVE.make_context("serve", []).params["socket"] == tmp_path / "from-file.sock"
    monkeypatch.setenv("LORAFLEET_SOCKET", str(tmp_path / "from-env.sock"))
    assert SERVE.make_context("serve", []).params["socket"] == tmp_path / "from-env.sock"
    flag = SERVE.make_context("serve", ["--socket", str(tmp_path / "flag.sock")]).params["socket"]
    assert flag == tmp_path / "flag.sock"


def test_print_config_shows_each_setting_and_where_it_came_from(home, started):
    path = write_config(home, '[serve]\npool-bytes = "3GiB"\nmax-num-seqs = 9\napi-key = "secret"\n')
    out = serve("--max-num-seqs", "4", "--print-config")
    assert out.exit_code == 0 and not started  # printed, not started
    assert "secret" not in out.stdout
    lines = {line.split(" ", 1)[0]: line for line in out.stdout.splitlines() if not line.startswith("#")}
    assert lines["pool-bytes"].endswith(f"# {path}")
    assert lines["max-num-seqs"].endswith("# command line")
    assert lines["max-pending"].endswith("# default")
    settings = tomllib.loads(out.stdout)["serve"]  # it is TOML: the table a config file would hold
    assert settings["pool-bytes"] == "3GiB" and settings["max-num-seqs"] == 4 and "api-key" not in settings
    assert settings["socket"] == os.environ["LORAFLEET_SOCKET"]
    assert settings["log-file"] == str(home / "logs" / "daemon.log")


def test_print_config_refuses_what_serve_refuses_and_names_the_defaults_serve_resolves(home, started):
    """Issue 64 (14): `pool-bytes = "lots"` was printed; an unset value now says what serve uses."""
    write_config(home, '[serve]\npool-bytes = "lots"\n')
    out = serve("--print-config")
    assert out.exit_code != 0 and "lots" in out.output and not started
    write_config(home, "[serve]\n")
    out = serve("--print-config")
    assert out.exit_code == 0
    assert "# pool-bytes: not set  (default: 1 GiB on CPU, most free memory on a GPU)" in out.stdout


def test_lora_modules_in_both_of_vllms_forms_parse_to_the_same_adapters(tmp_path):
    ours = ["--adapter", "sql=/a/sql", "-a", "chat=/a/chat", str(tmp_path)]
    vllm = ["--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "llama"}',
            str(tmp_path)]
    repeated = ["--lora-modules", '{"name": "sql", "path": "/a/sql"}', "--lora-modules", "chat=/a/chat",
                str(tmp_path)]
    parsed = [SERVE.make_context("serve", argv).params for argv in (ours, vllm, repeated)]
    adapters = [serve_cli.parse_adapters(p["adapter"]) for p in parsed]
    assert adapters[0] == adapters[1] == adapters[2] == {"sql": Path("/a/sql"), "chat": Path("/a/chat")}
    assert all(p["model"] == tmp_path for p in parsed)  # MODEL, after the adapters, is still MODEL


@pytest.mark.parametrize("spec", ['{"name": "x"}', '{"name": "x", "path": "/p", "rank": 8}', "{not json",
                                  '["x", "/p"]', "no-equals-sign"])
def test_a_malformed_adapter_spec_is_refused_naming_it(spec):
    with pytest.raises(typer.BadParameter) as e:
        serve_cli.parse_adapters([spec])
    assert spec in str(e.value)


def test_the_same_adapter_name_twice_is_refused():
    with pytest.raises(typer.BadParameter, match="'sql' given twice"):
        serve_cli.parse_adapters(["sql=/a", '{"name": "sql", "path": "/b"}'])


def test_the_started_line_names_the_commands_for_that_socket(home, tmp_path):
    default = paths.socket_path()
    line = detach.started_message(42, default, tmp_path / "d.log")
    assert "stop it with `lorafleet stop`" in line and "`lorafleet logs -f`" in line
    other = tmp_path / "other dir" / "x.sock"
    line = detach.started_message(42, other, tmp_path / "d.log")
    assert f"stop it with `lorafleet stop --socket {shlex.quote(str(other))}`" in line
    assert f"`lorafleet logs --socket {shlex.quote(str(other))} -f`" in line
    hint = paths.command_for(other, "chat", "--adapter", "reverse", "hello world")
    assert shlex.split(hint) == ["lorafleet", "chat", "--socket", str(other), "--adapter", "reverse", "hello world"]


def test_detach_on_another_socket_names_the_stop_that_stops_it(chat_model_dir, tmp_path):
    """Two sockets: the default one (LORAFLEET_SOCKET) and the daemon's. The command `serve --detach`
    prints stops that daemon; its log is its own file, which `logs --socket` prints."""
    sock, home = tmp_path / "run" / "mine.sock", tmp_path / "home"
    env = {**os.environ, "LORAFLEET_HOME": str(home), "LORAFLEET_SOCKET": str(tmp_path / "run" / "default.sock"),
           "COLUMNS": "200"}
    lf = [sys.executable, "-m", "lorafleet.cli.main"]
    stop = f"lorafleet stop --socket {sock}"  # what it should print, and the way out if it does not
    started = subprocess.run([*lf, "serve", str(chat_model_dir), "--socket", str(sock), "--detach", "--device", "cpu",
                              "--pool-bytes", POOL], env=env, capture_output=True, text=True, timeout=180)
    try:
        assert started.returncode == 0, started.stderr
        printed_stop = re.search(r"stop it with `([^`]+)`", started.stderr)
        assert printed_stop and printed_stop.group(1) == stop, started.stderr
        logs = list((home / "logs").iterdir())
        assert [p.name.startswith("daemon-mine-") for p in logs] == [True], logs  # not daemon.log: its own
        log = logs[0]
        assert paths.log_link(sock).resolve() == log.resolve()
        printed = subprocess.run([*lf, "logs", "--socket", str(sock)], env=env, capture_output=True, timeout=60)
        assert printed.returncode == 0 and printed.stdout and log.read_bytes().startswith(printed.stdout)
        status = subprocess.run([*lf, "status", "--json", "--socket", str(sock)], env=env, capture_output=True,
                                text=True, timeout=60)
        pid = json.loads(status.stdout)["server"]["pid"]
    finally:
        stopped = subprocess.run([*lf, *shlex.split(stop)[1:]], env=env, capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert f"pid {pid}" in stopped.stderr and not sock.exists()


@pytest.mark.parametrize("columns", [80, 100])
def test_serve_help_on_a_narrow_terminal_names_every_option_whole(columns):
    """Under 120 columns `serve --help` is click's plain layout: every long option name whole, no
    line past the width (rich's columns there cut names and left the help a few characters)."""
    out = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": str(columns)}, terminal_width=columns)
    assert out.exit_code == 0, out.output
    names = [o for p in SERVE.params if not p.hidden for o in p.opts + p.secondary_opts if o.startswith("--")]
    assert len(names) > 20 and all(name in out.output for name in names), [n for n in names if n not in out.output]
    assert "…" not in out.output and max(map(len, out.output.splitlines())) <= columns
