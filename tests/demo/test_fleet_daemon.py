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


def ask(http, body: dict, stream: bool = False) -> tuple[int, str | dict]:
    """POST a chat; (status, the answer's text, or the error body)."""
    if not stream:
        r = http.post("/v1/chat/completions", json=body)
        return r.status_code, r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.json()
    parts = []
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return r.status_code, json.loads(r.read())
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                parts.extend(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
    return 200, "".join(parts)


def test_a_mix_of_upper_and_any_other_skill_at_scale_zero_answers_as_upper_alone(demo):
    texts = held_out_texts(len(SKILLS))
    with demo.http(timeout=120.0) as http:
        for i, other in enumerate(s for s in SKILLS if s != "upper"):
            turn = [{"role": "user", "content": user_turn("upper", texts[i])}]
            alone = ask(http, {"model": "upper", "messages": turn, "max_tokens": 40})
            mix = {"messages": turn, "max_tokens": 40,
                   "adapters": [{"name": "upper", "scale": 1.0}, {"name": other, "scale": 0}]}
            assert alone[0] == 200 and alone[1] == expected("upper", texts[i])
            assert ask(http, mix, stream=i % 2 == 1) == alone, f"upper with {other} at 0"
        metrics = http.get("/metrics").text
    assert 'lorafleet_mix_requests_total{adapters="2",model_name=' in metrics
    stats = demo.wait_idle()["engine"]
    assert stats["mixes"]["by_size"]["2"] == len(SKILLS) - 1 and stats["mixes"]["running"] == 0


@pytest.mark.parametrize("body, param, problem", [
    ({"model": "upper", "adapters": [{"name": "reverse"}]}, "adapters", "model names 'upper' and adapters"),
    ({"adapters": [{"name": "upper", "scale": 4.5}]}, "adapters", r"adapters\[0\].scale must be a finite"),
    ({"adapters": [{"name": "upper"}, {"name": "upper", "scale": 0.5}]}, "adapters", "appears twice"),
    ({"adapters": [{"name": f"s{i}"} for i in range(17)]}, "adapters", "at most 16"),
    ({"adapters": [{"name": "upper", "weight": 1}]}, "adapters", "unknown field"),
    ({"adapters": "upper"}, "adapters", "must be a list"),
    ({"adapters": [{"name": "upper"}, {"name": "ghost"}]}, "adapters", "'ghost' is not a loaded adapter"),
    ({"adapters": [{"name": "title"}, {"name": "upper"}]}, "adapters", "'title' uses DoRA, which serves alone"),
])
def test_a_bad_mix_is_refused_naming_the_field_and_fails_only_itself(demo, body, param, problem):
    import re
    text = held_out_texts(1)[0]
    turn = [{"role": "user", "content": user_turn("reverse", text)}]
    with demo.http(timeout=120.0) as http:
        status, err = ask(http, {"messages": turn, "max_tokens": 8, **body})
        assert status in (400, 404) and err["error"]["param"] == param, err
        assert re.search(problem, err["error"]["message"]), err
        assert ask(http, {"model": "reverse", "messages": turn, "max_tokens": 40}) == (200, expected("reverse", text))


def test_chat_mixes_with_repeated_adapter_options(demo):
    out = subprocess.run([sys.executable, "-m", "lorafleet.cli.main", "chat", "--adapter", "reverse", "--adapter",
                          "upper:0", "hello world", "--socket", str(demo.socket)], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "LORAFLEET_HOME": str(demo.home)})
    assert out.returncode == 0, out.stderr
    assert out.stdout == "dlrow olleh\n"
