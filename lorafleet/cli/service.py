"""`lorafleet service install|uninstall|status`: the daemon as a systemd user service.

`install [--] [SERVE_ARGS]...` writes `$XDG_CONFIG_HOME/systemd/user/lorafleet.service`, whose
`ExecStart` runs `serve` with those arguments, as given, under this interpreter
(`sys.executable -m lorafleet.cli.main`: the environment lorafleet is installed in, whether or not
its `bin` is on the service's PATH). The arguments are checked by parsing them as `serve` would,
so a typo fails here rather than in a restart loop; they are kept as typed, not expanded, so
that `config.toml` keeps setting the rest. The daemon writes the log `lorafleet logs` reads
(`StandardOutput=append:`), not the journal. Then `systemctl --user daemon-reload` and
`enable --now` run, unless `--no-start` or there is no systemctl: then the commands are printed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from lorafleet import paths
from lorafleet.cli.common import JsonOption, err_console, fail, print_json
from lorafleet.errors import LorafleetError

UNIT = "lorafleet.service"
# the variables the service inherits from the shell that installs it; not the API key (a
# secret in a world-readable unit: it goes in config.toml) nor the clients' URL
NOT_INHERITED = {"LORAFLEET_API_KEY", "LORAFLEET_URL"}
_BARE = re.compile(r"[A-Za-z0-9_@+=:,./-]+\Z")  # needs no quotes in ExecStart

app = typer.Typer(help="Run the daemon as a systemd user service: install, uninstall, status.",
                  no_args_is_help=True)


def unit_path() -> Path:
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "systemd" / "user" / UNIT


def _checked(text: str, what: str) -> str:
    if any(ord(c) < 32 or ord(c) == 127 for c in text):  # a newline would start a line of its own in the unit
        raise fail(f"{what} {text!r} holds a control character, which a unit file cannot carry", 2)
    return text


def quote(arg: str, variables: bool = True) -> str:
    """One word as systemd reads it back: specifiers (%) escaped, and with `variables` (ExecStart=,
    which expands $VAR) variables ($) too; quoted where it holds anything but plain characters.
    An Environment= assignment takes `variables=False`: systemd expands no variable there, so
    `$` is itself and `$$` would stay two of them (systemd.exec(5), Environment=)."""
    _checked(arg, "the argument")
    escaped = arg.replace("%", "%%")
    if variables:
        escaped = escaped.replace("$", "$$")
    if _BARE.match(arg):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def unit_text(serve_args: list[str], env: dict[str, str], log_file: Path, cwd: Path, stop_timeout_s: float,
              python: str = sys.executable) -> str:
    exec_start = " ".join(quote(a) for a in [python, "-P", "-m", "lorafleet.cli.main", "serve", *serve_args])
    environment = "".join(f"Environment={quote(f'{k}={v}', variables=False)}\n" for k, v in sorted(env.items()))
    for what, path in (("the log file", log_file), ("the working directory", cwd)):
        _checked(str(path), what)
    return f"""# written by `lorafleet service install`; `lorafleet service uninstall` removes it
[Unit]
Description=lorafleet: one base LLM, many LoRA adapters, an OpenAI-compatible API
Documentation=man:lorafleet-service(1)

[Service]
Type=simple
ExecStart={exec_start}
WorkingDirectory={str(cwd).replace('%', '%%')}
{environment}StandardOutput=append:{str(log_file).replace('%', '%%')}
StandardError=inherit
Restart=on-failure
RestartSec=5
# the drain (--drain-timeout) and some room to exit, before systemd kills it
TimeoutStopSec={int(stop_timeout_s) + 30}

