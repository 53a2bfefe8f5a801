"""`lorafleet chat`: talk to the base, one adapter, or a mix of several. One-shot when a prompt is
given or stdin is piped; otherwise a REPL that keeps the conversation (and line-editing history),
with slash commands that never reach the model.

`--adapter NAME` sends `model: NAME`, as any OpenAI client does; several `--adapter` options, or
one with a scale (`--adapter NAME:SCALE`), send a mix: the body's `adapters` field, each adapter
with its scale (`adapters/mix.py` checks it here first, so a bad mix never leaves the process).

Answers stream token by token only onto a terminal (or with `--stream`); anywhere else each
answer is written whole, with its newline, in one write once complete: several `chat` processes
sharing one output (README's mixed batch, `&` and `wait`) then print whole lines, never mixed
characters, since a write of up to PIPE_BUF bytes is atomic.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from lorafleet.cli.common import (ApiKeyOption, JsonOption, SocketOption, UrlOption, client, err_console, print_json,
                                  styled, user_errors)
from lorafleet.errors import DaemonUnreachableError, LorafleetError
from lorafleet.adapters.mix import Mix

REPL_HELP = "/help lists the commands, Ctrl-D or /exit quits, Ctrl-C stops an answer."
COMMANDS = (  # (usage, what it does): what /help prints
    ("/adapter NAME", "talk to adapter NAME from now on (the conversation carries over)"),
    ("/adapter A B:0.5", "talk to a mix: A at scale 1 and B at 0.5 (NAME:SCALE, scales in [-4, 4])"),
    ("/adapter", "say which adapter answers"),
    ("/adapter -, /base", "talk to the base model"),
    ("/clear", "forget the conversation (the --system message stays)"),
    ("/help", "this list"),
    ("/exit, /quit, /bye", "leave (as Ctrl-D does; /bye is Ollama's)"),
    ("//TEXT", "send /TEXT as a message"),
)


def chat(
    prompt: Annotated[str | None, typer.Argument(
        help="The message. Without it, stdin is read when piped, else a REPL starts.", show_default=False)] = None,
    adapter: Annotated[list[str] | None, typer.Option(
        "--adapter", "-a", help="The adapter to talk to, NAME or NAME:SCALE; repeat it to mix several, each "
                                "delta times its scale (a finite number in [-4, 4], default 1; at most 16 "
                                "adapters). Default: the base model.", show_default=False)] = None,
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
    json_schema: Annotated[Path | None, typer.Option(
        "--json-schema", help="Hold each answer to the JSON schema in this file.", show_default=False)] = None,
    regex: Annotated[str | None, typer.Option(
        "--regex", help="Hold each answer to this regular expression.", show_default=False)] = None,
    choice: Annotated[str | None, typer.Option(
        "--choice", help="Answer with one of these comma-separated strings.", show_default=False)] = None,
    as_json: JsonOption = False,
    socket: SocketOption = None,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Chat with the base model or an adapter through the daemon."""
    params = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed,
              **structured(json_schema, regex, choice)}
    start = [{"role": "system", "content": system}] if system else []
    if stream is None:
        stream = sys.stdout.isatty()
    if prompt is None and not sys.stdin.isatty():
        prompt = strip_line_end(sys.stdin.read())
        if not prompt.strip():
            raise typer.BadParameter("stdin held no message (it was empty); give one as PROMPT or on stdin",
                                     param_hint="PROMPT")
    with user_errors(), client(socket, url, api_key) as c:
        given, chosen = adapter, target(adapter)
        c.wait_started(START_WAIT_S, lambda e: err_console.print(f"waiting: {e}", highlight=False, soft_wrap=True))
        _check_scales(c, given, chosen)
        if prompt is not None:
            messages = start + [{"role": "user", "content": prompt}]
            if as_json:  # a mix goes in the `adapters` field, as `answer` sends it
                model, call_params = _call(chosen, params)
                return print_json(c.chat(messages, model, **call_params))
            if isinstance(answer(c, messages, chosen, params, stream), _Stopped):
                raise typer.Exit(130)  # as a shell reports a command Ctrl-C ended
            return
        _repl(c, start, chosen, params, stream)


