"""lorafleet on Ray Serve (`lorafleet/deploy/ray.py`), on a local Ray cluster: two replicas of
the demo fleet behind the multiplexing router. Ray is optional: without it these tests skip,
unless LORAFLEET_REQUIRE_RAY=1 (CI sets it), which makes its absence a failure.

The demo fleet's adapters and its base are the models the requests spread over. Its skills make a request served with the wrong adapter visible: every answer must equal
the same request served by one engine alone (the daemon's own routes, in-process)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

if os.environ.get("LORAFLEET_REQUIRE_RAY") != "1":
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'lorafleet[ray]'")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from lorafleet.demo import default_fleet  # noqa: E402
from lorafleet.demo.skills import SKILLS, held_out_texts, user_turn  # noqa: E402
from tests.daemons import free_port  # noqa: E402

pytestmark = pytest.mark.heavy  # starts Ray

POOL = 64 << 20
APP = "lorafleet-test"


@pytest.fixture(scope="module")
def fleet():
    return default_fleet()


@pytest.fixture(scope="module")
def deployed(fleet):
    from lorafleet.deploy.ray import build_app

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="lorafleet-tests")
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(fleet.model, fleet.adapters, replicas=2, pool_bytes=POOL, served_model_name=fleet.name),
                  name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(fleet):
    """Answers of one engine alone, through the daemon's routes in-process: request -> text."""
    from lorafleet.deploy.inprocess import InProcessServer
    from lorafleet.engine.engine import Engine

    engine = Engine(fleet.model, device="cpu", pool_bytes=POOL)
    for name, path in fleet.adapters.items():
        engine.register_adapter(name, path)
    server = InProcessServer(engine, fleet.name, fleet.model)
    cache: dict[tuple[str, str], str] = {}

    def answer(model: str, text: str) -> str:
        key = (model, text)
        if key not in cache:
            status, _, body = asyncio.run(server.call("POST", "/v1/chat/completions", json.dumps(body_of(model, text)).encode()))
            assert status == 200, body
            cache[key] = json.loads(body)["choices"][0]["message"]["content"]
        return cache[key]
    yield answer
    server.close()


def body_of(model: str, text: str, stream: bool = False) -> dict:
    skill = None if model == "demo" else model
    return {"model": model, "messages": [{"role": "user", "content": user_turn(skill, text)}],
            "max_tokens": 48, "temperature": 0, "stream": stream}


def ask(url: str, model: str, text: str, stream: bool = False) -> tuple[int, str]:
    with httpx.Client(base_url=url, timeout=120) as c:
        if not stream:
            r = c.post("/v1/chat/completions", json=body_of(model, text))
            return r.status_code, (r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text)
        parts = []
        with c.stream("POST", "/v1/chat/completions", json=body_of(model, text, stream=True)) as r:
            if r.status_code != 200:
                return r.status_code, r.read().decode()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    parts.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
        return 200, "".join(parts)


def replica_stats(timeout: float = 60.0) -> dict[str, dict]:
    """Each replica's /v1/stats, by replica id: handle calls until both replicas answered."""
    handle = serve.get_deployment_handle("Replica", app_name=APP)
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"only replicas {sorted(seen)} answered within {timeout:g}s"
        s = handle.stats.remote().result(timeout_s=timeout)
        seen[s["replica_id"]] = s
    return seen