[Install]
WantedBy=default.target
"""


def _serve_context(serve_args: list[str]):
    """`serve`'s parsed parameters for these arguments, as the service will see them (with
    config.toml's defaults, and without the variables it does not inherit), checked as `serve`
    checks them before it starts (`serve.checked_settings`), or a usage error naming the problem."""
    from lorafleet.cli.main import app as root
    from lorafleet.cli.serve import checked_settings

    group = typer.main.get_command(root)
    assert isinstance(group, typer.core.TyperGroup)  # the root has subcommands
    command = group.commands["serve"]
    hidden = {k: os.environ.pop(k) for k in NOT_INHERITED if k in os.environ}
    try:
        ctx = command.make_context("serve", list(serve_args))
        checked_settings(ctx.params, paths.socket_path(ctx.params["socket"]))
        return ctx
    except LorafleetError as e:
        raise fail(f"`serve {shlex.join(serve_args)}`: {e}", 2) from None
    except Exception as e:  # click's usage errors (Typer's copy of them) carry format_message
        if not hasattr(e, "format_message"):
            raise
        raise fail(f"`serve {shlex.join(serve_args)}`: {e.format_message()}", 2) from None
    finally:
        os.environ.update(hidden)


def _why(e: OSError) -> str:
    """An OSError in words, naming the path at fault when it is another than the one tried."""
    where = f" ({e.filename})" if e.filename else ""
    return f"{e.strerror or e}{where}"


def _systemctl() -> str | None:
    return shutil.which("systemctl")


NO_USER_BUS = ("Failed to connect to bus", "Failed to connect to user scope bus", "DBUS_SESSION_BUS_ADDRESS")


def _run(systemctl: str, *args: str, no_bus_ok: bool = False) -> bool:
    """`systemctl --user ARGS`; False where `no_bus_ok` and there is no user systemd to talk to
    (a root shell, a container, ssh without lingering: nothing can run under it there)."""
    done = subprocess.run([systemctl, "--user", *args], capture_output=True, text=True)
    if done.returncode != 0:
        out = done.stderr.strip() or done.stdout.strip()
        if no_bus_ok and any(marker in out for marker in NO_USER_BUS):
            return False
        why = out.splitlines()
        raise fail(f"`systemctl --user {' '.join(args)}` failed ({why[-1] if why else f'status {done.returncode}'}); "
                   f"the unit is {unit_path()}")
    return True


@app.command("install", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def install(
    serve_args: Annotated[list[str] | None, typer.Argument(
        metavar="SERVE_ARGS", show_default=False,
        help="What `lorafleet serve` gets: MODEL and its options, e.g. `-- ~/models/llama --pool-bytes 8GiB`.")] = None,
    no_start: Annotated[bool, typer.Option(
        "--no-start", help="Only write the unit; print the systemctl commands that enable and start it.")] = False,
) -> None:
    """Write a systemd user unit that runs `lorafleet serve SERVE_ARGS`, restarted on failure,
    then enable and start it."""
    serve_args = list(serve_args or [])
    ctx = _serve_context(serve_args)
    source = {name: getattr(ctx.get_parameter_source(name), "name", "") for name in ctx.params}
    for name, why in (("detach", "a service runs serve in the foreground: leave out --detach"),
                      ("print_config", "--print-config does not start a daemon"),
                      ("api_key", ("a key in the unit's command line is shown by `ps` and `systemctl cat`: "
                                   f"set it as api-key in the [serve] table of {paths.config_file()}"))):
        if source[name] == "COMMANDLINE":
            raise fail(why, 2)
    sock = paths.socket_path(ctx.params["socket"])
    log_file = Path(os.path.abspath(ctx.params["log_file"] or paths.log_file(sock)))
    # the shell's PATH (compilers and ninja for the kernels' first build), this interpreter's bin first
    bindir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    env = {"PATH": path if bindir in path.split(os.pathsep) else f"{bindir}{os.pathsep}{path}"}
    env |= {k: v for k, v in os.environ.items() if k.startswith("LORAFLEET_") and k not in NOT_INHERITED}
    text = unit_text(serve_args, env, log_file, Path.cwd(), ctx.params["drain_timeout"])

    unit = unit_path()
    try:
        old = unit.read_text() if unit.is_file() else None
        unit.parent.mkdir(parents=True, exist_ok=True)
        unit.write_text(text)
    except OSError as e:  # XDG_CONFIG_HOME a file, a folder we may not write, ...
        raise fail(f"cannot write the unit {unit}: {_why(e)}; check XDG_CONFIG_HOME "
                   f"({os.environ.get('XDG_CONFIG_HOME') or 'unset: ~/.config'})") from None
    try:
        log_file.parent.mkdir(parents=True, exist_ok=True)  # systemd creates the file, not its folders
    except OSError as e:
        raise fail(f"cannot create the log's folder {log_file.parent}: {_why(e)}") from None
    err_console.print(f"{'replaced' if old is not None else 'wrote'} {unit}", highlight=False, soft_wrap=True)
    systemctl = _systemctl()
    steps = [("daemon-reload",), ("enable", "--now", UNIT)]
    if old is not None and old != text:
        steps.append(("restart", UNIT))  # enable --now leaves a running daemon on its old command line
    if no_start or systemctl is None:
        why = "" if no_start else "no systemctl here; "
        err_console.print(f"{why}to start it: " + "; ".join(f"systemctl --user {' '.join(s)}" for s in steps),
                          highlight=False, soft_wrap=True)
        return
    for step in steps:
        _run(systemctl, *step)

    err_console.print(f"started {UNIT}: `{paths.command_for(sock, 'status')}` once it answers, `{paths.command_for(sock, 'logs', '-f')}` "
                      "for its log; to keep it running after you log out: `loginctl enable-linger`",
                      highlight=False, soft_wrap=True)


@app.command("uninstall")
def uninstall() -> None:
    """Stop and disable the service (its in-flight requests drain first), and remove its unit."""
    unit = unit_path()
    if not unit.is_file():
        raise fail(f"no lorafleet service: {unit} does not exist")
    systemctl = _systemctl()
    bus = systemctl is not None and _run(systemctl, "disable", "--now", UNIT, no_bus_ok=True)
    unit.unlink()
    if bus:
        assert systemctl is not None  # reached it
        _run(systemctl, "daemon-reload")
    why = "" if bus else " (no systemctl here" if systemctl is None else " (no user systemd to reach here"
    err_console.print(f"removed {unit}" + (f"{why}: nothing ran under it)" if why else ""),
                      highlight=False, soft_wrap=True)


@app.command("status")
def status(as_json: JsonOption = False) -> None:
    """Show whether the unit is installed, what it runs, and systemd's view (enabled, active)."""
    unit = unit_path()
    if not unit.is_file():
        raise fail(f"no lorafleet service: {unit} does not exist; `lorafleet service install` writes it")
    exec_start = next((line.split("=", 1)[1] for line in unit.read_text().splitlines()
                       if line.startswith("ExecStart=")), "")
    info = {"unit": str(unit), "exec_start": exec_start, "enabled": None, "active": None}
    systemctl = _systemctl()
    if systemctl is not None:
        for key in ("enabled", "active"):
            done = subprocess.run([systemctl, "--user", f"is-{key}", UNIT], capture_output=True, text=True)
            info[key] = done.stdout.strip() or "unknown"
    if as_json:
        return print_json(info)
    for key, value in info.items():
        typer.echo(f"{key:<10} {value if value is not None else '- (no systemctl here)'}")
