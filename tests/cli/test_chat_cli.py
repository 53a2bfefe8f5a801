"""`lorafleet chat` as its output and input are: whole answers in one write unless onto a terminal
(or --stream), a piped prompt without its line ending, and the REPL's slash commands, which never
reach the model. A fake client records what would have been sent."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from lorafleet.cli import chat as chat_cli
from lorafleet.cli.main import app
from lorafleet.errors import AdapterNotFoundError, DaemonStartingError, DaemonUnreachableError

runner = CliRunner()


class FakeClient:
    """The client's chat methods: `answers` by adapter (None: the base); every call recorded."""

    where = "/fake.sock"

    def __init__(self, answers: dict | None = None):
        self.answers = answers or {}
        self.calls = []  # (how, adapter, messages)
        self.mixes = []  # the `adapters` field of each call (None: not sent)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def health(self):
        return {"status": "ok"}

    def models(self):  # what `/v1/models` lists: the REPL checks an /adapter name against it
        return [{"id": "base"}, *({"id": a} for a in self.answers if a)]

    starting_pid = None  # a daemon still starting: `wait_started` tells `waiting` once, then it answers

    def wait_started(self, timeout, waiting=lambda e: None, poll=0.5):
        if self.starting_pid is not None:
            waiting(DaemonStartingError(f"the daemon (pid {self.starting_pid}) is still starting", self.starting_pid))

    def _answer(self, adapter):
        if adapter not in self.answers:
            raise AdapterNotFoundError(f"no adapter {adapter!r}")
        return self.answers[adapter]

    def chat(self, messages, adapter=None, **params):
        self.calls.append(("whole", adapter, [dict(m) for m in messages]))
        self.mixes.append(params.get("adapters"))
        return {"choices": [{"message": {"content": self._answer(adapter)}}]}

    def chat_stream(self, messages, adapter=None, **params):
        self.calls.append(("stream", adapter, [dict(m) for m in messages]))
        self.mixes.append(params.get("adapters"))
        text = self._answer(adapter)
        return ({"choices": [{"delta": {"content": text[i:i + 2]}}]} for i in range(0, len(text), 2))


class Stdout:
    """A stdout that records each write and says whether it is a terminal."""

    def __init__(self, tty: bool):
        self.tty, self.writes = tty, []

    def isatty(self):
        return self.tty

    def write(self, text):
        self.writes.append(text)

    def flush(self):
        pass


@pytest.fixture
def fake(monkeypatch):
    client = FakeClient({"upper": "HELLO THERE", "kebab": "hello-there", None: "hello there"})
    monkeypatch.setattr(chat_cli, "client", lambda *args: client)
    return client


def one_shot(monkeypatch, tty: bool, stream: bool | None) -> Stdout:
    out = Stdout(tty)
    monkeypatch.setattr("sys.stdout", out)
    chat_cli.chat("hi", adapter=["upper"], system=None, max_tokens=8, temperature=0.0, seed=None, stream=stream,
                  as_json=False, socket=None, url=None, api_key=None)
    return out


def test_an_answer_into_a_pipe_is_written_whole_in_one_write(fake, monkeypatch):
    out = one_shot(monkeypatch, tty=False, stream=None)
    assert out.writes == ["HELLO THERE\n"]
    assert [how for how, _, _ in fake.calls] == ["whole"]


def test_a_daemon_still_starting_is_waited_for_and_said_so(fake, monkeypatch, capsys):
    fake.starting_pid = 4242
    out = one_shot(monkeypatch, tty=False, stream=None)
    assert out.writes == ["HELLO THERE\n"]
    assert "waiting: the daemon (pid 4242) is still starting" in capsys.readouterr().err


def test_no_stream_on_a_terminal_writes_each_answer_whole(fake, monkeypatch):
    out = one_shot(monkeypatch, tty=True, stream=False)
    assert out.writes == ["HELLO THERE\n"]
    assert [how for how, _, _ in fake.calls] == ["whole"]


