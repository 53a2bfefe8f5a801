"""A quantized base from the command line (issue 51): `lorafleet pull --base --quantize int8`
stores the demo base quantized (the store lists its scheme), its adapters pull against it, the
daemon serves it by name (`status` says int8), and `lorafleet chat --adapter` answers the skill."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lorafleet.demo import BASE_DIR, FLEET_DIR
from tests.daemons import Daemon


def lorafleet(home, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "lorafleet.cli.main", *args], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "LORAFLEET_HOME": str(home), "COLUMNS": "200"})
    assert not check or out.returncode == 0, out.stderr
    return out


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized-cli")
    home = root / "home"
    manifest = json.loads(lorafleet(home, "pull", str(BASE_DIR), "--base", "--name", "demo-q8", "--quantize", "int8",
                                    "--json").stdout)
    assert manifest["quantization"] == "int8"
    lorafleet(home, "pull", str(FLEET_DIR / "upper"), "--name", "upper", "--for", "demo-q8")
    d = Daemon.start(root, model="demo-q8")
    yield d
    d.kill()


def test_the_store_lists_the_scheme(daemon):
    listed = json.loads(lorafleet(daemon.home, "models", "ls", "--json", "--socket", str(daemon.socket)).stdout)
    assert [(m["name"], m["quantization"], m["served"]) for m in listed] == [("demo-q8", "int8", True)]
    table = lorafleet(daemon.home, "models", "ls", "--socket", str(daemon.socket)).stdout
    assert "WEIGHTS" in table and "int8" in table


def test_status_says_the_base_is_int8(daemon):
    stats = daemon.stats()["engine"]
    assert (stats["quantization"], stats["dtype"]) == ("int8", "float32")
    out = lorafleet(daemon.home, "status", "--socket", str(daemon.socket)).stdout
    assert "int8 weights, float32 compute" in out


def test_chat_answers_the_skill_on_the_quantized_base(daemon):
    out = lorafleet(daemon.home, "chat", "--adapter", "upper", "hello world", "--socket", str(daemon.socket))
    assert out.stdout == "HELLO WORLD\n"