def test_two_hundred_requests_over_the_fleets_models_answer_as_one_engine_and_route_by_residency(
        deployed, fleet, reference):
    models = [fleet.name, *fleet.adapters]
    assert len(models) == 1 + len(SKILLS)
    texts = held_out_texts(25)
    rng = random.Random(0)
    work = [(rng.choice(models), rng.choice(texts), i % 5 == 0) for i in range(200)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda w: ask(deployed, *w), work))
    wrong = [(m, t, a) for (m, t, _), (status, a) in zip(work, answers) if status != 200 or a != reference(m, t)]
    assert not wrong, f"{len(wrong)} of 200 differ from one engine alone, e.g. {wrong[:3]}"
    stats = replica_stats()
    loads = sum(info["loads"] for s in stats.values() for info in s["engine"]["adapter_details"].values())
    registered = sum(s["engine"]["adapters"]["registered"] for s in stats.values())
    assert loads <= 2 * len(fleet.adapters), f"{loads} adapter loads across replicas for {len(fleet.adapters)} adapters"
    served = sum(s["engine"]["num_requests_finished"] for s in stats.values())
    assert served >= 200 and all(s["engine"]["num_requests_finished"] > 0 for s in stats.values()), \
        "both replicas should have served"
    print(f"\n{loads} adapter loads, {registered} registrations across 2 replicas for 7 adapters; "
          f"requests per replica: {[s['engine']['num_requests_finished'] for s in stats.values()]}")


def test_models_lists_the_base_and_the_adapters_with_their_parent(deployed, fleet):
    with httpx.Client(base_url=deployed, timeout=30) as c:
        cards = c.get("/v1/models").json()["data"]
    assert [m["id"] for m in cards] == [fleet.name, *sorted(fleet.adapters)]
    assert all(m["parent"] == fleet.name for m in cards[1:]) and cards[0]["parent"] is None


def test_an_unknown_adapter_is_a_404_naming_it(deployed):
    status, text = ask(deployed, "no-such-adapter", "hello")
    assert status == 404 and "no-such-adapter" in text


def test_a_mix_is_routed_by_its_first_adapter_and_answers_as_upper_alone_with_others_at_zero(deployed):
    texts = held_out_texts(4)
    with httpx.Client(base_url=deployed, timeout=120) as c:
        for text, other in zip(texts, ["reverse", "kebab", "title", "double"]):
            body = body_of("upper", text)
            alone = c.post("/v1/chat/completions", json=body)
            # the mix goes by its first adapter by name: `other` for three, "upper" for "title"
            mix = c.post("/v1/chat/completions", json={**{k: v for k, v in body.items() if k != "model"},
                                                        "adapters": [{"name": "upper"}, {"name": other, "scale": 0}]})
            assert alone.status_code == mix.status_code == 200, mix.text
            assert mix.json()["choices"][0]["message"] == alone.json()["choices"][0]["message"]
        ghost = c.post("/v1/chat/completions", json={"messages": body["messages"], "max_tokens": 4,
                                                      "adapters": [{"name": "upper"}, {"name": "ghost"}]})
    assert ghost.status_code == 404 and ghost.json()["error"]["param"] == "adapters" and "ghost" in ghost.text


def test_a_killed_replica_is_restarted_and_never_answers_wrong(deployed, fleet, reference):
    victim = next(iter(replica_stats()))
    actor = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].endswith(f"#Replica#{victim}"))
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=False)
    models, texts = [fleet.name, *fleet.adapters], held_out_texts(8)
    # while Serve replaces it: requests may fail, none may get another adapter's answer
    deadline, ok_after = time.monotonic() + 180, 0
    while ok_after < 16:
        assert time.monotonic() < deadline, "requests did not succeed again within 180s of the kill"
        m, t = random.choice(models), random.choice(texts)
        status, answer = ask(deployed, m, t)
        if status == 200:
            assert answer == reference(m, t), (m, t, answer)
            ok_after += 1
        else:
            assert status >= 500, (status, answer)  # an error, never a wrong adapter
            ok_after = 0
    ids = set(replica_stats(timeout=120))
    assert len(ids) == 2 and victim not in ids, f"replicas after the kill: {ids}"
    with ThreadPoolExecutor(8) as pool:
        after = list(pool.map(lambda i: (models[i % 8], texts[i % 8], ask(deployed, models[i % 8], texts[i % 8])),
                              range(32)))
    assert all(s == 200 and a == reference(m, t) for m, t, (s, a) in after)
