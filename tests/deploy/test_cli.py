"""`lorafleet deploy ray` from the command line: one command starts a local Ray cluster and the
demo fleet behind Serve; once it says it is up, a skill answers over HTTP; Ctrl-C stops it all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

if os.environ.get("LORAFLEET_REQUIRE_RAY") != "1":
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'lorafleet[ray]'")

from lorafleet.demo.skills import expected, user_turn  # noqa: E402
from tests.daemons import free_port  # noqa: E402

pytestmark = pytest.mark.heavy  # starts Ray


def test_deploy_ray_serves_the_demo_fleet_and_stops_on_ctrl_c(tmp_path):
    port = free_port()
    log = open(tmp_path / "deploy.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "lorafleet.cli.main", "deploy", "ray", "--replicas", "1",
                             "--port", str(port), "--pool-bytes", "64M", "--no-store"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "LORAFLEET_HOME": str(tmp_path / "home"), "RAY_ADDRESS": ""})
    try:
        deadline = time.monotonic() + 180
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            while "Ctrl-C stops it" not in (tmp_path / "deploy.log").read_text(errors="replace"):
                assert proc.poll() is None, (tmp_path / "deploy.log").read_text(errors="replace")[-3000:]
                assert time.monotonic() < deadline, "deploy ray did not say it was up within 180s"
                time.sleep(1)
            assert c.get("/v1/models").status_code == 200
            text = "hello world"
            r = c.post("/v1/chat/completions", json={"model": "upper", "max_tokens": 48, "temperature": 0,
                                                     "messages": [{"role": "user", "content": user_turn("upper", text)}]})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == expected("upper", text)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()
