"""`lorafleet adapters show NAME` for people: values as they read, never Python's reprs."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from lorafleet.cli.adapters import show_rows
from lorafleet.cli.main import app

runner = CliRunner()
REPRS = re.compile(r"\bNone\b|\bTrue\b|\bFalse\b|[{}\[\]]|'")


def test_show_prints_human_values_from_a_real_daemon(served, adapter_dirs):
    env = {"LORAFLEET_SOCKET": str(served.socket), "LORAFLEET_HOME": str(served.home), "COLUMNS": "200"}
    loaded = runner.invoke(app, ["adapters", "load", "shown", str(adapter_dirs["all-r8"])], env=env)
    assert loaded.exit_code == 0, loaded.output
    try:
        shown = runner.invoke(app, ["adapters", "show", "shown"], env=env)
    finally:
        runner.invoke(app, ["adapters", "unload", "shown"], env=env)
    assert shown.exit_code == 0, shown.output
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) if "  " in line.strip() else (line.strip(), "")
                for line in shown.stdout.splitlines())
    assert rows["error"] == "-" and rows["pinned"] == "no" and rows["store"] == "-"
    assert rows["modules"].startswith("down_proj, gate_proj") and "q_proj=8" in rows["ranks"]
    assert re.fullmatch(r"\d+(\.\d)? (ms|s)", rows["load_time_s"]), rows["load_time_s"]
    assert not REPRS.search(shown.stdout), shown.stdout


def test_a_store_record_reads_as_lines_under_store():
    info = {"name": "sql", "loaded": False, "error": None, "ranks": {"q_proj": 16, "v_proj": 16}, "modules": [],
            "store": {"digest": "ab12", "base": {"name": "smol", "snapshot": "ff00"}, "size": 3 * 2**20,
                      "files": {"adapter_model.safetensors": {"sha256": "00", "size": 1}}, "load_s": 0.0042}}
    assert show_rows(info) == [
        ("name", "sql"), ("loaded", "no"), ("error", "-"), ("ranks", "q_proj=16, v_proj=16"), ("modules", "-"),
        ("store", ""), ("  digest", "ab12"), ("  base", "smol"), ("  size", "3.0 MiB"), ("  files", "1 file"),
        ("  load_s", "4.2 ms")]
