"""Issue 64: frictions a new user hit, each with the test that fails without its change."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

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


def test_vllm_launch_flags_are_taken_and_port_alone_binds_loopback():
    """(10) vLLM's scripts start lorafleet: its LoRA flags ignored with one line saying why; --port
    alone listens on 127.0.0.1; a key stays required on TCP, the error says how to make one."""
    from lorafleet.cli import serve as serve_cli
    from lorafleet.errors import ConfigError

    command = typer_command("serve")
    params = command.make_context("serve", ["--port", "8000", "--api-key", "k", "--enable-lora", "--max-loras", "4",
                                            "--max-lora-rank", "64", "--gpu-memory-utilization", "0.9"]).params
    config, _, _ = serve_cli.checked_settings({**params, "served_model_name": None}, Path("/tmp/x.sock"))
    assert (config.host, config.port) == ("127.0.0.1", 8000)
    warning = serve_cli.vllm_flags_warning(params)
    assert all(f in warning for f in ("--enable-lora", "--max-loras", "--max-lora-rank", "--gpu-memory-utilization"))
    params = command.make_context("serve", ["--port", "8000"]).params
    with pytest.raises(ConfigError, match="needs an API key.*secrets.token_urlsafe"):
        serve_cli.checked_settings({**params, "api_key": None, "served_model_name": None}, Path("/tmp/x.sock"))


def typer_command(name: str):
    import typer

    return typer.main.get_command(app).commands[name]


@pytest.mark.parametrize("verb, words", [("list", "models ls"), ("show", "adapters show"), ("rm", "adapters rm")])
def test_ollamas_verbs_say_which_verb_does_it(verb, words):
    """(11)"""
    out = runner.invoke(app, [verb, "something", "--flag"])
    assert out.exit_code == 2 and words in out.stderr and "Ollama" in out.stderr


def test_run_is_chat_with_an_adapter(served):
    """(11) `run NAME PROMPT`, as `ollama run`."""
    out = cli(served, "run", "attn-r3", "hello")
    assert out.exit_code == 0, out.output
    assert out.stdout.strip()


class FakeClient:
    """What `chat` calls on a client, recorded; `answer` raises `raising` where given."""

    where = "fake"

    def __init__(self, raising=None):
        self.raising, self.sent = raising, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def wait_started(self, timeout, waiting):
        return None

    def models(self):
        return [{"id": "base"}, {"id": "sql"}, {"id": "tuned:v2"}]

    def chat(self, messages, model, **params):
        self.sent.append((messages, model))
        if self.raising:
            raise self.raising
        return {"choices": [{"message": {"role": "assistant", "content": "ok"}}]}


def test_chat_stopped_by_ctrl_c_exits_130_and_empty_stdin_sends_nothing(monkeypatch):
    """(19)"""
    from lorafleet.cli import chat as chat_verb

    fake = FakeClient(raising=KeyboardInterrupt())
    monkeypatch.setattr(chat_verb, "client", lambda *a: fake)
    out = runner.invoke(app, ["chat", "--no-stream", "hi"])
    assert out.exit_code == 130, out.output
    quiet = FakeClient()
    monkeypatch.setattr(chat_verb, "client", lambda *a: quiet)
    out = runner.invoke(app, ["chat", "--no-stream"], input="")
    assert out.exit_code == 2 and "stdin held no message" in out.output and quiet.sent == []


def test_the_repl_refuses_an_unknown_adapter_at_once_and_takes_bye(monkeypatch, capsys):
    """(19, 11) `/adapter nope` is refused when typed, not at the next message; `/bye` leaves."""
    from lorafleet.cli import chat as chat_verb

    lines = iter(["/adapter nope", "/adapter sql", "hello", "/bye", "never read"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    fake = FakeClient()
    chat_verb.converse(fake, [], None, {"max_tokens": 4}, stream=False)
    err = capsys.readouterr().err
    assert "no adapter named 'nope'" in err and "(talking to sql)" in err
    assert [model for _, model in fake.sent] == ["sql"] and next(lines) == "never read"


def test_a_scale_that_is_no_number_is_a_usage_error_unless_the_name_is_served(monkeypatch):
    """(16) `-a reverse:abc` was taken for an adapter's name."""
    from lorafleet.cli import chat as chat_verb

    fake = FakeClient()
    monkeypatch.setattr(chat_verb, "client", lambda *a: fake)
    out = runner.invoke(app, ["chat", "--no-stream", "-a", "reverse:abc", "hi"])
    assert out.exit_code == 2 and "'abc' after ':' is no scale" in out.output and fake.sent == []
    out = runner.invoke(app, ["chat", "--no-stream", "-a", "tuned:v2", "hi"])  # a name with ':' it serves
    assert out.exit_code == 0 and fake.sent[-1][1] == "tuned:v2"


def test_the_not_found_hint_offers_no_pull_under_a_name_the_store_refuses():
    """(16) the 404's hint suggested `pull --name reverse:abc`, which the store refuses."""
    from types import SimpleNamespace

    from lorafleet.server.completions import pull_hint

    st = SimpleNamespace(worker=SimpleNamespace(resolver=object()))
    assert "pull" not in pull_hint(st, "reverse:abc") and "load_lora_adapter" in pull_hint(st, "reverse:abc")
    assert "lorafleet pull SOURCE --name sql" in pull_hint(st, "sql")


