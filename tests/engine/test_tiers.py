"""Thousands of adapters: disk -> host -> device tiers, the queue-driven prefetcher, no
head-of-line blocking, fair admission, eviction that never touches a running request's adapter."""

from __future__ import annotations

import random
import threading
import time

import pytest

from lorafleet import Engine, SamplingParams
from lorafleet.bench.adapters import write_adapter
from lorafleet.memory import host_cache
from tests.fixtures import stepping
from tests.engine.test_batching import random_prompts

SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
QV = ("q_proj", "v_proj")


@pytest.fixture(scope="module")
def thousand(llama_dir, tmp_path_factory):
    """1,000 random PEFT adapters, ranks 4-64 on q/v."""
    root = tmp_path_factory.mktemp("thousand")
    rng = random.Random(0)
    return {f"t{i:04d}": write_adapter(llama_dir, root / f"t{i:04d}", rng.randint(4, 64), QV, seed=i)
            for i in range(1000)}


def run_all(engine, prompts, params, adapters):
    ids = [engine.add_request(p, params, adapter=a) for p, a in zip(prompts, adapters)]
    done = {}
    for outs in stepping(engine):
        done.update({o.request_id: o for o in outs if o.finished})
    return [done[i] for i in ids]


def test_registering_costs_no_device_memory(llama_dir, thousand):
    engine = Engine(llama_dir, pool_bytes=4 << 20)
    before = engine.stats()["pool"]
    for name in list(thousand)[:200]:
        engine.register_adapter(name, thousand[name])
    assert engine.stats()["pool"] == before
    assert engine.stats()["adapters"]["tiers"] == {"device": 0, "host": 0, "disk": 200}


@pytest.mark.heavy  # a thousand adapters: a whole run
def test_a_thousand_adapters_through_a_pool_that_holds_thirty(llama_dir, thousand):
    probe = Engine(llama_dir, pool_bytes=8 << 20)
    sizes = [probe.load_adapter(n, thousand[n])["pages"] for n in list(thousand)[:50]]
    mean_pages = sum(sizes) / len(sizes)
    kv_room = 32 * 4  # 32 running sequences of up to 64 tokens
    pool_pages = int(30 * mean_pages) + kv_room
    engine = Engine(llama_dir, pool_bytes=pool_pages * probe.pool.page_bytes, max_num_seqs=32,
                    host_cache_bytes=4 << 20)
    solo = Engine(llama_dir, pool_bytes=8 << 20)
    for name, path in thousand.items():
        engine.register_adapter(name, path)
        solo.register_adapter(name, path)
    rng = random.Random(1)
    names = list(thousand)
    prompts = random_prompts(500, lo=4, hi=24, seed=3)
    chosen = [rng.choice(names) for _ in prompts]
    got = run_all(engine, prompts, SHORT, chosen)   # integrity is checked after every step
    for prompt, name, out in zip(prompts, chosen, got):
        assert out.finish_reason == "length", out.error
        assert out.token_ids == solo.generate([prompt], SHORT, adapters=[name])[0].token_ids
    stats = engine.stats()
    assert stats["num_adapter_loads"] > 300  # ~400 distinct adapters through a ~30-adapter pool
    assert sum(e.evictions for e in engine.adapters.entries.values()) > 0
    assert stats["adapters"]["tiers"]["device"] < len(set(chosen))
    pool = engine.pool
    for entry in engine.adapters.entries.values():  # every page free or held by an idle resident
        assert entry.users == 0 and entry.pins == 0
    assert pool.num_kv == 0
    engine.reset_prefix_cache()
    assert pool.num_free + sum(len(e.pages) for e in engine.adapters.entries.values() if e.ready) == pool.num_pages


def slow_loads(monkeypatch, slow_paths, seconds):
    real = host_cache.build_host_adapter

    def build(path, *args):
        if str(path) in slow_paths:
            time.sleep(seconds)
        return real(path, *args)
    monkeypatch.setattr(host_cache, "build_host_adapter", build)


def test_a_slow_adapter_load_blocks_nobody_behind_it(llama_dir, thousand, monkeypatch):
    engine = Engine(llama_dir, pool_bytes=8 << 20)
    engine.load_adapter("warm", thousand["t0001"])
    engine.register_adapter("slow", thousand["t0002"])
    release = threading.Event()  # the slow load finishes only when the test says so
    real = host_cache.build_host_adapter

    def build(path, *args):
        if path == thousand["t0002"]:
            assert release.wait(60), "the slow load was never released"
        return real(path, *args)
    monkeypatch.setattr(host_cache, "build_host_adapter", build)
    prompts = random_prompts(5, seed=5)
    slow_id = engine.add_request(prompts[0], SHORT, adapter="slow")
    others = [engine.add_request(p, SHORT, adapter=a) for p, a in zip(prompts[1:], ["warm", None, "warm", None])]
    done, deadline = {}, time.monotonic() + 60
    while not set(others) <= done.keys():  # would never end if they waited for the slow load
        assert time.monotonic() < deadline, "requests behind the slow load did not finish"
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert slow_id not in done and engine.adapters.get("slow").loading is not None
    time.sleep(0.05)
    release.set()
    for outs in stepping(engine):
        done.update({o.request_id: o for o in outs if o.finished})
    slow_out = done[slow_id]
    assert slow_out.finish_reason == "length"
    assert slow_out.metrics["adapter_wait_s"] >= 0.05        # exposed load time is measured
    assert done[others[0]].metrics["adapter_wait_s"] == 0.0
    monkeypatch.undo()
    solo = Engine(llama_dir, pool_bytes=8 << 20)
    solo.load_adapter("slow", thousand["t0002"])
    assert slow_out.token_ids == solo.generate([prompts[0]], SHORT, adapters=["slow"])[0].token_ids


