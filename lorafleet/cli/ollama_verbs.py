"""Ollama's verbs, for its users' fingers: `run NAME [PROMPT]` is `chat --adapter NAME [PROMPT]`
(NAME an adapter, or the base's name); `list`, `show` and `rm` say which verb does that here.
Hidden from `--help`: lorafleet's own verbs are the ones it documents."""

from __future__ import annotations

from typing import Annotated

import typer

from lorafleet.cli import chat as chat_verb
from lorafleet.cli.common import SocketOption, fail

HINTS = {
    "list": "`lorafleet models ls` (bases) and `lorafleet adapters ls` (adapters)",
    "show": "`lorafleet adapters show NAME` (an adapter) or `lorafleet status` (the base, the pool)",
    "rm": "`lorafleet adapters rm NAME` or `lorafleet models rm NAME` (the store)",
}


def run(
    name: Annotated[str, typer.Argument(help="The adapter to talk to, or the base's name.")],
    prompt: Annotated[str | None, typer.Argument(help="The message; without it, a REPL.")] = None,
    socket: SocketOption = None,
) -> None:
    """Ollama's `run`: `lorafleet chat --adapter NAME [PROMPT]`."""
    chat_verb.chat(prompt=prompt, adapter=[name], socket=socket)


def hint(verb: str):
    def command(ctx: typer.Context) -> None:
        raise fail(f"`{verb}` is Ollama's verb; lorafleet's: {HINTS[verb]}", 2)
    command.__doc__ = f"Ollama's `{verb}`: says which lorafleet verb does it."
    return command


def register(app: typer.Typer) -> None:
    app.command("run", hidden=True)(run)
    for verb in HINTS:
        app.command(verb, hidden=True, context_settings={"allow_extra_args": True,
                                                         "ignore_unknown_options": True})(hint(verb))
