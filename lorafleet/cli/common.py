"""What every verb shares: the stderr console and the one-line answer to a `LorafleetError`.

Nothing here imports torch, triton or the engine: `lorafleet --help` must answer fast.
"""

from __future__ import annotations

from contextlib import contextmanager

import typer
from rich.console import Console
from rich.markup import escape

from lorafleet.errors import LorafleetError

err_console = Console(stderr=True)


def fail(message: str, exit_code: int = 1) -> typer.Exit:
    """Print `error: message` on stderr; return the Exit to raise."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(exit_code)


@contextmanager
def user_errors():
    """Turn a `LorafleetError` into one line on stderr and its exit code, without a traceback."""
    try:
        yield
    except LorafleetError as e:
        raise fail(str(e), e.exit_code) from None
