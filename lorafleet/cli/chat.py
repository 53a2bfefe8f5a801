"""`lorafleet chat`: talk to the base or one adapter. One-shot when a prompt is given or stdin is
piped; otherwise a REPL that keeps the conversation (and line-editing history), with slash
commands that never reach the model.

Answers stream token by token only onto a terminal (or with `--stream`); anywhere else each
answer is written whole, with its newline, in one write once complete: several `chat` processes
sharing one output (README's mixed batch, `&` and `wait`) then print whole lines, never mixed
characters, since a write of up to PIPE_BUF bytes is atomic.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from lorafleet.cli.common import (ApiKeyOption, JsonOption, SocketOption, UrlOption, client, err_console, print_json,
                                  styled, user_errors)
from lorafleet.errors import DaemonUnreachableError, LorafleetError

REPL_HELP = "/help lists the commands, Ctrl-D or /exit quits, Ctrl-C stops an answer."
COMMANDS = (  # (usage, what it does): what /help prints
    ("/adapter NAME", "talk to adapter NAME from now on (the conversation carries over)"),
    ("/adapter", "say which adapter answers"),
    ("/adapter -, /base", "talk to the base model"),
    ("/clear", "forget the conversation (the --system message stays)"),
    ("/help", "this list"),
    ("/exit, /quit", "leave (as Ctrl-D does)"),
    ("//TEXT", "send /TEXT as a message"),
)


def chat(
    prompt: Annotated[str | None, typer.Argument(
        help="The message. Without it, stdin is read when piped, else a REPL starts.", show_default=False)] = None,
    adapter: Annotated[str | None, typer.Option(
        "--adapter", "-a", help="The adapter to talk to. Default: the base model.")] = None,
    system: Annotated[str | None, typer.Option("--system", "-s", help="A system message first.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", min=1, help="Most tokens per answer.")] = 256,
    temperature: Annotated[float | None, typer.Option(
        "--temperature", "-t", min=0.0, show_default=False,
        help="0 is greedy. Default: the model's generation_config.json, else 1.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", min=0, help="Same seed, same answer.")] = None,
    stream: Annotated[bool | None, typer.Option(
        "--stream/--no-stream", show_default=False,
        help="Print answers token by token, or each whole in one write once complete (several chats "
             "sharing a terminal then print whole lines). Default: stream onto a terminal only.")] = None,
    as_json: JsonOption = False,
    socket: SocketOption = None,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Chat with the base model or an adapter through the daemon."""
    params = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed}
    start = [{"role": "system", "content": system}] if system else []
    if stream is None:
        stream = sys.stdout.isatty()
    if prompt is None and not sys.stdin.isatty():
        prompt = strip_line_end(sys.stdin.read())
    with user_errors(), client(socket, url, api_key) as c:
        c.wait_started(START_WAIT_S, lambda e: err_console.print(f"waiting: {e}", highlight=False, soft_wrap=True))
        if prompt is not None:
            messages = start + [{"role": "user", "content": prompt}]
            if as_json:
                return print_json(c.chat(messages, adapter, **params))
            answer(c, messages, adapter, params, stream)
            return
        _repl(c, start, adapter, params, stream)


START_WAIT_S = 600.0  # a daemon still starting (a first start builds the kernels) is waited for, this long


def strip_line_end(text: str) -> str:
    """A piped prompt without the line ending that ends it (`echo hi |` sends "hi\\n"): only that
    one, other whitespace is the user's."""
    for end in ("\r\n", "\n"):
        if text.endswith(end):
            return text[:-len(end)]
    return text


def answer(c, messages: list[dict], adapter: str | None, params: dict, stream: bool) -> str:
    """Print the answer and its newline, streamed or whole; return it."""
    if stream:
        return _stream_answer(c, messages, adapter, params)
    try:
        text = c.chat(messages, adapter, **params)["choices"][0]["message"]["content"] or ""
    except KeyboardInterrupt:  # the connection closes: the daemon aborts the request
        err_console.print(styled("(stopped)", "dim"))
        return ""
    sys.stdout.write(text + "\n")  # one write: the answer and its newline never part
    sys.stdout.flush()
    return text


def _stream_answer(c, messages: list[dict], adapter: str | None, params: dict) -> str:
    """Print the answer as it streams; returns it. Ctrl-C stops it (closing the stream aborts
    the request in the daemon) and keeps what came so far."""
    parts = []
    chunks = c.chat_stream(messages, adapter, **params)
    try:
        for chunk in chunks:
            for choice in chunk["choices"]:
                text = choice["delta"].get("content") or ""
                parts.append(text)
                sys.stdout.write(text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        err_console.print(styled("\n(stopped)", "dim"))
    finally:
        chunks.close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(parts)


def _repl(c, start: list[dict], adapter: str | None, params: dict, stream: bool) -> None:
    history = _load_history()
    err_console.print(f"chatting with {_who(adapter)} on {c.where}. {REPL_HELP}", highlight=False)
    try:
        converse(c, start, adapter, params, stream)
    finally:
        history()


def _who(adapter: str | None) -> str:
    return adapter or "the base model"


def _load_history():
    """Line editing, and the lines typed in earlier sessions ($LORAFLEET_HOME/chat_history);
    returns what saves them again."""
    try:
        import readline
    except ImportError:  # no readline on this platform: plain input()
        return lambda: None
    from lorafleet import paths

    path = paths.home() / "chat_history"
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)

    def save():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass
    return save


def _say(message: str) -> None:
    err_console.print(styled(message, "dim"), soft_wrap=True)


def converse(c, start: list[dict], adapter: str | None, params: dict, stream: bool = True) -> None:
    """The REPL's loop: each line typed is a message, or a slash command (`COMMANDS`), which never
    reaches the model. A refused message (an unknown adapter, a bad parameter) says why and the
    loop goes on, without it in the conversation; a daemon that went away ends the loop."""
    messages = list(start)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            sys.stdout.write("\n")
            return
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            continue
        if not line.strip():
            continue
        command = line.strip()
        if command.startswith("/") and not command.startswith("//"):
            name, _, arg = command.partition(" ")
            arg = arg.strip()
            if name in ("/exit", "/quit"):
                return
            if name in ("/clear", "/reset"):  # /reset: its name before /clear
                messages = list(start)
                _say("(conversation cleared)")
            elif name == "/help":
                width = max(len(usage) for usage, _ in COMMANDS)
                err_console.print("\n".join(f"  {usage:<{width}}  {what}" for usage, what in COMMANDS),
                                  highlight=False, soft_wrap=True)
            elif name == "/base":
                adapter = None
                _say(f"(talking to {_who(adapter)})")
            elif name == "/adapter":
                if arg and " " not in arg:
                    adapter = None if arg == "-" else arg
                elif arg:
                    _say(f"(an adapter's name has no spaces: {arg!r}; nothing changed)")
                    continue
                _say(f"(talking to {_who(adapter)})")
            else:
                _say(f"(unknown command {name}; /help lists them, //TEXT sends /TEXT)")
            continue
        if command.startswith("//"):
            line = line.lstrip()[1:]
        messages.append({"role": "user", "content": line})
        try:
            said = answer(c, messages, adapter, params, stream)
        except DaemonUnreachableError:
            raise
        except LorafleetError as e:
            messages.pop()
            err_console.print(styled("error:", "bold red", str(e)), soft_wrap=True)
            continue
        messages.append({"role": "assistant", "content": said})
