"""`serve`'s command class: its defaults from `$LORAFLEET_HOME/config.toml`, vLLM's spelling of
`--lora-modules`, and `serve --print-config`.

The file's `[serve]` table becomes the command's `default_map`, so the order of precedence is
click's: the command line, then an option's environment variable, then the file, then the
built-in default. Keys are `serve`'s long option names without the dashes, or their parameter
names (`pool-bytes` or `pool_bytes`; `adapter` or `lora-modules`), plus `model`. Nothing here
imports torch.
"""

from __future__ import annotations

import json
import re
import shutil
import typing
from pathlib import Path

import typer
from typer.core import TyperArgument, TyperCommand, TyperOption

from lorafleet.cli.common import fail

NARROW_HELP = 120  # columns under which `serve --help` is laid out plainly (its names are long, its options many)

# a switch of the command line, not a setting a file could hold
NOT_IN_FILE = {"detach", "print_config"}


class ServeCommand(TyperCommand):
    """`serve`, whose defaults come from the config file and whose `--lora-modules` takes several
    values after one flag, as vLLM's does."""

    def make_context(self, info_name, args, parent=None, **extra):
        if "default_map" not in extra:
            from lorafleet import paths

            extra["default_map"] = file_defaults(self, paths.config_file()) or None
        return super().make_context(info_name, args, parent, **extra)

    def parse_args(self, ctx, args):
        return super().parse_args(ctx, expand_lora_modules(args))

    def format_help(self, ctx, formatter):
        """Under `NARROW_HELP` columns, click's plain layout (each option name whole, its help
        wrapped beside or below it): rich's four columns leave `serve`'s help a few characters a
        line there and cut its long option names."""
        if shutil.get_terminal_size().columns >= NARROW_HELP:
            return super().format_help(ctx, formatter)
        mode, self.rich_markup_mode = self.rich_markup_mode, None
        try:
            return super().format_help(ctx, formatter)
        finally:
            self.rich_markup_mode = mode


def expand_lora_modules(args: list[str]) -> list[str]:
    """vLLM's `--lora-modules a=/p b=/q` (argparse's nargs='+') as click's repeated option:
    after `--lora-modules VALUE`, each following token that reads as an adapter (NAME=PATH or a
    JSON object) and not as an option gets a flag of its own. A token without '=' (MODEL) ends
    the run, as does `--`."""
    out, i = [], 0
    while i < len(args):
        token = args[i]
        out.append(token)
        i += 1
        if token == "--":
            return out + args[i:]
        if token == "--lora-modules" and i < len(args):
            out.append(args[i])  # its first value, whatever it reads as
            i += 1
            while i < len(args) and not args[i].startswith("-") and ("=" in args[i] or args[i].lstrip().startswith("{")):
                out += ["--lora-modules", args[i]]
                i += 1
    return out


def _keys(command) -> dict[str, TyperOption | TyperArgument]:
    """Every key the file may use -> its parameter."""
    keys = {}
    for param in command.params:
        if param.name in NOT_IN_FILE:
            continue
        names = {param.name} | {o.lstrip("-") for o in param.opts if o.startswith("--")}
        for name in names:
            keys[name] = keys[name.replace("-", "_")] = keys[name.replace("_", "-")] = param
    return keys


def file_defaults(command, path: Path) -> dict:
    """The `[serve]` table of `path` as `serve`'s default_map (parameter name -> value), checked:
    an unknown key, or a value of the wrong type or out of range, ends the command with one line
    naming the key and the file, and exit code 2 (a usage error, as a bad flag is)."""
    from lorafleet.config import read_config_file
    from lorafleet.errors import ConfigError

    try:
        table = read_config_file(path).get("serve", {})
    except ConfigError as e:
        raise fail(str(e), 2) from None
    from lorafleet.cli import serve

    hints = typing.get_type_hints(serve.serve)
    given: dict[str | None, str]
    keys, out, given = _keys(command), {}, {}
    ctx = typer.Context(command, info_name="serve")
    for key, value in table.items():
        param = keys.get(key)
        if param is None:
            raise fail(f"{path}: [serve] has unknown key {key!r}; the keys are serve's options "
                       f"(`lorafleet serve --help`), e.g. pool-bytes, max-num-seqs, socket, adapter", 2)
        if param.name in given:
            raise fail(f"{path}: [serve] sets {param.name!r} twice (as {given[param.name]!r} and {key!r})", 2)
        given[param.name] = key
        try:
            value = _typed(param, hints[param.name], value)
            param.process_value(ctx, value)  # ranges (--max-num-seqs >= 1, ...) as on the command line
            _check_alone(param.name, value, key)
        except (TypeError, typer.BadParameter, ConfigError) as e:
            raise fail(f"{path}: [serve] {key}: {getattr(e, 'message', None) or e}", 2) from None
        out[param.name] = value
    return out


