"""With `--json`, a failing verb prints `{"error": {"code", "message"}}` on stderr, nothing on
stdout, and exits with the code it has without `--json`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lorafleet.cli.main import app

runner = CliRunner()


def invoke(*args, socket, home):
    return runner.invoke(app, list(args), env={"LORAFLEET_SOCKET": str(socket), "LORAFLEET_HOME": str(home),
                                               "COLUMNS": "80"})


def json_error(result) -> dict:
    assert result.stdout == ""
    [line] = result.stderr.splitlines()  # one line, however long the message
    return json.loads(line)["error"]


@pytest.mark.parametrize("args", [["status"], ["adapters", "load", "x", "."], ["chat", "hi"]])
def test_no_daemon_with_json_is_a_json_error_with_the_same_exit_code(tmp_path, args):
    where = {"socket": tmp_path / "nobody.sock", "home": tmp_path / "home"}
    plain = invoke(*args, **where)
    as_json = invoke(*args, "--json", **where)
    assert plain.exit_code == as_json.exit_code == 3
    assert plain.stderr.startswith("error: no lorafleet daemon")
    error = json_error(as_json)
    assert error["code"] == "daemon_unreachable"
    assert "no lorafleet daemon is running on" in error["message"] and str(tmp_path) in error["message"]


def test_an_unknown_adapter_with_json_against_a_real_daemon(served):
    where = {"socket": served.socket, "home": served.home}
    plain = invoke("adapters", "show", "ghost-adapter", **where)
    as_json = invoke("adapters", "show", "ghost-adapter", "--json", **where)
    assert plain.exit_code == as_json.exit_code == 1
    assert plain.stderr.startswith("error:")
    error = json_error(as_json)
    assert error["code"] == "adapter_not_found" and "ghost-adapter" in error["message"]


def test_the_daemons_own_error_code_comes_through(served, tmp_path):
    as_json = invoke("adapters", "load", "nope", str(tmp_path / "missing"), "--json",
                     socket=served.socket, home=served.home)
    assert as_json.exit_code == 1
    error = json_error(as_json)
    assert error["code"] not in ("error", "") and "missing" in error["message"]


def test_json_errors_end_with_their_command_line(tmp_path):
    """A later command line in the same process prints plain errors again, even after one whose
    --json was followed by an option refused (its command's context never closed)."""
    where = {"socket": tmp_path / "nobody.sock", "home": tmp_path / "home"}
    assert invoke("status", "--json", **where).exit_code == 3
    assert invoke("chat", "--json", "--max-tokens", "0", "hi", **where).exit_code == 2
    after = invoke("status", **where)
    assert after.exit_code == 3 and after.stderr.startswith("error: no lorafleet daemon")


@pytest.mark.parametrize("args", [["adapters", "ls", "--json", "--bogus"], ["chat", "--json", "--max-tokens", "0", "hi"]])
def test_a_usage_error_with_json_is_a_json_error_with_clicks_exit_code(tmp_path, args):
    """Refused while the command line is parsed, before any verb runs (`main`, as installed)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "LORAFLEET_SOCKET": str(tmp_path / "nobody.sock"), "LORAFLEET_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-m", "lorafleet.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    [line] = done.stderr.splitlines()
    error = json.loads(line)["error"]
    assert error["code"] == "usage_error" and ("--bogus" in error["message"] or "--max-tokens" in error["message"])
    without = subprocess.run([sys.executable, "-m", "lorafleet.cli.main", *[a for a in args if a != "--json"]],
                             capture_output=True, text=True, env=env, timeout=60)
    assert without.returncode == 2 and not without.stderr.lstrip().startswith("{")