def backlogged_token_spread(llama_dir, thousand, policy):
    """One adapter floods (10x the requests, submitted first); returns the spread of generated
    tokens across adapters while every adapter still had requests waiting."""
    engine = Engine(llama_dir, pool_bytes=8 << 20, max_num_seqs=4, policy=policy)
    names = [f"a{i}" for i in range(10)]
    for i, name in enumerate(names):
        engine.load_adapter(name, thousand[f"t{i:04d}"])
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = list(range(5, 17))
    for name in names:
        for _ in range(100 if name == "a0" else 10):
            engine.add_request(prompt, params, adapter=name)
    tokens = dict.fromkeys(names, 0)
    owner = {r.request_id: r.adapter for r in engine.scheduler.waiting}
    for outs in stepping(engine, until=lambda: not all(any(r.adapter == n for r in engine.scheduler.waiting)
                                                        for n in names)):
        for out in outs:
            tokens[owner[out.request_id]] += len(out.new_token_ids)
    return max(tokens.values()) - min(tokens.values()), tokens


def test_fair_admission_bounds_a_flooding_adapter(llama_dir, thousand):
    bound = 4 * (1 + 4)  # max_tokens * (1 + max_num_seqs): policy.py's promise
    spread, tokens = backlogged_token_spread(llama_dir, thousand, "vtc")
    assert spread <= bound, tokens
    assert min(tokens.values()) > 0
    fcfs_spread, fcfs_tokens = backlogged_token_spread(llama_dir, thousand, "fcfs")
    assert fcfs_spread > bound, fcfs_tokens  # the bound is not met by accident


def test_eviction_never_takes_a_running_requests_adapter(llama_dir, thousand):
    probe = Engine(llama_dir, pool_bytes=8 << 20)
    pages = probe.load_adapter("x", thousand["t0010"])["pages"]
    engine = Engine(llama_dir, pool_bytes=(4 * pages + 40) * probe.pool.page_bytes, max_num_seqs=8)
    for i in range(10, 30):
        engine.register_adapter(f"r{i}", thousand["t0010"])  # same size, 20 names
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    held = engine.add_request(random_prompts(1, seed=9)[0], long, adapter="r10")
    others = [engine.add_request(p, SHORT, adapter=f"r{11 + i % 19}") for i, p in enumerate(random_prompts(40))]
    for outs in stepping(engine):
        for out in outs:
            if out.request_id == held and out.finished:
                assert engine.adapters.get("r10").evictions == 0
        req = engine.requests.get(held)
        if req is not None and req.status.value == "running":
            assert engine.adapters.get("r10").ready
    assert sum(e.evictions for e in engine.adapters.entries.values()) > 0  # there was pressure
    assert len(others) == 40


