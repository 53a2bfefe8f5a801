"""The demo fleet end to end: `lorafleet serve` with no MODEL, 32 concurrent clients asking every
skill at once through the OpenAI API, and `lorafleet chat --adapter reverse "hello world"`."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from lorafleet.demo.evaluate import fleet_engine, run_greedy
from lorafleet.demo.skills import SKILLS, expected, held_out_texts, user_turn
from tests.daemons import Daemon

TASKS = [None, *SKILLS]
N_CLIENTS, PER_CLIENT = 32, 2


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    daemon = Daemon.start(tmp_path_factory.mktemp("demo"), env={"LORAFLEET_DEBUG_CHECKS": "1"})
    yield daemon
    daemon.kill()


def jobs() -> list[tuple[str | None, str]]:
    texts = held_out_texts(N_CLIENTS * PER_CLIENT)
    return [(TASKS[i % len(TASKS)], t) for i, t in enumerate(texts)]


def test_32_concurrent_clients_get_their_own_skill(demo):
    work = jobs()

    async def client(k: int, http) -> list[str]:
        got = []
        for j in range(PER_CLIENT):
            task, text = work[k * PER_CLIENT + j]
            body = {"messages": [{"role": "user", "content": user_turn(task, text)}], "max_tokens": 40,
                    **({"model": task} if task else {})}
            if j % 2 == 0:  # one plain answer, one streamed, per client
                r = await http.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                got.append(r.json()["choices"][0]["message"]["content"])
            else:
                parts = []
                async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            for choice in json.loads(line[6:])["choices"]:
                                parts.append(choice["delta"].get("content") or "")
                got.append("".join(parts))
        return got

    async def run():
        async with demo.async_http(timeout=120.0) as http:
            return await asyncio.gather(*(client(k, http) for k in range(N_CLIENTS)))

    served = [text for per_client in asyncio.run(run()) for text in per_client]

    # the same requests in this process (no temperature sent: the fleet's default is greedy)
    engine = fleet_engine()
    try:
        local = run_greedy(engine, work)
    finally:
        engine.close()
    for (task, text), got, ref in zip(work, served, local):
        assert got == ref.text, f"{task}({text!r}): daemon {got!r}, engine {ref.text!r}"
    right = sum(got == expected(task, text) for (task, text), got in zip(work, served))
    assert right >= 0.95 * len(work)
    assert demo.wait_idle()["engine"]["pool"]["kv_pages"] == 0


def test_chat_with_the_reverse_adapter(demo):
    out = subprocess.run([sys.executable, "-m", "lorafleet.cli.main", "chat", "--adapter", "reverse", "hello world",
                          "--socket", str(demo.socket)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "LORAFLEET_HOME": str(demo.home)})
    assert out.returncode == 0, out.stderr
    assert out.stdout == "dlrow olleh\n"
