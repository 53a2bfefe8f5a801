"""Issue 64: frictions a new user hit, each with the test that fails without its change."""

from __future__ import annotations

import asyncio
import io
import json

import pytest
from rich.table import Table
from typer.testing import CliRunner

from lorafleet.cli import common
from lorafleet.cli.main import app
from lorafleet.model.config import LLAMA_CPP_DEFAULTS, generation_defaults
from tests.cli.test_daemon_verbs import cli
from tests.fixtures import demo_in_process

runner = CliRunner()


def test_chat_json_sends_a_mix_as_adapters_and_prints_json(served):
    """(1) `chat --json` on a scaled adapter or a mix crashed (a Mix is no JSON)."""
    for args in (["-a", "attn-r3:0.5"], ["-a", "attn-r3", "-a", "all-r8:0.5"]):
        out = cli(served, "chat", "--json", *args, "-n", "2", "hello")
        assert out.exit_code == 0, out.output
        assert json.loads(out.stdout)["choices"][0]["message"]["role"] == "assistant"


def test_the_readmes_mix_answers_as_it_says():
    """(2) README's mix: reverse then kebab, `hello world` -> `dlrow-olleh` (upper and title serve alone)."""
    server = demo_in_process()
    try:
        body = {"adapters": [{"name": "reverse"}, {"name": "kebab"}], "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": "hello world"}]}
        status, _, out = asyncio.run(server.call("POST", "/v1/chat/completions", json.dumps(body).encode()))
        assert status == 200 and json.loads(out)["choices"][0]["message"]["content"] == "dlrow-olleh"
    finally:
        server.close()


def test_status_prints_the_socket_path_with_no_daemon(tmp_path):
    """(6) a README line that does not depend on $XDG_RUNTIME_DIR."""
    sock = tmp_path / "nowhere" / "x.sock"
    out = runner.invoke(app, ["status", "--socket-path", "--socket", str(sock)])
    assert out.exit_code == 0 and out.stdout.strip() == str(sock)
    out = runner.invoke(app, ["status", "--socket-path"], env={"LORAFLEET_SOCKET": str(sock)})
    assert out.exit_code == 0 and out.stdout.strip() == str(sock)


def test_a_gguf_file_samples_as_llama_cpp_does_and_serve_sets_defaults(tmp_path):
    """(7) a GGUF has no generation config: llama.cpp's defaults, not temperature 1 untruncated;
    `serve --temperature ...` over them."""
    from tests.daemons import Daemon
    from tests.fixtures import build_model
    from tests.unit.test_gguf import write_gguf

    path = write_gguf(build_model(tmp_path / "hf", "llama"), tmp_path / "m.gguf")
    assert generation_defaults(path) == LLAMA_CPP_DEFAULTS
    daemon = Daemon.start(tmp_path / "d", "--temperature", "0.3", "--top-k", "20", model=path)
    try:
        assert daemon.stats()["server"]["sampling_defaults"] == {**LLAMA_CPP_DEFAULTS, "temperature": 0.3,
                                                                  "top_k": 20}
    finally:
        daemon.kill()
    bad = runner.invoke(app, ["serve", str(path), "--top-p", "0"])
    assert bad.exit_code == 2 and "top-p" in bad.output


def test_off_a_terminal_lines_are_as_wide_as_they_hold(monkeypatch):
    """(9) `adapters ls | cat` cut every path to 80 columns."""
    monkeypatch.delenv("COLUMNS", raising=False)
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    table = Table("NAME", "PATH")
    path = "/a/very/long/" + "x" * 200 + "/adapter"
    table.add_row("sql", path)
    common.out_console().print(table)
    assert path in out.getvalue() and "…" not in out.getvalue()


@pytest.mark.parametrize("isatty", [True])
def test_on_a_terminal_the_width_is_the_terminals(monkeypatch, isatty):
    monkeypatch.delenv("COLUMNS", raising=False)

    class Tty(io.StringIO):
        def isatty(self):
            return isatty
    assert common._width(Tty()) is None
