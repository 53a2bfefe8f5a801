"""The store verbs from the command line: pull, adapters ls|show|rm, models ls|rm, store
check|gc, with no daemon and beside a running one."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from lorafleet.cli.main import app
from tests.fixtures import ALL7, build_adapter

runner = CliRunner()


def run(home, *args, socket=None):
    env = {"LORAFLEET_HOME": str(home), "LORAFLEET_SOCKET": str(socket or home / "nobody.sock"), "COLUMNS": "200"}
    return runner.invoke(app, list(args), env=env, catch_exceptions=False)


@pytest.fixture
def home(tmp_path, llama_dir):
    assert run(tmp_path / "home", "pull", str(llama_dir), "--base", "--name", "base").exit_code == 0
    return tmp_path / "home"


@pytest.fixture(scope="module")
def adapter(llama_dir, tmp_path_factory):
    return build_adapter(llama_dir, tmp_path_factory.mktemp("cli-adapter") / "a", r=4, target_modules=ALL7)


def test_pull_ls_show_check_rm_without_a_daemon(home, adapter):
    out = run(home, "pull", str(adapter), "--name", "a", "--json")
    assert out.exit_code == 0, out.output
    manifest = json.loads(out.stdout)
    assert manifest["name"] == "a" and manifest["base"]["name"] == "base"
    listed = run(home, "adapters", "ls", "--json")
    assert listed.exit_code == 0
    [row] = json.loads(listed.stdout)
    assert (row["name"], row["in_store"], row["loaded"]) == ("a", True, False)
    table = run(home, "adapters", "ls")
    assert "a" in table.stdout and "no lorafleet daemon" in table.stderr
    shown = json.loads(run(home, "adapters", "show", "a", "--json").stdout)
    assert shown["digest"] == manifest["digest"] and shown["loaded"] is False
    assert [m["name"] for m in json.loads(run(home, "models", "ls", "--json").stdout)] == ["base"]
    assert run(home, "store", "check", "--deep").exit_code == 0
    refused = run(home, "models", "rm", "base")
    assert refused.exit_code == 1 and "remove them first" in refused.stderr
    assert run(home, "adapters", "rm", "a").exit_code == 0
    assert json.loads(run(home, "adapters", "ls", "--json").stdout) == []
    assert run(home, "models", "rm", "base").exit_code == 0
    assert json.loads(run(home, "store", "gc", "--json").stdout)["blobs"] == 0  # rm already collected


@pytest.mark.parametrize("args, message", [
    (["--name", "../x"], "invalid name"),
    (["--name", "a/b"], "invalid name"),
    (["--for", "nope"], "no model named 'nope'"),
])
def test_refused_pulls_exit_1_with_the_reason_and_store_nothing(home, adapter, args, message):
    out = run(home, "pull", str(adapter), *args)
    assert out.exit_code == 1 and message in out.stderr and "Traceback" not in out.output
    assert json.loads(run(home, "adapters", "ls", "--json").stdout) == []


def test_a_source_that_is_neither_a_folder_nor_a_repo_id(home):
    out = run(home, "pull", "no/such/thing")
    assert out.exit_code == 1 and "neither a folder nor" in out.stderr


def test_check_reports_a_damaged_file_and_exits_1(home, adapter):
    manifest = json.loads(run(home, "pull", str(adapter), "--name", "a", "--json").stdout)
    blob = home / "store" / "blobs" / "sha256" / manifest["files"]["adapter_model.safetensors"]["sha256"]
    os.chmod(blob, 0o644)
    blob.write_bytes(blob.read_bytes()[:-1] + b"\0")
    out = run(home, "store", "check", "--deep")
    assert out.exit_code == 1 and "sha256" in out.stderr


def test_beside_a_daemon_ls_shows_both_and_rm_waits_for_unload(served, chat_model_dir, adapter_dirs):
    home, sock = served.home, served.socket
    assert run(home, "pull", str(chat_model_dir), "--base", "--name", "chat-base", socket=sock).exit_code == 0
    assert run(home, "pull", str(adapter_dirs["attn-r3"]), "--name", "held", "--for", "chat-base",
               socket=sock).exit_code == 0
    with served.http() as c:  # the daemon resolves it from its store on this first request
        r = c.post("/v1/completions", json={"model": "held", "prompt": [5, 6, 7], "max_tokens": 2})
    assert r.status_code == 200, r.text
    rows = {row["name"]: row for row in json.loads(run(home, "adapters", "ls", "--json", socket=sock).stdout)}
    assert rows["held"]["in_store"] and rows["held"]["loaded"]
    refused = run(home, "adapters", "rm", "held", socket=sock)
    assert refused.exit_code == 1 and "unload it first" in refused.stderr and "--force" in refused.stderr
    forced = run(home, "adapters", "rm", "held", "--force", socket=sock)  # unloads it, then removes it
    assert forced.exit_code == 0 and "unloaded held" in forced.stderr, forced.output
    with served.http() as c:
        assert "held" not in {m["id"] for m in c.get("/v1/models").json()["data"]}
    assert "held" not in {row["name"] for row in json.loads(run(home, "adapters", "ls", "--json", socket=sock).stdout)}
    # the session's daemon is shared: its store is left as found (`models ls` tests read it whole)
    removed = run(home, "models", "rm", "chat-base", socket=sock)
    assert removed.exit_code == 0, removed.output


def test_pull_with_an_empty_store_validates_against_the_base_the_daemon_serves(tmp_path, served, adapter_dirs,
                                                                                 chat_model_dir):
    """No base in the store, a daemon serving one from a folder: the adapter is validated against
    that folder, which its manifest records (tests/store/test_resolver.py: the daemon serves it)."""
    home = tmp_path / "home"
    refused = run(home, "pull", str(adapter_dirs["attn-r3"]), "--name", "mine")  # no daemon on LORAFLEET_SOCKET
    assert refused.exit_code != 0 and "no daemon serves one" in refused.output
    out = run(home, "pull", str(adapter_dirs["attn-r3"]), "--name", "mine", "--json", socket=served.socket)
    assert out.exit_code == 0, out.output
    manifest = json.loads(out.stdout)
    assert manifest["base"] == {"name": "base", "snapshot": None, "folder": str(chat_model_dir.resolve())}