def test_a_broken_adapter_file_fails_only_its_own_requests(llama_dir, thousand, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    gone, corrupt = tmp_path / "gone", tmp_path / "corrupt"
    shutil.copytree(thousand["t0020"], gone)
    shutil.copytree(thousand["t0022"], corrupt)
    engine = Engine(llama_dir, pool_bytes=8 << 20)
    engine.register_adapter("gone", gone)
    engine.register_adapter("corrupt", corrupt)
    engine.register_adapter("good", thousand["t0021"])
    (gone / "adapter_model.safetensors").unlink()              # registered fine, gone at load
    tensors = load_file(corrupt / "adapter_model.safetensors")
    key = sorted(tensors)[0]
    tensors[key][0, 0] = float("nan")                          # valid file, invalid weights
    save_file(tensors, corrupt / "adapter_model.safetensors")
    prompts = random_prompts(5, seed=11)
    before = engine.stats()["pool"]
    outs = run_all(engine, prompts, SHORT, ["gone", "good", "corrupt", None, "gone"])
    for out in (outs[0], outs[4]):
        assert out.finish_reason == "error" and "adapter_model.safetensors" in out.error
        assert out.token_ids == []
    assert outs[2].finish_reason == "error" and key in outs[2].error
    assert outs[1].finish_reason == outs[3].finish_reason == "length"
    pages = engine.stats()["pool"]["pages_by_adapter"]
    assert set(pages) == {"good"} and engine.pool.num_kv == before["kv_pages"] == 0
    shutil.copy(thousand["t0020"] / "adapter_model.safetensors", gone)  # fixed: a new request retries
    assert run_all(engine, prompts[:1], SHORT, ["gone"])[0].finish_reason == "length"


def test_a_load_failure_seen_during_an_eager_load_still_fails_its_requests_at_once(llama_dir, thousand,
                                                                              tmp_path, monkeypatch):
    """The eager load's wait harvests whatever finishes meanwhile: a lazy load that failed is
    handed to the next step, which fails the requests waiting for it (not their deadline)."""
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(thousand["t0040"], broken)
    engine = Engine(llama_dir, pool_bytes=8 << 20)
    engine.register_adapter("broken", broken)
    (broken / "adapter_model.safetensors").unlink()
    failed = threading.Event()
    real = engine.adapters.inspect  # a load's first look at the files, on its worker

    def inspect(name, path, **kw):
        if path == broken:
            try:
                return real(name, path, **kw)
            finally:
                failed.set()
        assert failed.wait(30), "the broken load never ran"  # the eager load lands after the failure
        return real(name, path, **kw)
    monkeypatch.setattr(engine.adapters, "inspect", inspect)
    waiting = engine.add_request(random_prompts(1)[0], SHORT, adapter="broken", deadline_s=60)
    engine.load_adapter("eager", thousand["t0041"])
    assert "eager" in engine.adapters and engine.adapters.get("broken").error
    out = [o for o in engine.step() if o.request_id == waiting]
    assert out and out[0].finish_reason == "error" and "adapter_model.safetensors" in out[0].error
    assert not engine.has_unfinished()


def test_a_deadline_aborts_a_request_early(llama_dir, thousand, monkeypatch):
    engine = Engine(llama_dir, pool_bytes=8 << 20)
    engine.register_adapter("slow", thousand["t0030"])
    slow_loads(monkeypatch, {str(thousand["t0030"])}, 0.5)
    rid = engine.add_request(random_prompts(1)[0], SHORT, adapter="slow", deadline_s=0.1)
    outs = []
    for step_outs in stepping(engine):
        outs += [o for o in step_outs if o.finished]
    assert [o.request_id for o in outs] == [rid] and outs[0].finish_reason == "deadline"
    assert engine.pool.num_kv == 0


def test_the_host_cache_stays_within_its_budget(llama_dir, thousand):
    engine = Engine(llama_dir, pool_bytes=8 << 20, host_cache_bytes=200_000)
    names = list(thousand)[100:140]
    for n in names:
        engine.register_adapter(n, thousand[n])
    run_all(engine, random_prompts(40, seed=4), SHORT, names)
    cache = engine.adapters.host
    assert cache.nbytes <= 200_000 or len(cache) == 1
    assert 0 < len(cache) < 40
    stats = engine.stats()["adapter_details"]
    assert all(stats[n]["loads"] >= 1 and stats[n]["misses"] == 1 for n in names)


def test_stats_report_per_adapter_load_and_stall_times_and_the_live_switch_regression(llama_dir, thousand):
    """What `lorafleet top` draws: per adapter, its disk loads' seconds and its finished requests'
    exposed waits (p50/p99); for the engine, loads per step and the switch regression over its
    recent steps; the pool's owners page by page."""
    engine = Engine(llama_dir, pool_bytes=8 << 20)
    names = list(thousand)[:6]
    for name in names:
        engine.register_adapter(name, thousand[name])
    before = engine.stats()
    assert before["untouched_adapters"] == names and before["adapter_details"] == {}
    adapters = [names[i % 6] for i in range(18)]
    run_all(engine, random_prompts(18, seed=3), SHORT, adapters)
    stats = engine.stats()
    for name in names:
        info = stats["adapter_details"][name]
        entry = engine.adapters.get(name)
        assert info["loads"] >= 1 and list(entry.recent_loads) and info["load_s"]["p50"] > 0
        assert info["load_s"]["p99"] == max(entry.recent_loads)  # nearest rank of <= 64 values
        assert len(entry.recent_waits) == adapters.count(name)  # one per finished request on it
        assert info["stall_s"]["p99"] == max(entry.recent_waits) >= 0
    assert stats["untouched_adapters"] == []
    engine.register_adapter("late", thousand[list(thousand)[6]])
    assert engine.stats()["untouched_adapters"] == ["late"] and "late" not in engine.stats()["adapter_details"]
    switches = stats["switches"]
    assert switches["window_steps"] == stats["num_steps"]
    hist = dict(switches["loaded_per_step"])
    assert sum(hist.values()) == stats["num_steps"]
    assert sum(k * v for k, v in hist.items()) == stats["num_adapter_loads"] >= 6
    assert switches["regression"]["steps"] == sum(1 for s in engine.step_records() if s["num_tokens"])
    runs = stats["pool"]["page_map"]
    assert sum(n for _, n in runs) == stats["pool"]["total_pages"]
    held = {}
    for label, n in runs:
        held[label] = held.get(label, 0) + n
    assert {k: v for k, v in held.items() if k not in ("free", "kv", "cached")} == stats["pool"]["pages_by_adapter"]