def test_the_demo_fleet_answers_every_turn_of_a_conversation():
    """(4) the demo models are single-turn: the second message of a REPL came back empty."""
    server = demo_in_process()
    try:
        body = {"model": "reverse", "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "dlrow olleh"},
                             {"role": "user", "content": "good day"}]}
        status, _, out = asyncio.run(server.call("POST", "/v1/chat/completions", json.dumps(body).encode()))
        assert status == 200 and json.loads(out)["choices"][0]["message"]["content"] == "yad doog"
    finally:
        server.close()


def test_logs_json_and_stop_url(tmp_path):
    """(18) `logs` had no --json; `stop --url` says why a remote stop is refused."""
    log = tmp_path / "d.log"
    log.write_text("2026-12-07 one [b]bracketed[/b]\nsecond line\nno newline at the end")
    out = runner.invoke(app, ["logs", "--log-file", str(log), "--json"])
    assert out.exit_code == 0, out.output
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [x["line"] for x in lines] == ["2026-12-07 one [b]bracketed[/b]", "second line", "no newline at the end"]
    assert all(x["log"] == str(log) for x in lines)
    out = runner.invoke(app, ["stop", "--url", "http://127.0.0.1:8000"])
    assert out.exit_code == 2 and "signals the daemon's process" in out.output


def test_an_adapter_trained_on_the_served_folder_is_not_warned_about(tmp_path):
    """(15) every locally trained adapter got "validated against the stored base" with no base stored."""
    from lorafleet.store.pull import pull
    from lorafleet.store.store import Store
    from tests.fixtures import build_adapter, build_model

    base = build_model(tmp_path / "my-base", "llama")
    adapter = build_adapter(base, tmp_path / "tuned", r=4, target_modules=["q_proj"])
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    for wanted, warned in ((str(base), False), ("someone/else", True)):
        (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": wanted}))
        warnings = []
        pull(str(adapter), name=f"t{int(warned)}", store=Store(tmp_path / "store"), served=("served", base),
             warn=warnings.append, progress=False)
        assert bool(warnings) == warned, warnings
        assert all("the base the daemon serves" in w and "stored base" not in w for w in warnings)


def test_help_shows_no_annotation_spellings_nor_issue_numbers():
    """(20) `--version <bool>`, `<list[str]>`; `bench --help` named internal issue numbers."""
    import re

    import typer

    def helps(command, path):
        yield path, runner.invoke(app, [*path, "--help"], env={"COLUMNS": "120"}).output
        for name, sub in getattr(command, "commands", {}).items():
            if not sub.hidden:
                yield from helps(sub, [*path, name])
    for path, text in helps(typer.main.get_command(app), []):
        assert "<bool>" not in text and "<list[" not in text, path
        assert not re.search(r"issue \d", text), path


def test_models_ls_lists_the_served_base_that_is_not_in_the_store(served, chat_model_dir, tmp_path):
    """(22) `models ls` beside a daemon serving a folder (the demo, say) said no base was served."""
    listed = json.loads(cli(served, "models", "ls", "--json").stdout)
    assert [(m["served"], m["in_store"]) for m in listed] == [(True, False)]
    assert listed[0]["source"] == str(Path(chat_model_dir).resolve())
    table = cli(served, "models", "ls").stdout
    assert "yes (not in the store)" in table
    alone = runner.invoke(app, ["models", "ls", "--json", "--socket", str(tmp_path / "none.sock")],
                          env={"LORAFLEET_HOME": str(tmp_path / "home")})
    assert json.loads(alone.stdout) == []  # no daemon, nothing stored


def test_the_no_daemon_hint_starts_one_on_the_socket_given(tmp_path, monkeypatch):
    """(22) `chat --socket S` with no daemon said `start one with lorafleet serve` (on the default socket)."""
    monkeypatch.delenv("LORAFLEET_SOCKET", raising=False)
    sock = tmp_path / "my socket" / "x.sock"
    out = runner.invoke(app, ["status", "--socket", str(sock)])
    assert out.exit_code == 3 and f"start one with `lorafleet serve --socket '{sock}'`" in out.stderr, out.output
    out = runner.invoke(app, ["status"], env={"LORAFLEET_SOCKET": str(sock)})  # serve reads it too
    assert out.exit_code == 3 and "start one with `lorafleet serve`" in out.stderr, out.output


def test_status_says_the_adapters_dtype_where_it_is_not_the_models():
    # `serve --lora-dtype bfloat16` under a float32 model: the pool line says what the adapter pages hold
    from rich.console import Console

    from lorafleet.cli.status import _grid

    stats = json.loads((Path(__file__).parent.parent / "tui" / "data" / "stream.json").read_text())[0]

    def pool_line(held):
        stats["engine"]["pool"]["adapter_dtype"] = held
        out = io.StringIO()
        Console(file=out, width=200).print(_grid(stats))
        return next(line for line in out.getvalue().splitlines() if line.startswith("pool"))

    assert "adapter pages (bfloat16)," in pool_line("bfloat16")
    assert "adapter pages," in pool_line("float32") and "(float32)" not in pool_line("float32")