def test_a_terminal_gets_the_answer_streamed(fake, monkeypatch):
    out = one_shot(monkeypatch, tty=True, stream=None)
    assert [how for how, _, _ in fake.calls] == ["stream"]
    assert len(out.writes) > 2 and "".join(out.writes) == "HELLO THERE\n"


def test_stream_streams_into_a_pipe_too(fake, monkeypatch):
    one_shot(monkeypatch, tty=False, stream=True)
    assert [how for how, _, _ in fake.calls] == ["stream"]


@pytest.mark.parametrize("flag,how", [([], "whole"), (["--no-stream"], "whole"), (["--stream"], "stream")])
def test_the_cli_prints_exactly_the_answer_and_a_newline(fake, flag, how):
    out = runner.invoke(app, ["chat", "-a", "upper", *flag, "hi"])  # CliRunner's stdout is no terminal
    assert out.exit_code == 0, out.output
    assert out.stdout == "HELLO THERE\n"
    assert [h for h, _, _ in fake.calls] == [how]


@pytest.mark.parametrize("piped,prompt", [("hi\n", "hi"), ("hi\r\n", "hi"), ("hi", "hi"), ("hi\n\n", "hi\n"),
                                          ("  two\nlines \n", "  two\nlines ")])
def test_a_piped_prompt_loses_only_its_trailing_line_ending(fake, piped, prompt):
    out = runner.invoke(app, ["chat", "-a", "upper"], input=piped)
    assert out.exit_code == 0, out.output
    [(_, _, messages)] = fake.calls
    assert messages == [{"role": "user", "content": prompt}]


def converse(monkeypatch, lines: list[str], client: FakeClient, adapter: str | None = None, system: str | None = None):
    """Run the REPL's loop over `lines` typed (then Ctrl-D); return the user messages it sent as
    (adapter, the conversation's contents)."""
    typed = iter(lines)

    def fake_input(prompt):
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None
    monkeypatch.setattr("builtins.input", fake_input)
    monkeypatch.setattr("sys.stdout", Stdout(tty=False))
    start = [{"role": "system", "content": system}] if system else []
    chat_cli.converse(client, start, adapter, {"max_tokens": 4}, stream=False)
    return [(adapter, [m["content"] for m in messages]) for _, adapter, messages in client.calls]


def test_slash_commands_never_reach_the_model(monkeypatch, capsys):
    client = FakeClient({None: "base says", "upper": "UPPER SAYS", "kebab": "kebab-says"})
    sent = converse(monkeypatch, ["/help", "/adapter upper", "hello", "/adapter", "/adapter kebab", "again",
                                  "/adapter -", "third", "/adapter upper", "/base", "fourth"], client)
    assert sent == [
        ("upper", ["hello"]),
        ("kebab", ["hello", "UPPER SAYS", "again"]),  # the conversation carries over a switch
        (None, ["hello", "UPPER SAYS", "again", "kebab-says", "third"]),
        (None, ["hello", "UPPER SAYS", "again", "kebab-says", "third", "base says", "fourth"]),
    ]
    err = capsys.readouterr().err
    for command in ("/adapter NAME", "/clear", "/exit", "/base", "//TEXT"):  # /help's list
        assert command in err
    assert "talking to upper" in err and "talking to the base model" in err


def test_clear_forgets_the_conversation_but_not_the_system_message(monkeypatch):
    client = FakeClient({None: "ok"})
    sent = converse(monkeypatch, ["one", "/clear", "two"], client, system="be brief")
    assert sent == [(None, ["be brief", "one"]), (None, ["be brief", "two"])]


def test_an_unknown_command_says_so_and_sends_nothing_and_a_double_slash_sends_the_rest(monkeypatch, capsys):
    client = FakeClient({None: "ok"})
    sent = converse(monkeypatch, ["/frobnicate now", "//etc is a folder", "/exit", "never sent"], client)
    assert sent == [(None, ["/etc is a folder"])]
    assert "unknown command /frobnicate" in capsys.readouterr().err


