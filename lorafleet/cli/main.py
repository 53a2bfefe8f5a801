"""The `lorafleet` command: a Typer app with one module per verb group.

Verb modules import their heavy code (torch, the engine, the bench) inside the command
functions, so that `lorafleet --help` and `lorafleet --version` answer fast.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from lorafleet import __version__
from lorafleet.cli import adapters, bench, chat, deploy, logs, ollama_verbs, ps, serve, service, status, store, top, verify
from lorafleet.cli.serve_config import ServeCommand
from lorafleet.cli.common import fail
from lorafleet.errors import LorafleetError

app = typer.Typer(
    name="lorafleet",
    help="Serve one base LLM with many LoRA adapters on one machine.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # docstring paragraphs reflow to the terminal's width
)
app.command("serve", cls=ServeCommand)(serve.serve)
app.command("status")(status.status)
app.command("ps")(ps.ps)
app.command("logs")(logs.logs)
app.command("stop")(status.stop)
app.command("chat")(chat.chat)
app.command("top")(top.top)
app.command("pull")(store.pull)
app.command("verify")(verify.verify)
app.add_typer(adapters.app, name="adapters")
app.add_typer(store.models_app, name="models")
app.add_typer(store.store_app, name="store")
app.add_typer(bench.app, name="bench")
app.add_typer(deploy.app, name="deploy")
app.add_typer(service.app, name="service")
ollama_verbs.register(app)  # run, list, show, rm: Ollama's verbs, hidden


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
        if "--json" in sys.argv[1:]:
            raise SystemExit(_main_json())
        app(prog_name="lorafleet")  # the same name (and completion variable) under `python -m`
    except LorafleetError as e:  # verbs answer their own; this catches any that slip through
        raise SystemExit(fail(str(e), e.exit_code).exit_code) from None


def _main_json() -> int:
    """A command line with `--json`: a usage error (click's, raised while the line is parsed,
    before any verb runs) is the JSON error object on stderr too, with click's exit status (2);
    the verbs' own failures are already JSON (`common.fail`)."""
    from typer.core import _click
    from typer.exceptions import Abort

    try:
        rv = app(prog_name="lorafleet", standalone_mode=False)  # an Exit comes back as its status
    except _click.exceptions.ClickException as e:
        typer.echo(json.dumps({"error": {"code": "usage_error", "message": e.format_message()}},
                              ensure_ascii=False), err=True)
        return e.exit_code
    except Abort:
        return 1
    return rv if isinstance(rv, int) and not isinstance(rv, bool) else 0


if __name__ == "__main__":  # `python -m lorafleet.cli.main`: how `serve --detach` starts the daemon
    main()