def structured(json_schema: Path | None, regex: str | None, choice: str | None) -> dict:
    """The request fields `--json-schema`, `--regex` or `--choice` ask for (one of them)."""
    given = [name for name, v in (("--json-schema", json_schema), ("--regex", regex), ("--choice", choice))
             if v is not None]
    if len(given) > 1:
        raise typer.BadParameter(f"give one of them, not {' and '.join(given)}", param_hint=given[1])
    if json_schema is not None:
        try:
            schema = json.loads(json_schema.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise typer.BadParameter(f"{json_schema}: not a JSON file ({e})", param_hint="--json-schema") from None
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": json_schema.stem, "schema": schema}}}
    if regex is not None:
        return {"structured_outputs": {"regex": regex}}
    if choice is not None:
        return {"structured_outputs": {"choice": [c for c in choice.split(",") if c]}}
    return {}


START_WAIT_S = 600.0  # a daemon still starting (a first start builds the kernels) is waited for, this long


def target(options: list[str] | None) -> str | Mix | None:
    """What `--adapter` options name: None (the base), one adapter's name (one option without a
    scale), or a mix (InvalidRequestError naming the option at fault)."""
    if not options:
        return None
    mix = Mix.parse_option(options)
    return options[0] if len(options) == 1 and mix.members == ((options[0], 1.0),) else mix


def _call(adapter: str | Mix | None, params: dict) -> tuple[str | None, dict]:
    """The client call's model and parameters for `adapter`: a mix goes in the `adapters` field."""
    if isinstance(adapter, Mix):
        return None, {**params, "adapters": adapter.to_json()}
    return adapter, params


def strip_line_end(text: str) -> str:
    """A piped prompt without the line ending that ends it (`echo hi |` sends "hi\\n"): only that
    one, other whitespace is the user's."""
    for end in ("\r\n", "\n"):
        if text.endswith(end):
            return text[:-len(end)]
    return text


class _Stopped(str):
    """What Ctrl-C left of an answer (it compares as that text)."""


STOPPED = _Stopped()  # `answer`'s result when Ctrl-C stopped an answer whole


def answer(c, messages: list[dict], adapter: str | Mix | None, params: dict, stream: bool) -> str:
    """Print the answer and its newline, streamed or whole; return it: a `_Stopped` (STOPPED when
    nothing came) where Ctrl-C stopped it."""
    if stream:
        return _stream_answer(c, messages, adapter, params)
    model, params = _call(adapter, params)
    try:
        text = c.chat(messages, model, **params)["choices"][0]["message"]["content"] or ""
    except KeyboardInterrupt:  # the connection closes: the daemon aborts the request
        err_console.print(styled("(stopped)", "dim"))
        return STOPPED
    sys.stdout.write(text + "\n")  # one write: the answer and its newline never part
    sys.stdout.flush()
    return text


def _stream_answer(c, messages: list[dict], adapter: str | Mix | None, params: dict) -> str:
    """Print the answer as it streams; returns it. Ctrl-C stops it (closing the stream aborts
    the request in the daemon) and keeps what came so far."""
    parts, stopped = [], False
    model, params = _call(adapter, params)
    chunks = c.chat_stream(messages, model, **params)
    try:
        for chunk in chunks:
            for choice in chunk["choices"]:
                text = choice["delta"].get("content") or ""
                parts.append(text)
                sys.stdout.write(text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        stopped = True
        err_console.print(styled("\n(stopped)", "dim"))
    finally:
        chunks.close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return _Stopped("".join(parts)) if stopped else "".join(parts)


def _repl(c, start: list[dict], adapter: str | Mix | None, params: dict, stream: bool) -> None:
    history = _load_history()
    err_console.print(f"chatting with {_who(adapter)} on {c.where}. {REPL_HELP}", highlight=False)
    try:
        converse(c, start, adapter, params, stream)
    finally:
        history()


def _who(adapter: str | Mix | None) -> str:
    if isinstance(adapter, Mix):
        return "the mix " + ", ".join(f"{n} x{s:g}" for n, s in adapter.members)
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


def _check_scales(c, given: list[str] | None, adapter: str | Mix | None) -> None:
    """A usage error (exit 2) for `-a NAME:X` whose X is no number, unless the daemon serves an
    adapter of that whole name (names may hold ':'): `reverse:abc` is a mistyped scale."""
    names = [n for n, _ in adapter.members] if isinstance(adapter, Mix) else [adapter] if adapter else []
    odd = [n for n in names if n in (given or []) and ":" in n]
    if odd and (missing := [n for n in odd if n not in {m["id"] for m in c.models()}]):
        name, _, tail = missing[0].rpartition(":")
        raise typer.BadParameter(f"{missing[0]!r}: {tail!r} after ':' is no scale (a number in [-4, 4], as in "
                                 f"{name}:0.5), and no adapter has that whole name", param_hint="--adapter")


def _check_served(c, adapter: str | Mix | None) -> None:
    """AdapterNotFoundError naming each of `adapter`'s names the daemon does not list (`/v1/models`:
    the base, loaded adapters and, where it serves the store, stored ones)."""
    from lorafleet.errors import AdapterNotFoundError

    names = [n for n, _ in adapter.members] if isinstance(adapter, Mix) else [adapter] if adapter else []
    listed = {m["id"] for m in c.models()}
    missing = [n for n in names if n not in listed]
    if missing:
        raise AdapterNotFoundError(f"no adapter named {', '.join(repr(n) for n in missing)} here "
                                   "(`lorafleet adapters ls` lists them)")


def _say(message: str) -> None:
    err_console.print(styled(message, "dim"), soft_wrap=True)


def converse(c, start: list[dict], adapter: str | Mix | None, params: dict, stream: bool = True) -> None:
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
            if name in ("/exit", "/quit", "/bye"):
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
                if arg == "-":
                    adapter = None
                elif arg:
                    try:
                        chosen = target(arg.split())
                        _check_served(c, chosen)  # now, not at the next message
                    except LorafleetError as e:
                        _say(f"({e}; nothing changed)")
                        continue
                    adapter = chosen
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