def test_quit_ends_the_loop(monkeypatch):
    client = FakeClient({None: "ok"})
    assert converse(monkeypatch, ["/quit", "never sent"], client) == []


def test_a_refused_message_says_why_and_the_loop_goes_on_without_it(monkeypatch, capsys):
    client = FakeClient({None: "ok", "ghost": "boo"})
    client.models = lambda: [{"id": "base"}]  # listed when switched to, gone by the message
    monkeypatch.setattr(chat_cli, "_check_served", lambda c, adapter: None)
    sent = converse(monkeypatch, ["/adapter ghost", "hello", "/base", "hello again"], FakeClient({None: "ok"}))
    assert sent == [("ghost", ["hello"]), (None, ["hello again"])]  # the refused turn is not kept
    assert "error: no adapter 'ghost'" in capsys.readouterr().err


def test_an_adapter_the_daemon_does_not_list_is_refused_when_switched_to(monkeypatch, capsys):
    """Issue 64 (19): `/adapter nope` was accepted until the next message."""
    client = FakeClient({None: "ok"})
    sent = converse(monkeypatch, ["/adapter nope", "hello"], client)
    assert sent == [(None, ["hello"])]  # still the base
    assert "no adapter named 'nope'" in capsys.readouterr().err


def test_a_daemon_that_went_away_ends_the_loop(monkeypatch):
    client = FakeClient({None: "ok"})

    def gone(*args, **kwargs):
        raise DaemonUnreachableError("no lorafleet daemon is running")
    client.chat = gone
    with pytest.raises(DaemonUnreachableError):
        converse(monkeypatch, ["hello", "again"], client)


def test_a_piped_prompt_gets_the_same_answer_as_an_argument_from_a_real_daemon(served):
    env = {"LORAFLEET_SOCKET": str(served.socket), "LORAFLEET_HOME": str(served.home)}
    args = ["chat", "-a", "attn-r3", "-n", "6", "-t", "0"]
    given = runner.invoke(app, [*args, "hello"], env=env)
    piped = runner.invoke(app, args, env=env, input="hello\n")
    assert given.exit_code == piped.exit_code == 0, given.output + piped.output
    assert piped.stdout == given.stdout and given.stdout.endswith("\n")


def test_several_adapters_or_a_scale_send_a_mix_in_the_adapters_field(fake):
    out = runner.invoke(app, ["chat", "-a", "upper", "--adapter", "kebab:0.5", "hi"])
    assert out.exit_code == 0, out.output
    assert fake.calls[-1][1] is None  # model: the base
    assert fake.mixes[-1] == [{"name": "kebab", "scale": 0.5}, {"name": "upper", "scale": 1.0}]
    runner.invoke(app, ["chat", "-a", "upper:-1.5", "hi"])
    assert fake.mixes[-1] == [{"name": "upper", "scale": -1.5}]
    runner.invoke(app, ["chat", "-a", "upper", "hi"])  # one adapter without a scale: model, as before
    assert fake.calls[-1][1] == "upper" and fake.mixes[-1] is None


@pytest.mark.parametrize("options, problem", [(["a:9"], r"scale must be a finite number in \[-4, 4\]"),
                                              (["a", "a:0.5"], "appears twice")])
def test_a_bad_mix_is_refused_before_anything_is_sent(fake, options, problem):
    import re
    out = runner.invoke(app, ["chat", *[f"--adapter={o}" for o in options], "hi"])
    assert out.exit_code != 0 and re.search(problem, out.output.replace("\n", " ")), out.output
    assert fake.calls == []


def test_the_repl_switches_to_a_mix_and_back(fake, monkeypatch):
    fake.answers["mixed"] = "x"
    sent = converse(monkeypatch, ["/adapter upper kebab:0.5", "hello", "/adapter upper", "again", "/adapter a:7",
                                  "third"], fake)
    assert fake.mixes[:2] == [[{"name": "kebab", "scale": 0.5}, {"name": "upper", "scale": 1.0}], None]
    assert [adapter for adapter, _ in sent] == [None, "upper", "upper"]  # the bad mix changed nothing
