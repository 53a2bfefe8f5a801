"""`lorafleet chat`: talk to the base or one adapter. One-shot when a prompt is given or stdin is
piped; otherwise a streaming REPL that keeps the conversation (and line-editing history)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from lorafleet.cli.common import (ApiKeyOption, JsonOption, SocketOption, UrlOption, client, err_console, print_json,
                                  styled, user_errors)

REPL_HELP = "Ctrl-D or /exit quits, /reset forgets the conversation, Ctrl-C stops an answer."


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
    as_json: JsonOption = False,
    socket: SocketOption = None,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Chat with the base model or an adapter through the daemon."""
    params = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed}
    start = [{"role": "system", "content": system}] if system else []
    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    with user_errors(), client(socket, url, api_key) as c:
        if prompt is not None:
            messages = start + [{"role": "user", "content": prompt}]
            if as_json:
                return print_json(c.chat(messages, adapter, **params))
            _stream_answer(c, messages, adapter, params)
            return
        c.health()  # fail now, not after the user has typed something
        _repl(c, start, adapter, params)


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


def _repl(c, start: list[dict], adapter: str | None, params: dict) -> None:
    history = _load_history()
    who = adapter or "the base model"
    err_console.print(f"chatting with {who} on {c.where}. {REPL_HELP}", highlight=False)
    try:
        _converse(c, start, adapter, params)
    finally:
        history()


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


def _converse(c, start: list[dict], adapter: str | None, params: dict) -> None:
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
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            messages = list(start)
            err_console.print(styled("(conversation cleared)", "dim"))
            continue
        messages.append({"role": "user", "content": line})
        answer = _stream_answer(c, messages, adapter, params)
        messages.append({"role": "assistant", "content": answer})
