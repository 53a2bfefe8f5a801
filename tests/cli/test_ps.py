"""`lorafleet ps`: what the daemon holds where, against a real daemon (an adapter a chat went
through is on the device tier with its rank), on a made-up snapshot (tiers, queues, order), and
against a foreign server whose /v1/stats has another shape (one line, no traceback)."""

from __future__ import annotations

import copy
import json

import pytest
from typer.testing import CliRunner

from lorafleet.cli import ps as ps_cli
from lorafleet.cli.main import app
from lorafleet.client import Client
from tests.cli.test_odd_daemons import OddServer, http

runner = CliRunner()


def ps(served, *args, socket=None):
    env = {"LORAFLEET_SOCKET": str(socket or served.socket), "LORAFLEET_HOME": str(served.home), "COLUMNS": "200"}
    return runner.invoke(app, ["ps", *args], env=env, catch_exceptions=False)


def test_an_adapter_used_by_a_chat_shows_on_the_device_tier_with_its_rank(served):
    with Client(served.socket) as c:
        c.chat([{"role": "user", "content": "hello"}], "all-r8", max_tokens=2, temperature=0)
    out = ps(served, "--json")
    assert out.exit_code == 0, out.output
    view = json.loads(out.stdout)
    assert view["model"]["name"] == "base" and view["model"]["pid"] == served.proc.pid
    row = next(r for r in view["adapters"] if r["name"] == "all-r8")
    assert row["tier"] == "device" and row["rank"] == 8 and row["pages"] > 0
    assert row["bytes"] == row["pages"] * view["model"]["pool"]["page_bytes"]
    assert row["idle_s"] is not None and row["idle_s"] >= 0  # a request ran on it: it has a last use

    text = ps(served)
    assert text.exit_code == 0 and "base" in text.stdout.splitlines()[0]
    line = next(line for line in text.stdout.splitlines() if line.split()[:1] == ["all-r8"])
    assert line.split()[1:3] == ["device", "8"] and "ago" in line
    assert "LAST USED" in text.stdout


@pytest.mark.parametrize("args", [["ps"], ["ps", "--json"]])
def test_no_daemon_is_the_same_line_and_exit_code_as_status(served, tmp_path, args):
    nobody = tmp_path / "nobody.sock"
    out = ps(served, *args[1:], socket=nobody)
    status = runner.invoke(app, ["status", *args[1:]], env={"LORAFLEET_SOCKET": str(nobody)}, catch_exceptions=False)
    assert out.exit_code == status.exit_code == 3
    assert out.stderr == status.stderr and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.output


def adapter(tier: str, pages: int = 0, users: int = 0, idle_s=None, ranks=None) -> dict:
    return {"tier": tier, "ranks": ranks or {"q_proj": 4}, "pages": pages, "users": users, "idle_s": idle_s,
            "error": None}


STATS = {
    "server": {"model": "m", "model_path": "/m", "pid": 7},
    "engine": {
        "device": "cpu", "num_adapters": 6,
        "pool": {"total_pages": 100, "page_bytes": 1024, "kv_pages": 10, "cached_pages": 0, "adapter_pages": 5,
                 "free_pages": 85},
        "lora": {"running": {"dev-busy": 2}, "waiting": {"cold": 1}},
        "adapter_details": {
            "on-host": adapter("host", idle_s=30.0),
            "dev-busy": adapter("device", pages=3, users=2, idle_s=0.0, ranks={"q_proj": 8, "v_proj": 16}),
            "dev-idle": adapter("device", pages=2, idle_s=5.0),
            "cold": adapter("disk"),               # a request waits for its load: in use
            "evicted": adapter("disk", idle_s=99),  # on disk, nothing asks: left out
        },
        "untouched_adapters": ["never"],
    },
}


def test_rows_are_the_resident_and_the_wanted_device_first():
    view = ps_cli.snapshot(STATS)
    assert [(r["name"], r["tier"]) for r in view["adapters"]] == [
        ("dev-busy", "device"), ("dev-idle", "device"), ("on-host", "host"), ("cold", "disk")]
    busy, idle, host, cold = view["adapters"]
    assert (busy["running"], busy["rank"], busy["bytes"], ps_cli.last_used(busy)) == (2, 16, 3 * 1024, "now")
    assert ps_cli.last_used(idle) == "5s ago" and ps_cli.last_used(host) == "30s ago"
    assert (cold["waiting"], ps_cli.last_used(cold)) == (1, "-")
    assert view["other_adapters"] == 2  # "evicted" and "never"


def foreign_stats(**engine) -> dict:
    """STATS with a daemon's top-level parts (the client checks those), and an engine part of
    another shape: `engine` replaces some of its values, or of its adapters' (`adapter=`)."""
    stats = copy.deepcopy(STATS)
    stats["version"] = "9.9"
    for key, value in engine.pop("adapter", {}).items():
        stats["engine"]["adapter_details"]["dev-idle"][key] = value
    stats["engine"].update(engine)
    return stats


WRONG_SHAPES = {
    "idle_s a string": foreign_stats(adapter={"idle_s": "yesterday"}),
    "pages a string": foreign_stats(adapter={"pages": "ab"}),
    "ranks a list": foreign_stats(adapter={"ranks": [8]}),
    "details a list": foreign_stats(adapter_details=["dev-idle"]),
    "a huge count": foreign_stats(num_adapters=10 ** 400),
    "pool missing": foreign_stats(pool=None),
}


@pytest.mark.parametrize("args", [[], ["--json"]])
@pytest.mark.parametrize("shape", list(WRONG_SHAPES))
def test_a_foreign_stats_of_the_wrong_shape_is_one_line_as_status_says(tmp_path, shape, args):
    sock = tmp_path / "foreign.sock"
    server = OddServer(sock, http(200, "application/json", json.dumps(WRONG_SHAPES[shape]).encode()))
    try:
        out = runner.invoke(app, ["ps", "--socket", str(sock), *args], catch_exceptions=False)
    finally:
        server.close()
    assert out.exit_code == 3, out.output  # what status answers for what is not a daemon
    assert len(out.stderr.strip().splitlines()) == 1 and "is not a lorafleet daemon" in out.stderr
    assert "Traceback" not in out.output and out.stdout == ""
