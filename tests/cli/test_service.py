"""`lorafleet service install|uninstall|status`: the systemd user unit it writes (checked by
`systemd-analyze verify` where that exists) and the systemctl calls it makes, through a fake
`systemctl` on PATH that records its arguments."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from lorafleet.cli import service as service_cli
from lorafleet.cli.main import app

runner = CliRunner()
UNIT = "lorafleet.service"


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A config home, a LORAFLEET_HOME, and a fake systemctl first on PATH (it prints "fake")."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "systemctl").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "systemctl.argv"}\necho fake\n')
    (fake / "systemctl").chmod(0o755)
    values = {"XDG_CONFIG_HOME": str(tmp_path / "config"), "LORAFLEET_HOME": str(tmp_path / "home"),
              "LORAFLEET_SOCKET": str(tmp_path / "run" / "lf.sock"), "LORAFLEET_API_KEY": "not-in-the-unit",
              "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    return tmp_path


def lf(*args):
    return runner.invoke(app, list(args), catch_exceptions=False)


def calls(tmp_path) -> list[str]:
    path = tmp_path / "systemctl.argv"
    return path.read_text().splitlines() if path.exists() else []


def unit_lines(tmp_path) -> list[str]:
    return (tmp_path / "config" / "systemd" / "user" / UNIT).read_text().splitlines()


def value(lines: list[str], key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in lines if line.startswith(key + "=")]


def test_install_writes_the_unit_and_enables_it(env):
    out = lf("service", "install", "--", "/models/llama", "--pool-bytes", "4GiB", "--max-num-seqs", "8")
    assert out.exit_code == 0, out.output
    lines = unit_lines(env)
    # -P: the unit's WorkingDirectory (a clone's parent, say) never shadows the installed package
    assert shlex.split(value(lines, "ExecStart")[0]) == [sys.executable, "-P", "-m", "lorafleet.cli.main", "serve",
                                                         "/models/llama", "--pool-bytes", "4GiB", "--max-num-seqs", "8"]
    assert value(lines, "Restart") == ["on-failure"] and value(lines, "WantedBy") == ["default.target"]
    environment = value(lines, "Environment")
    assert f"LORAFLEET_HOME={env / 'home'}" in environment and f"LORAFLEET_SOCKET={env / 'run' / 'lf.sock'}" in environment
    assert not any("LORAFLEET_API_KEY" in e or "not-in-the-unit" in e for e in environment)  # a secret stays out
    # the daemon logs where `lorafleet logs` looks for the daemon on that socket
    assert value(lines, "StandardOutput") == [f"append:{env / 'home' / 'logs' / 'daemon.log'}"]
    assert value(lines, "TimeoutStopSec") == ["60"]  # the default 30 s drain and 30 to exit
    assert calls(env) == ["--user daemon-reload", f"--user enable --now {UNIT}"]

    again = lf("service", "install", "--", "/models/llama", "--pool-bytes", "8GiB")
    assert again.exit_code == 0 and "replaced" in again.stderr
    assert calls(env)[2:] == ["--user daemon-reload", f"--user enable --now {UNIT}", f"--user restart {UNIT}"]


def test_install_takes_serve_options_without_the_double_dash(env):
    assert lf("service", "install", "--no-start", "/models/llama", "-a", "sql=/a/sql", "--no-prefix-cache").exit_code == 0
    exec_start = shlex.split(value(unit_lines(env), "ExecStart")[0])
    assert exec_start[5:] == ["/models/llama", "-a", "sql=/a/sql", "--no-prefix-cache"]


def test_uninstall_disables_stops_and_removes_it(env):
    assert lf("service", "install", "/models/llama").exit_code == 0
    unit = env / "config" / "systemd" / "user" / UNIT
    out = lf("service", "uninstall")
    assert out.exit_code == 0, out.output
    assert calls(env)[2:] == [f"--user disable --now {UNIT}", "--user daemon-reload"]
    assert not unit.exists()
    again = lf("service", "uninstall")
    assert again.exit_code == 1 and str(unit) in again.stderr and len(again.stderr.strip().splitlines()) == 1


def test_uninstall_without_a_user_bus_still_removes_the_unit(env):
    """A root shell or a container has systemctl but no user systemd: nothing ran under the unit,
    so it goes, saying so; any other systemctl failure still stops the uninstall."""
    assert lf("service", "install", "--no-start", "/models/llama").exit_code == 0
    unit = env / "config" / "systemd" / "user" / UNIT
    fake = env / "bin" / "systemctl"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {env / "systemctl.argv"}\n'
                    'echo "Failed to connect to bus: No medium found" >&2\nexit 1\n')
    out = lf("service", "uninstall")
    assert out.exit_code == 0, out.output
    assert not unit.exists() and "no user systemd" in out.stderr
    assert calls(env) == [f"--user disable --now {UNIT}"]  # no daemon-reload on no bus
    assert lf("service", "install", "--no-start", "/models/llama").exit_code == 0
    fake.write_text('#!/bin/sh\necho "Access denied" >&2\nexit 1\n')
    out = lf("service", "uninstall")
    assert out.exit_code == 1 and "Access denied" in out.stderr and unit.exists()


def test_no_start_or_no_systemctl_prints_the_commands_instead(env, monkeypatch):
    out = lf("service", "install", "--no-start", "/models/llama")
    assert out.exit_code == 0 and calls(env) == []
    assert f"systemctl --user daemon-reload; systemctl --user enable --now {UNIT}" in out.stderr
    monkeypatch.setenv("PATH", str(env / "nothing"))
    out = lf("service", "install", "/models/llama")
    assert out.exit_code == 0 and calls(env) == [] and "no systemctl" in out.stderr


def test_status_shows_the_unit_and_systemds_view(env):
    assert lf("service", "status").exit_code == 1
    assert lf("service", "install", "/models/llama").exit_code == 0
    info = json.loads(lf("service", "status", "--json").stdout)
    assert info["unit"].endswith(f"systemd/user/{UNIT}") and "serve /models/llama" in info["exec_start"]
    assert info["enabled"] == info["active"] == "fake"


@pytest.mark.parametrize("args,named", [(["--detach"], "--detach"), (["--api-key", "k"], "api-key"),
                                        (["--max-num-seqs", "x"], "--max-num-seqs"), (["--nope"], "--nope")])
def test_serve_arguments_serve_would_refuse_are_a_usage_error(env, args, named):
    out = lf("service", "install", "--", "/models/llama", *args)
    assert out.exit_code == 2 and named in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (env / "config" / "systemd" / "user" / UNIT).exists() and calls(env) == []


def test_the_unit_goes_under_the_home_config_without_xdg_config_home(env, monkeypatch):
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(env / "user"))
    assert lf("service", "install", "--no-start", "/models/llama").exit_code == 0
    assert (env / "user" / ".config" / "systemd" / "user" / UNIT).is_file()


def test_arguments_are_quoted_for_systemd():
    assert service_cli.quote("/models/llama") == "/models/llama"
    assert service_cli.quote("a b") == '"a b"'
    assert service_cli.quote('50% "x" $HOME \\') == '"50%% \\"x\\" $$HOME \\\\"'


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_systemd_analyze_verifies_the_unit(env):
    model = env / "a model dir"  # spaces, %, $ and quotes in the arguments, escaped for systemd
    out = lf("service", "install", "--no-start", "--", str(model), "--served-model-name", '50% "$off"',
             "-a", "sql=/a/sql")
    assert out.exit_code == 0, out.output
    unit = env / "config" / "systemd" / "user" / UNIT
    # --man=no: the pages may not be installed where this runs (Documentation= points at them)
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr


@pytest.mark.parametrize("args,named", [
    (["--pool-bytes", "-3"], "--pool-bytes"), (["--pool-bytes", "0"], "pool_bytes"),
    (["--max-body-bytes", "12"], "max_body_bytes"), (["--device", "tpu"], "device"),
    (["--quantize", "int3"], "quantize"), (["--async-decode", "maybe"], "async_decode"),
    (["--dtype", "float8"], "dtype"), (["--port", "8000"], "API key"),  # --port alone: loopback, keyed
    (["-a", "no-path"], "NAME=PATH"), (["--max-num-seqs", "0"], "--max-num-seqs"),
    # the key of the shell that installs is not the service's: a TCP listener needs it in config.toml
    (["--host", "127.0.0.1", "--port", "8000"], "API key")])
def test_serve_values_serve_would_refuse_are_refused_before_the_unit_is_written(env, args, named):
    out = lf("service", "install", "--", "/models/llama", *args)
    assert out.exit_code == 2, out.output
    assert named in out.stderr and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.output
    assert not (env / "config" / "systemd" / "user" / UNIT).exists() and calls(env) == []


def test_a_bad_value_from_config_toml_is_refused_too(env):
    (env / "home").mkdir()
    (env / "home" / "config.toml").write_text('[serve]\npool-bytes = "0"\n')  # a size, but no pool
    out = lf("service", "install", "--", "/models/llama")
    assert out.exit_code == 2 and "pool_bytes must be a positive integer, got 0" in out.stderr
    assert not (env / "config" / "systemd" / "user" / UNIT).exists() and calls(env) == []


@pytest.mark.parametrize("args", [["--pool-bytes", "0"], ["--device", "tpu"], ["--dtype", "float8"]])
def test_serve_refuses_the_same_values_before_it_starts(env, monkeypatch, args):
    from lorafleet.cli import serve as serve_cli

    monkeypatch.setattr(serve_cli, "_run", lambda *a, **k: pytest.fail("serve started with a bad value"))
    out = lf("serve", *args)
    assert out.exit_code == 1 and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.output


def systemd_environment(value: str) -> str:
    """An Environment= value as systemd reads it: one word, unquoted with C escapes, specifiers
    (%%) undone, and `$` left as it is (systemd.exec(5): no variable expansion there)."""
    words = shlex.split(value)  # for the quotes and escapes `quote` writes, as systemd's
    assert len(words) == 1
    return words[0].replace("%%", "%")


def test_environment_values_round_trip_with_dollars_and_percents(env, monkeypatch):
    home = str(env / 'h $HOME $$x 50% "q" \\')
    monkeypatch.setenv("LORAFLEET_HOME", home)
    assert lf("service", "install", "--no-start", "/models/llama").exit_code == 0
    environment = [systemd_environment(v) for v in value(unit_lines(env), "Environment")]
    assert f"LORAFLEET_HOME={home}" in environment
    assert service_cli.quote("A=$x 50%", variables=False) == '"A=$x 50%%"'


def test_an_xdg_config_home_that_is_a_file_is_one_line(env, monkeypatch):
    (env / "not-a-dir").write_text("")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(env / "not-a-dir"))
    out = lf("service", "install", "/models/llama")
    assert out.exit_code == 1 and "Traceback" not in out.output, out.output
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot write the unit" in lines[0] and "XDG_CONFIG_HOME" in lines[0]
    assert calls(env) == []


def test_config_spells_the_loaders_dtypes():
    from lorafleet.config import DTYPES
    from lorafleet.model.loader import DTYPES as LOADER

    assert set(DTYPES) == {"auto", *LOADER}
