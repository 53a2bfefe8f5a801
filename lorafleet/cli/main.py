"""The `lorafleet` command: a Typer app with one module per verb group.

Verb modules import their heavy code (torch, the engine, the bench) inside the command
functions, so that `lorafleet --help` and `lorafleet --version` answer fast.
"""

from __future__ import annotations

from typing import Annotated

import typer

from lorafleet import __version__
from lorafleet.cli import bench
from lorafleet.cli.common import fail
from lorafleet.errors import LorafleetError

app = typer.Typer(
    name="lorafleet",
    help="Serve one base LLM with many LoRA adapters on one machine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # docstring paragraphs reflow to the terminal's width
)
app.command("bench")(bench.bench)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"lorafleet {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Serve one base LLM with many LoRA adapters on one machine."""


def main() -> None:
    try:
        app()
    except LorafleetError as e:  # verbs answer their own; this catches any that slip through
        raise SystemExit(fail(str(e), e.exit_code).exit_code) from None
