"""The client verbs against a real daemon: status, chat, adapters, serve --detach and stop; exit
codes 0/1/2/3 and the one friendly line when no daemon runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
import typing
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from lorafleet.cli import detach
from lorafleet.cli import serve as serve_cli
from lorafleet.cli.main import app
from tests.daemons import POOL

runner = CliRunner()


def cli(served, *args, input=None, socket=None):
    env = {"LORAFLEET_SOCKET": str(socket or served.socket), "LORAFLEET_HOME": str(served.home), "COLUMNS": "200"}
    return runner.invoke(app, list(args), env=env, input=input, catch_exceptions=False)


def test_status_shows_what_the_daemon_serves(served):
    out = cli(served, "status")
    assert out.exit_code == 0, out.output
    assert f"pid {served.proc.pid}" in out.stdout and "base" in out.stdout and "pool" in out.stdout
    assert "cached" in out.stdout and "prefix cache" in out.stdout
    stats = json.loads(cli(served, "status", "--json").stdout)
    assert stats["server"]["pid"] == served.proc.pid and stats["engine"]["pool"]["total_pages"] > 0


@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["stop"], ["chat", "hi"],
                                  ["adapters", "load", "x", "."]])
def test_no_daemon_is_one_friendly_line_and_exit_3(served, tmp_path, args):
    out = cli(served, *args, socket=tmp_path / "nobody.sock")
    assert out.exit_code == 3
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no lorafleet daemon" in lines[0] and "lorafleet serve" in lines[0]
    assert "Traceback" not in out.output


def test_adapters_load_ls_show_unload(served, adapter_dirs):
    loaded = cli(served, "adapters", "load", "cli-made", str(adapter_dirs["mlp-r24"]), "--json")
    assert loaded.exit_code == 0, loaded.output
    assert json.loads(loaded.stdout)["ranks"] == {"gate_proj": 24, "up_proj": 24, "down_proj": 24}
    listed = json.loads(cli(served, "adapters", "ls", "--json").stdout)
    assert "cli-made" in [a["name"] for a in listed]
    table = cli(served, "adapters", "ls")
    assert "cli-made" in table.stdout and "RANK" in table.stdout
    shown = json.loads(cli(served, "adapters", "show", "cli-made", "--json").stdout)
    assert shown["path"] == str(adapter_dirs["mlp-r24"])
    assert "digest" in cli(served, "adapters", "show", "cli-made").stdout
    assert cli(served, "adapters", "unload", "cli-made").exit_code == 0
    assert "cli-made" not in [a["name"] for a in json.loads(cli(served, "adapters", "ls", "--json").stdout)]


def test_adapter_refusals_exit_1_with_the_daemons_message(served, tmp_path):
    out = cli(served, "adapters", "load", "nope", str(tmp_path / "missing"))
    assert out.exit_code == 1 and "missing" in out.stderr and out.stderr.startswith("error:")
    out = cli(served, "adapters", "unload", "never-loaded")
    assert out.exit_code == 1 and "never-loaded" in out.stderr


def test_chat_one_shot_prints_the_answer(served):
    from lorafleet.client import Client

    with Client(served.socket) as c:
        want = c.chat([{"role": "system", "content": "short"}, {"role": "user", "content": "hello"}], "all-r8",
                      max_tokens=8, temperature=0)["choices"][0]["message"]["content"]
    out = cli(served, "chat", "--adapter", "all-r8", "--system", "short", "--max-tokens", "8",
              "--temperature", "0", "hello")
    assert out.exit_code == 0, out.output
    assert out.stdout == want + "\n"


def test_chat_reads_a_piped_prompt_and_prints_json(served):
    out = cli(served, "chat", "-a", "attn-r3", "-n", "3", "--seed", "5", "--json", input="hello from a pipe")
    assert out.exit_code == 0, out.output
    answer = json.loads(out.stdout)
    assert answer["object"] == "chat.completion" and answer["model"] == "attn-r3"
    assert answer["usage"]["completion_tokens"] <= 3


def test_chat_with_an_unknown_adapter_exits_1(served):
    out = cli(served, "chat", "-a", "ghost", "hello")
    assert out.exit_code == 1 and "ghost" in out.stderr


@pytest.mark.parametrize("args", [["adapters", "load"], ["chat", "--max-tokens", "0", "x"], ["status", "--nope"],
                                  ["serve", "--port", "x"]])
def test_usage_errors_exit_2(served, args):
    assert cli(served, *args).exit_code == 2


def test_shell_completion_completes_verbs():
    env = {**os.environ, "_LORAFLEET_COMPLETE": "complete_bash", "COMP_WORDS": "lorafleet adapters ", "COMP_CWORD": "2"}
    out = subprocess.run([sys.executable, "-m", "lorafleet.cli.main"], env=env, capture_output=True, text=True, timeout=60)
    assert set(out.stdout.split()) == {"ls", "show", "load", "unload", "rm"}


def test_serve_detach_then_stop(chat_model_dir, tmp_path):
    """Started from a folder holding a `lorafleet/` of its own (a clone's parent): the detached
    daemon imports the installed package, not that folder; the terminal is told what it does meanwhile."""
    sock, home = tmp_path / "run" / "d.sock", tmp_path / "home"
    env = {**os.environ, "LORAFLEET_HOME": str(home), "LORAFLEET_SOCKET": str(sock), "COLUMNS": "200"}
    lf = [sys.executable, "-P", "-m", "lorafleet.cli.main"]  # as the `lorafleet` script runs: the cwd not searched
    shadow = tmp_path / "clones"
    (shadow / "lorafleet").mkdir(parents=True)
    (shadow / "lorafleet" / "__init__.py").write_text("raise ImportError('the shadow package was imported')\n")
    started = subprocess.run([*lf, "serve", str(chat_model_dir), "--detach", "--device", "cpu", "--pool-bytes", POOL,
                              "--max-pending", "7"], env=env, capture_output=True, text=True, timeout=120, cwd=shadow)
    assert started.returncode == 0, started.stderr
    assert "started" in started.stderr and (home / "logs" / "daemon.log").is_file()
    assert "starting the lorafleet daemon" in started.stderr and "  " in started.stderr and "loading" in started.stderr
    try:
        status = subprocess.run([*lf, "status", "--json"], env=env, capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        server = json.loads(status.stdout)["server"]
        assert server["socket"] == str(sock) and server["max_pending"] == 7  # the options reached the daemon
        again = subprocess.run([*lf, "serve", "--detach"], env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 1 and "already serves" in again.stderr
    finally:
        stopped = subprocess.run([*lf, "stop"], env=env, capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped" in stopped.stderr and not sock.exists()


SERVE = typer.main.get_command(app).commands["serve"]


def sample_tokens(param, hint) -> list[str]:
    """Tokens that set `param` to a value other than its default (strings start with '-', paths are
    absolute, lists get two items), by its Python type."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    many = typing.get_origin(hint) is list
    kind = typing.get_args(hint)[0] if many else hint
    samples = {bool: None, int: "7", float: "0.5", str: f"-{param.name}=x", Path: f"/somewhere/{param.name}"}
    if kind not in samples:
        pytest.fail(f"serve's {param.name}: no sample value for {hint} here; add one")
    if kind is bool:  # the switch that sets it away from its default
        return [param.secondary_opts[0] if param.default else param.opts[0]]
    values = [samples[kind], samples[kind] + "2"] if many else [samples[kind]]
    if param.param_type_name == "argument":
        return values
    return [f"{max(param.opts, key=len)}={v}" for v in values]


def test_every_serve_option_reaches_the_detached_daemon(monkeypatch):
    """--detach re-runs `serve` with an argv rebuilt from the parsed parameters: every option, set to
    a value other than its default, parses back the same from that argv, except the ones kept out
    of it (the API key travels in the environment, where `ps` does not show it)."""
    hints = typing.get_type_hints(serve_cli.serve)
    options, arguments = [], []
    for param in SERVE.params:
        for var in [param.envvar] if isinstance(param.envvar, str) else param.envvar or []:
            monkeypatch.delenv(var, raising=False)
        (arguments if param.param_type_name == "argument" else options).extend(sample_tokens(param, hints[param.name]))
    given = SERVE.make_context("serve", [*options, *arguments]).params
    assert [p.name for p in SERVE.params if given[p.name] in (p.default, None, ())] == []  # all set

    argv = detach.rebuild_argv(SERVE, given)
    assert argv[0] == "serve" and given["api_key"] not in " ".join(argv)
    back = SERVE.make_context("serve", argv[1:]).params
    left_out = {p.name: p.default for p in SERVE.params if p.name in detach._NOT_FORWARDED}
    assert back == {**given, **left_out}
    assert left_out.keys() == {"detach", "log_file", "api_key"}


def test_chat_on_a_terminal_is_a_repl_that_keeps_the_conversation(served, tmp_path):
    """Driven through a pseudo-terminal: two turns, then /exit; the lines typed are kept."""
    import pty
    import select

    from lorafleet.client import Client

    with Client(served.socket) as c:
        first = c.chat([{"role": "user", "content": "hello"}], "attn-r3", max_tokens=4,
                       temperature=0)["choices"][0]["message"]["content"]
        second = c.chat([{"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
                         {"role": "user", "content": "again"}], "attn-r3", max_tokens=4,
                        temperature=0)["choices"][0]["message"]["content"]
    home = tmp_path / "home"
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "lorafleet.cli.main", "chat", "-a", "attn-r3", "-n", "4", "-t", "0"],
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True,
                            env={**os.environ, "LORAFLEET_SOCKET": str(served.socket), "TERM": "dumb",
                                 "LORAFLEET_HOME": str(home)})
    os.close(slave)
    seen = b""

    def read_until_prompt(count: int, timeout: float = 60.0) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while seen.count(b">>> ") < count:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([master], [], [], max(left, 0))
            assert ready and left > 0, f"no prompt #{count} within {timeout:.0f}s; got {seen!r}"
            seen += os.read(master, 4096)
    try:
        read_until_prompt(1)
        os.write(master, b"hello\n")
        read_until_prompt(2)
        os.write(master, b"again\n")
        read_until_prompt(3)
        os.write(master, b"/exit\n")
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        os.close(master)
    text = seen.decode(errors="replace").replace("\r", "")
    assert "chatting with attn-r3" in text
    assert f"{first}\n>>> " in text and f"{second}\n>>> " in text
    assert (home / "chat_history").read_text().splitlines()[-3:] == ["hello", "again", "/exit"]


