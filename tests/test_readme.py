"""README.md is a short user's guide, and the docs' links lead somewhere.

The README keeps two set-up commands byte for byte (the test one is what CI runs), refers to no
commit or run, names only real verbs in its table, and every relative link in it and in docs/
points at a file (and a heading) that exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from lorafleet.cli.main import app

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_LINES = 250
VENV = "python3 -m venv .venv && . .venv/bin/activate && "

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
VERB_ROW = re.compile(r"^\| `lorafleet ([^`]+)`", re.MULTILINE)
WORD = re.compile(r"[a-z][a-z0-9-]*")


def readme() -> str:
    return README.read_text(encoding="utf-8")


def fenced(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced code block."""
    return [(m.group(1).strip(), m.group(2)) for m in FENCE.finditer(text)]


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation but `-` and `_`
    removed, spaces to dashes."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", path.read_text(encoding="utf-8")),
                         re.MULTILINE):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def setup_commands() -> list[str]:
    return [body.strip() for info, body in fenced(readme())
            if info == "sh" and body.lstrip().startswith("python3 -m venv")]


def test_the_readme_is_at_most_250_lines():
    n = len(readme().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; the guide keeps to {MAX_LINES}, the rest goes to docs/"


def test_the_readme_holds_exactly_two_set_up_commands_serve_and_test():
    commands = setup_commands()
    assert len(commands) == 2, commands
    assert all("\n" not in c for c in commands), "each set-up command is one line"
    serve, test = commands
    assert serve.startswith(VENV) and serve.endswith("&& lorafleet serve"), serve
    assert "pytest" in test and "-m \"heavy or not heavy\"" in test, test


def test_the_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    last = [line for line in ci if line.strip()][-1]
    assert "python3 -m venv .venv" in ci and ". .venv/bin/activate" in ci, "CI sets the venv up as README does"
    assert setup_commands()[1] == VENV + last


def test_the_readme_names_no_commit_and_no_run_date():
    text = readme()
    assert not COMMIT.findall(text), f"commit ids in README.md: {COMMIT.findall(text)}"
    assert not DATE.findall(text), f"dates of runs in README.md: {DATE.findall(text)}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_at_a_file_and_heading_that_exist(page: Path):
    broken = []
    for _, target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def verb_paths() -> list[list[str]]:
    """The command paths the verb table of README's Commands names: `lorafleet adapters ls|show` gives
    [adapters, ls] and [adapters, show]; words past the verbs (MODEL, [-f], --adapter) end it."""
    section = re.search(r"^## Commands\n(.*?)(?=^## |\Z)", readme(), re.MULTILINE | re.DOTALL)
    rows = VERB_ROW.findall(section.group(1)) if section else []
    assert rows, "README.md's Commands section has a table of verbs, one row each: | `lorafleet VERB ...` | ... |"
    paths = []
    for row in rows:
        words, path = row.replace("\\|", "|").split(), []
        for word in words:
            alternatives = word.split("|")
            if not all(WORD.fullmatch(a) for a in alternatives):
                break
            if len(alternatives) > 1:
                paths += [[*path, a] for a in alternatives]
                path = None
                break
            path.append(word)
        if path:
            paths.append(path)
    return paths


def test_every_verb_in_the_readme_table_is_a_real_command():
    runner = CliRunner()
    missing = []
    for path in verb_paths():
        result = runner.invoke(app, [*path, "--help"])
        if result.exit_code != 0:
            missing.append(" ".join(path))
    assert not missing, f"README's verb table names commands lorafleet lacks: {missing}"


def test_the_readme_table_lists_every_top_level_verb():
    """Every verb lorafleet documents (Ollama's hidden ones are named in lorafleet(1))."""
    named = {path[0] for path in verb_paths()}
    assert {n for n, c in typer.main.get_command(app).commands.items() if not c.hidden} <= named


def test_a_cpu_install_does_not_pull_triton():
    """Issue 64 (12): triton was a hard dependency, a gigabyte of a CPU-only venv; a CUDA torch
    brings its own, the `gpu` extra names it, and the tests (its interpreter) install it."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("triton")]
    assert any(d.startswith("triton") for d in project["optional-dependencies"]["test"])
    assert any(d.startswith("triton") for d in project["optional-dependencies"]["gpu"])
