"""`lorafleet/snapshot.py` declares what `/v1/stats` answers; a live engine's answers carry exactly
that, at every depth: no key the declarations lack, every key they require, each value of its
declared kind. `Engine.stats()`, `engine_snapshot` and the route's whole answer are taken from a
tiny engine serving a few adapters (evictions, a host tier, a mix, the self-check); the TUI's
recorded stream is held to the same shapes. A key added to a producer without its declaration
fails here."""

from __future__ import annotations

import asyncio
import json
import types
from pathlib import Path
from typing import Literal, Union, get_args, get_origin, get_type_hints, is_typeddict

import pytest

from lorafleet import snapshot
from tests.fixtures import build_adapter, build_model

STREAM = Path(__file__).parents[1] / "tui" / "data" / "stream.json"
ADAPTERS = [("sql-r16", 16, ["q_proj", "v_proj"]), ("chat-r8", 8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
            ("code-r32", 32, ["q_proj", "v_proj", "gate_proj"]), ("tiny-r2", 2, ["o_proj"]),
            ("math-r4", 4, ["up_proj", "down_proj"])]


def problems(value, tp, where: str = "stats") -> list[str]:
    """Where `value` departs from the type `tp`, one line each; [] when it conforms. A TypedDict
    is an object with its declared keys (the required ones present, no other), a dict's values are
    each checked, a tuple is an array of its length (a list once parsed), an int passes as a float."""
    if is_typeddict(tp):
        if not isinstance(value, dict):
            return [f"{where}: {type(value).__name__}, not an object"]
        hints = get_type_hints(tp)
        out = [f"{where}.{k}: not declared in {tp.__name__}" for k in value if k not in hints]
        out += [f"{where}.{k}: missing, required by {tp.__name__}" for k in sorted(tp.__required_keys__ - set(value))]
        return out + [p for k, v in value.items() if k in hints for p in problems(v, hints[k], f"{where}.{k}")]
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        arms = args if value is None else [a for a in args if a is not type(None)]
        found = [problems(value, a, where) for a in arms]
        return [] if not all(found) else min(found, key=len)
    if origin is Literal:
        return [] if value in args else [f"{where}: {value!r}, not one of {args}"]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{where}: {type(value).__name__}, not an object"]
        return [p for k, v in value.items()
                for p in problems(k, args[0], f"{where} key") + problems(v, args[1], f"{where}[{k!r}]")]
    if origin is list:
        if not isinstance(value, list):
            return [f"{where}: {type(value).__name__}, not an array"]
        return [p for i, v in enumerate(value) for p in problems(v, args[0], f"{where}[{i}]")]
    if origin is tuple:
        if not isinstance(value, (tuple, list)) or len(value) != len(args):
            return [f"{where}: {value!r}, not an array of {len(args)}"]
        return [p for i, (v, a) in enumerate(zip(value, args)) for p in problems(v, a, f"{where}[{i}]")]
    if tp is type(None):
        ok = value is None
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp in (str, bool):
        ok = isinstance(value, tp)
    else:
        raise TypeError(f"{where}: no check for {tp!r}: teach `problems` it")
    return [] if ok else [f"{where}: {value!r}, not {getattr(tp, '__name__', tp)}"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("snapshot")
    base = build_model(root / "base", "llama")
    adapters = {name: build_adapter(base, root / name, seed=i, r=rank, lora_alpha=2 * rank, target_modules=targets)
                for i, (name, rank, targets) in enumerate(ADAPTERS)}
    return base, adapters


def test_the_engines_answers_carry_the_declared_keys_and_no_other(fleet):
    from lorafleet import Engine, SamplingParams
    from lorafleet.deploy.inprocess import InProcessServer
    from lorafleet.adapters.mix import Mix
    from lorafleet.server.metrics import engine_snapshot

    base, adapters = fleet
    # a pool too small for every adapter and a host cache for a few: evictions, all three tiers
    engine = Engine(base, pool_bytes=220_000, host_cache_bytes=150_000, self_check=True, debug_checks=True)
    for name, path in adapters.items():
        engine.register_adapter(name, path)
    engine.register_adapter("spare", adapters["sql-r16"])  # never asked for: `untouched_adapters`
    params = SamplingParams(max_tokens=8, temperature=0.0)
    seen = []

    def check():
        stats, snap = engine.stats(), engine_snapshot(engine)
        assert problems(stats, snapshot.EngineStats) == []
        assert problems(snap, snapshot.EngineSnapshot, "engine") == []
        seen.append(snap)

    check()
    names = list(adapters)
    waves = [[0, 1, 2, 0, 3], [4, 2, 1, None, 0], [3, 4, 2, 1]]
    for w, wave in enumerate(waves):
        for j, a in enumerate(wave):
            engine.add_request([5 + (7 * j + w) % 90 for _ in range(12 + 3 * j)], params,
                               names[a] if a is not None else None)
        engine.add_request([9, 8, 7, 6, 5], params, Mix.of({names[3]: 1.0, names[4]: 0.5}))
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
            if steps % 2 == 0:
                check()
        check()
    # the run reached what the declarations allow for: every tier, evictions, a regression null and
    # then fitted, a self-check, mixes, an untouched adapter
    assert any(s["adapters"]["tiers"]["host"] for s in seen) and seen[-1]["eviction"]["evicted_adapters"]
    assert seen[0]["switches"]["regression"] is None and seen[-1]["switches"]["regression"] is not None
    assert seen[-1]["self_check"] is not None
    assert seen[-1]["mixes"]["requests"] == len(waves) and seen[-1]["untouched_adapters"] == ["spare"]

    server = InProcessServer(engine, "tiny", base)
    try:
        status, _, body = asyncio.run(server.call("GET", "/v1/stats"))
    finally:
        server.close()
    assert status == 200
    assert problems(json.loads(body), snapshot.Stats) == []


def test_the_recorded_stream_the_tui_tests_replay_has_the_declared_shape():
    for i, stats in enumerate(json.loads(STREAM.read_text())):
        assert problems(stats, snapshot.Stats, f"stream[{i}]") == []


def test_a_key_the_declarations_lack_or_require_is_named():
    stats = json.loads(STREAM.read_text())[-1]
    stats["engine"]["pool"]["reserved_pages"] = 0
    next(iter(stats["engine"]["adapter_details"].values()))["load_s"]["p90"] = 0.1
    del stats["server"]["pid"]
    stats["engine"]["switches"]["loaded_per_step"].append([1])
    assert sorted(problems(stats, snapshot.Stats)) == sorted([
        "stats.engine.pool.reserved_pages: not declared in PoolStats",
        "stats.engine.adapter_details['sql-r16'].load_s.p90: not declared in Quantiles",
        "stats.server.pid: missing, required by ServerInfo",
        "stats.engine.switches.loaded_per_step[5]: [1], not an array of 2"])