def _check_alone(name: str, value, key: str) -> None:
    """The checks `serve` makes of this one value once the command is parsed (sizes, adapters, the
    engine's and the server's settings), made here so that their error names the file and the key.
    What holds between values (--host with --port) is checked with the command line's."""
    from lorafleet.cli.serve import parse_adapters, parse_size
    from lorafleet.config import EngineConfig, ServerConfig

    if name in ("pool_bytes", "max_body_bytes"):
        value = parse_size(value, key)
    if name == "adapter":
        parse_adapters(value)
    elif name in EngineConfig.__dataclass_fields__:
        EngineConfig(**{name: value})
    elif name == "port":
        ServerConfig(socket="-", host="localhost", port=value, api_key="-")
    elif name in ServerConfig.__dataclass_fields__ and name not in ("socket", "host", "api_key"):
        ServerConfig(socket="-", **{name: value})


def _typed(param, hint, value):
    """`value` (from TOML) for `param`, whose Python type is `hint`, or TypeError saying what it
    should be; sizes may be a number of bytes, lists a single item, adapters an inline table (as
    vLLM's JSON form)."""
    kind = next((a for a in typing.get_args(hint) if a is not type(None)), hint)  # X | None -> X
    if param.multiple:
        values = value if isinstance(value, list) else [value]
        out = []
        for v in values:
            if isinstance(v, dict) and param.name == "adapter":  # {name = "sql", path = "/p"}
                v = json.dumps(v)
            if not isinstance(v, str):
                raise TypeError(f"expected a string or a list of strings, got {type(v).__name__} {v!r}")
            out.append(v)
        return out
    if kind is bool:
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {value!r}")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"expected an integer, got {value!r}")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"expected a number, got {value!r}")
    elif param.metavar == "SIZE" and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # a number of bytes
    elif not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _key(param) -> str:
    return max((o.lstrip("-") for o in param.opts if o.startswith("--")), key=len, default=param.name) \
        if param.name != "adapter" else "adapter"


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)  # a TOML basic string: JSON's escapes are TOML's


def print_config(ctx: typer.Context, socket: Path, log_file: Path) -> None:
    """The effective settings as a `[serve]` table, each with where it came from (command line,
    environment, the config file, default). Unset ones are comments; the API key is never shown."""
    from lorafleet import paths

    path = paths.config_file()
    lines = [f"# lorafleet serve: the effective settings; defaults from {path}"
             + ("" if path.is_file() else " (none there)"), "[serve]"]
    for param in ctx.command.params:
        if param.name in NOT_IN_FILE:
            continue
        source = getattr(ctx.get_parameter_source(param.name), "name", "DEFAULT")
        where = {"COMMANDLINE": "command line", "ENVIRONMENT": f"environment ({param.envvar})",
                 "DEFAULT_MAP": str(path)}.get(source, "default")
        value = ctx.params[param.name]
        if param.name == "socket" and value is None:
            value, where = socket, "default"
        elif param.name == "model" and value is None:
            where = "default: the bundled demo fleet"
        elif param.name == "log_file" and value is None:
            value, where = log_file, "default, with --detach or as a service"
        key = _key(param)
        if param.name == "api_key":
            lines.append(f"# {key}: {'set, not shown' if value else 'not set'}  ({where})")
        elif value is None or value == () or value == []:
            default = re.search(r"Default: ([^.]*(?:\.\d[^.]*)*)", getattr(param, "help", None) or "")  # what serve then uses
            lines.append(f"# {key}: not set  ({where}{': ' + default.group(1) if default and where == 'default' else ''})")
        else:
            lines.append(f"{key} = {_toml(value)}  # {where}")
    typer.echo("\n".join(lines))