def test_chat_holds_its_answer_to_a_schema_a_regex_or_a_choice(served, tmp_path):
    schema = tmp_path / "trip.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"days": {"type": "integer", "minimum": 1,
                                                                            "maximum": 9}},
                                  "required": ["days"], "additionalProperties": False}))
    out = cli(served, "chat", "-a", "all-r8", "-t", "0", "-n", "40", "--json-schema", str(schema), "plan a trip")
    assert out.exit_code == 0, out.output
    assert 1 <= json.loads(out.stdout)["days"] <= 9
    out = cli(served, "chat", "--regex", "[a-z]{3}-[0-9]", "-t", "0.7", "--seed", "2", "hello")
    assert out.exit_code == 0 and __import__("re").fullmatch(r"[a-z]{3}-[0-9]\n", out.stdout), out.output
    out = cli(served, "chat", "-a", "attn-r3", "--choice", "yes,no", "hello")
    assert out.exit_code == 0 and out.stdout in ("yes\n", "no\n"), out.output
    both = cli(served, "chat", "--regex", "a", "--choice", "a,b", "hello")
    assert both.exit_code == 2 and "--choice" in both.output
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert cli(served, "chat", "--json-schema", str(bad), "hi").exit_code == 2
    refused = cli(served, "chat", "--regex", "(?=a)b", "hi")
    assert refused.exit_code == 1 and "look-around" in refused.stderr
