"""What every verb shares: the consoles and the one-line answer to a `LorafleetError`.

Both consoles print text literally (no rich markup, no highlighting): names, paths and messages
come from users and files, and `[b]` in a path is a folder name, not bold. What is styled is
styled with `styled`, never with markup in a string.

With `--json` (`JsonOption`), a verb's failure is a JSON object on stderr instead of that line,
`{"error": {"code": ..., "message": ...}}`, with the same exit code: `fail` decides, for every verb.

Nothing here imports torch, triton or the engine: `lorafleet --help` must answer fast.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from lorafleet.errors import LorafleetError

# Off a terminal (a pipe, a file) rich lays out to 80 columns and cuts or wraps what is wider
# (paths in `adapters ls | cat`): there, a verb's answer is as wide as what it holds
UNBOUNDED = 100_000


def _width(stream) -> int | None:
    """None (the terminal's, or $COLUMNS) on a terminal; else as wide as a line needs."""
    return None if stream.isatty() or os.environ.get("COLUMNS") else UNBOUNDED


# soft_wrap: a message is one line, however long (a path is never cut in two); the width stays the
# terminal's (80 off one) for what fills it (rules, progress bars)
err_console = Console(stderr=True, markup=False, highlight=False, soft_wrap=True)


def out_console() -> Console:
    """The console of a verb's answer on stdout (tables, status), literal as `err_console`."""
    return Console(markup=False, highlight=False, width=_width(sys.stdout))


def styled(label: str, style: str, message: str = "") -> Text:
    """`label` in `style`, then `message` as it is (a path with brackets stays a path)."""
    return Text.assemble((label, style), " " if message else "", message)


# set by `--json` (`json_errors`) for the command line it belongs to, unset when that ends
_json_errors: ContextVar[bool] = ContextVar("lorafleet_json_errors", default=False)

# a failure's `code` when the caller names none, by exit code (LorafleetErrors carry their own)
_CODES = {1: "error", 2: "usage_error", 3: "daemon_unreachable"}


def fail(message: str, exit_code: int = 1, code: str | None = None) -> typer.Exit:
    """Print `error: message` on stderr, or with `--json` the object `{"error": {"code", "message"}}`
    (`code` defaults by exit code); return the Exit to raise."""
    if _json_errors.get():
        error = {"code": code or _CODES.get(exit_code, "error"), "message": message}
        typer.echo(json.dumps({"error": error}, ensure_ascii=False), err=True)  # one line, never wrapped
    else:
        err_console.print(styled("error:", "bold red", message), soft_wrap=True)
    return typer.Exit(exit_code)


@contextmanager
def user_errors():
    """Turn a `LorafleetError` into one line on stderr (or its JSON) and its exit code, without a
    traceback."""
    try:
        yield
    except LorafleetError as e:
        raise fail(str(e), e.exit_code, e.code) from None


# -- what the client verbs share ---------------------------------------------------------------

SocketOption = Annotated[Path | None, typer.Option(
    "--socket", envvar="LORAFLEET_SOCKET", metavar="PATH",
    help="The daemon's Unix socket. Default: $XDG_RUNTIME_DIR/lorafleet/lorafleet.sock, "
         "else $LORAFLEET_HOME/run/lorafleet.sock.")]
UrlOption = Annotated[str | None, typer.Option(
    "--url", envvar="LORAFLEET_URL", metavar="URL",
    help="Reach the daemon over TCP instead (one started with `serve --host H --port P --api-key KEY`), "
         "e.g. http://127.0.0.1:8000.")]
ApiKeyOption = Annotated[str | None, typer.Option(
    "--api-key", envvar="LORAFLEET_API_KEY", metavar="KEY",
    help="The daemon's API key, sent as `Authorization: Bearer KEY` (needed with --url).")]


def json_errors(ctx: typer.Context, value: bool) -> bool:
    """`--json`'s callback: the command's failures print JSON too (see `fail`), until it ends.
    Undone when the root context closes: it always does, where a subcommand's context is never
    closed when a later option of the command line is refused."""
    if value:
        _json_errors.set(True)
        ctx.find_root().call_on_close(lambda: _json_errors.set(False))
    return value


JsonOption = Annotated[bool, typer.Option(
    "--json", callback=json_errors,
    help="Print JSON for scripts instead of text; errors too, as {\"error\": {\"code\", \"message\"}} on stderr.")]


def client(socket: Path | None, url: str | None = None, api_key: str | None = None):
    """The daemon's client: over `url` when given, else the socket (imported here so that verbs
    that do not need it stay light)."""
    from lorafleet.client import Client

    return Client(socket, url, api_key)


def print_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, ensure_ascii=False))


def _help_types() -> None:
    """`--help`'s type column without the annotations' spelling: a switch shows none (not
    `<bool>`), a repeatable option its element type once and `...` (not `<list[str]>`)."""
    import re

    from typer.core import TyperArgument, TyperOption

    for cls in (TyperOption, TyperArgument):
        def display_type_rich(self, ctx, shown=cls.display_type_rich):
            if getattr(self, "is_flag", False):
                return None
            text = shown(self, ctx)
            return re.sub(r"^<list\[(\w+)\]>(\.\.\.)?$", r"<\1>...", text) if isinstance(text, str) else text
        cls.display_type_rich = display_type_rich  # type: ignore[method-assign]  # Typer's, patched on purpose


_help_types()
