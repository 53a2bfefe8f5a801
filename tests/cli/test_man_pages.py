"""The man pages cover the CLI: every command has its page and is listed in lorafleet(1); every
option, argument, subcommand and environment variable of a command appears in its page. Walks
the Typer app's click tree, so a new option without documentation fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from lorafleet.cli.main import app

MAN = Path(__file__).resolve().parents[2] / "man"
ROOT = typer.main.get_command(app)


def plain(page: Path) -> str:
    """The page's text without roff's font switches and escapes (`\\-\\-pool\\-bytes` -> `--pool-bytes`)."""
    text = page.read_text()
    text = re.sub(r"\\f[BIRP]", "", text)
    return text.replace("\\-", "-").replace("\\(em", "-")


def commands():
    """The documented verbs; Ollama's, hidden, are named in lorafleet(1) and lorafleet-chat(1)."""
    return sorted((n, c) for n, c in ROOT.commands.items() if not c.hidden)


def documented_names(params, subcommands=None) -> list[str]:
    """What a page must mention: long and short option names, env vars, arguments, subcommands.
    (Duck-typed: Typer builds on its own copy of click's classes.)"""
    names = []
    for p in params:
        if p.param_type_name == "option":
            names += [o for o in p.opts + p.secondary_opts if o != "--help"]
            if p.envvar:
                names += [p.envvar] if isinstance(p.envvar, str) else list(p.envvar)
        elif p.param_type_name == "argument":
            names.append(p.name.upper())
    for name, sub in (subcommands or {}).items():
        names.append(name)
        names += documented_names(sub.params, getattr(sub, "commands", None))
    return names


def mentions(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


@pytest.mark.unit
@pytest.mark.parametrize("name,command", commands(), ids=[n for n, _ in commands()])
def test_every_command_has_a_page_naming_all_its_options(name, command):
    page = MAN / f"lorafleet-{name}.1"
    assert page.is_file(), f"man/{page.name} is missing"
    text = plain(page)
    assert f"lorafleet-{name}" in text.splitlines()[0].lower() or f".TH LORAFLEET-{name.upper()} 1" in text
    names = documented_names(command.params, getattr(command, "commands", None))
    assert names
    missing = [n for n in names if not mentions(text, n)]
    assert not missing, f"man/{page.name} does not mention: {', '.join(missing)}"


@pytest.mark.unit
def test_lorafleet_1_lists_every_command_and_root_option():
    text = plain(MAN / "lorafleet.1")
    commands_section = text.split(".SH COMMANDS", 1)[1].split(".SH ", 1)[0]
    listed = set(re.findall(r"^\.B (\S+)$", commands_section, flags=re.M))
    shown = {n for n, c in ROOT.commands.items() if not c.hidden}  # Ollama's verbs: one entry of their own
    assert listed == shown, f"COMMANDS lists {sorted(listed)}, the CLI has {sorted(shown)}"
    assert all(mentions(commands_section, n) for n in set(ROOT.commands) - shown)
    missing = [n for n in documented_names(ROOT.params) if not mentions(text, n)]
    assert not missing, f"man/lorafleet.1 does not mention: {', '.join(missing)}"


@pytest.mark.unit
def test_no_page_documents_a_command_that_does_not_exist():
    pages = {p.name for p in MAN.glob("lorafleet-*.1")}
    assert pages == {f"lorafleet-{name}.1" for name, command in ROOT.commands.items() if not command.hidden}


ROOT_DIR = MAN.parent


@pytest.mark.unit
def test_every_page_installs_with_the_package():
    """pyproject's data-files put each page of man/ into <prefix>/share/man/man1, where `man` finds
    it from an activated environment: a page missing from the list would not be installed."""
    import tomllib

    data_files = tomllib.loads((ROOT_DIR / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    assert sorted(data_files["share/man/man1"]) == sorted(f"man/{p.name}" for p in MAN.glob("*.1"))


@pytest.mark.heavy  # builds a wheel
def test_the_wheel_carries_every_page(tmp_path):
    import subprocess
    import sys
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT_DIR), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path)], check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("lorafleet-*.whl")
    data = {n.split(".data/data/", 1)[1] for n in zipfile.ZipFile(wheel).namelist() if ".data/data/" in n}
    assert "share/man/man1/lorafleet.1" in data
    assert {f"share/man/man1/{p.name}" for p in MAN.glob("*.1")} <= data
