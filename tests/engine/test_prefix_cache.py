"""The prefix cache (memory/kv.py) and the one eviction order (memory/eviction.py): outputs equal
those without the cache (base, mixed adapters, chunked prefill, preemption); a block is reused
only under the weights that computed it (never across adapters that touch K or V, never after a
name's weights were replaced); the base's blocks are shared only by adapters that leave every K
and V as the base computes them; cached pages are evicted in the cost order, or LRU over both
kinds with eviction="lru"; check_integrity covers reference counts and cached pages."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch

from lorafleet import Engine, SamplingParams
from lorafleet.engine import scheduler
from lorafleet.errors import ConfigError
from lorafleet.memory.eviction import PRIOR_MISS_S_PER_BYTE, EvictionOrder
from lorafleet.memory.kv import BASE_SALT
from lorafleet.memory.pool import CACHED, KV
from tests.fixtures import ALL7, build_adapter

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BS = 16


def shared_prompts(n, prefix_len=40, seed=0, tails=(3, 12)):
    """`n` prompts: one system prompt of `prefix_len` tokens, then a distinct question."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 160) for _ in range(prefix_len)]
    return [system + [rng.randrange(3, 160) for _ in range(rng.randint(*tails))] for _ in range(n)]


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix-adapters")
    return {
        "kv": build_adapter(llama_dir, root / "kv", seed=1, r=4, target_modules=ALL7),
        "kv2": build_adapter(llama_dir, root / "kv2", seed=2, r=8, target_modules=["k_proj", "v_proj"]),
        "mlp": build_adapter(llama_dir, root / "mlp", seed=3, r=4, target_modules=["gate_proj", "up_proj", "down_proj"]),
        "last": build_adapter(llama_dir, root / "last", seed=4, r=4, layers_to_transform=[1],
                              target_modules=["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    }


def engine(llama_dir, adapters=None, **options):
    e = Engine(llama_dir, pool_bytes=options.pop("pool_bytes", 4 << 20), debug_checks=True, **options)
    for name, path in (adapters or {}).items():
        e.register_adapter(name, path)
    return e


def waves(e, prompts, names, params=GREEDY):
    """Two waves of the same prompts: the second may reuse what the first computed."""
    first = [o.token_ids for o in e.generate(prompts, params, adapters=names)]
    second = [o.token_ids for o in e.generate(prompts, params, adapters=names)]
    return first, second


@pytest.mark.parametrize("setting", [
    dict(),                                        # base and mixed adapters
    dict(max_num_batched_tokens=24),               # chunked prefill
    dict(pool_bytes=None, max_num_seqs=16),        # preemption: a pool too small for the batch
])
def test_outputs_with_the_cache_equal_outputs_without(llama_dir, adapters, setting, monkeypatch):
    if "pool_bytes" in setting:  # admission keeps no room for growth, so that running sequences preempt
        for name in ("GROWTH_START", "GROWTH_MIN", "GROWTH_AFTER_PREEMPTION"):
            monkeypatch.setattr(scheduler, name, 0.0)
    prompts = shared_prompts(12) + shared_prompts(6, prefix_len=70, seed=1)
    names = [[None, "kv", "kv2", "mlp", "last"][i % 5] for i in range(len(prompts))]
    options = dict(setting)
    if "pool_bytes" in options:  # room for adapters and a few sequences: preemptions follow
        probe = engine(llama_dir)
        options["pool_bytes"] = 40 * probe.pool.page_bytes
    on, off = engine(llama_dir, adapters, **options), engine(llama_dir, adapters, prefix_cache=False, **options)
    got, want = waves(on, prompts, names), waves(off, prompts, names)
    assert got == want
    assert got[0] == got[1]
    hits = on.stats()["prefix_cache"]["hit_tokens"]
    if "pool_bytes" in options:  # evictions take some of the first wave's blocks
        assert hits >= 32
    else:                        # the second wave found at least its first two blocks
        assert hits >= len(prompts) * 32
    assert off.stats()["prefix_cache"] == {"enabled": False, "cached_pages": 0, "reused_cached_pages": 0,
                                           "hashed_pages": 0, "query_tokens": 0, "hit_tokens": 0, "hit_rate": 0.0}
    if "pool_bytes" in options:
        assert on.stats()["num_preemptions"] > 0 and off.stats()["num_preemptions"] > 0


def hits_for(e, prompt, adapter):
    before = e.kv.hit_tokens
    out = e.generate([prompt], GREEDY, adapters=[adapter])[0].token_ids
    return e.kv.hit_tokens - before, out


def test_a_block_is_reused_only_under_the_weights_that_computed_it(llama_dir, adapters):
    e = engine(llama_dir, adapters)
    prompt = shared_prompts(1, prefix_len=48)[0]
    assert hits_for(e, prompt, "kv")[0] == 0
    for other in (None, "kv2", "mlp"):
        hit, out = hits_for(e, prompt, other)
        assert hit == 0, other   # computed under "kv": never for another adapter or the base
        assert out == engine(llama_dir, adapters).generate([prompt], GREEDY, adapters=[other])[0].token_ids
    assert hits_for(e, prompt, "kv")[0] == 48  # its own weights find them


def test_the_same_weights_under_another_name_share_blocks(llama_dir, adapters):
    e = engine(llama_dir, {"a": adapters["kv"], "alias": adapters["kv"]})
    prompt = shared_prompts(1, prefix_len=48)[0]
    hits_for(e, prompt, "a")
    assert hits_for(e, prompt, "alias")[0] == 48  # the salt is the content digest, not the name


def test_new_weights_under_a_name_never_reuse_its_old_blocks(llama_dir, adapters):
    e = engine(llama_dir, {"a": adapters["kv"]})
    prompt = shared_prompts(1, prefix_len=48)[0]
    hits_for(e, prompt, "a")
    e.load_adapter("a", adapters["kv2"])  # re-registered with other weights
    hit, out = hits_for(e, prompt, "a")
    assert hit == 0
    assert out == engine(llama_dir, {"a": adapters["kv2"]}).generate([prompt], GREEDY, adapters=["a"])[0].token_ids
    assert hits_for(e, prompt, "a")[0] == 48


def kv_of(llama_dir, adapters, name, prompt):
    """The KV pages a prompt leaves, without the cache: [blocks, layers, 2, bs, heads, dim]."""
    e = engine(llama_dir, adapters, prefix_cache=False)
    rid = e.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0), adapter=name)
    e.step()
    while e.kv.rows.get(rid) is None or e.requests[rid].num_computed < len(prompt):
        e.step()
    return e.kv.cache[torch.from_numpy(e.kv.table(rid).copy())][:len(prompt) // BS].clone()


def test_which_adapters_share_the_bases_kv(llama_dir, adapters):
    """An MLP-only adapter over every layer changes the K and V of every layer after the first
    (so it must not share the base's blocks); one confined to the last layer, k and v aside,
    changes none of them (so it shares)."""
    prompt = shared_prompts(1, prefix_len=48)[0]
    base = kv_of(llama_dir, adapters, None, prompt)
    mlp = kv_of(llama_dir, adapters, "mlp", prompt)
    last = kv_of(llama_dir, adapters, "last", prompt)
    assert torch.equal(mlp[:, 0], base[:, 0]) and not torch.allclose(mlp[:, 1], base[:, 1], atol=1e-4)
    assert torch.equal(last, base)
    e = engine(llama_dir, adapters)
    hits_for(e, prompt, None)
    assert e.adapters.get("last").kv_salt is None  # not on the device yet
    hit, out = hits_for(e, prompt, "last")
    assert hit == 48 and e.adapters.get("last").kv_salt == BASE_SALT
    assert out == engine(llama_dir, adapters, prefix_cache=False).generate([prompt], GREEDY, adapters=["last"])[0].token_ids
    assert hits_for(e, prompt, "mlp")[0] == 0 and e.adapters.get("mlp").kv_salt != BASE_SALT


def test_the_last_token_is_always_computed(llama_dir):
    e = engine(llama_dir)
    prompt = shared_prompts(1, prefix_len=32, tails=(0, 0))[0]   # exactly two full blocks
    e.generate([prompt], GREEDY)
    assert hits_for(e, prompt, None)[0] == 16  # the second block holds the last token: recomputed


def test_cached_pages_are_pool_pages_with_their_own_owner(llama_dir):
    e = engine(llama_dir)
    e.generate(shared_prompts(3, prefix_len=40), GREEDY)
    pool = e.pool.stats()
    assert pool["kv_pages"] == 0 and pool["cached_pages"] > 0
    assert e.pool.pages_of(CACHED).tolist() == sorted(e.kv.cached)
    assert pool["free_pages"] + pool["cached_pages"] + pool["adapter_pages"] == pool["total_pages"]


def test_check_integrity_covers_reference_counts_and_cached_pages(llama_dir):
    e = engine(llama_dir)
    prompts = shared_prompts(2, prefix_len=48)
    e.generate(prompts[:1], GREEDY)
    rid = e.add_request(prompts[1], GREEDY)
    e.step()
    shared = int(e.kv.table(rid)[0])
    assert e.kv.refs[shared] == 1 and e.pool._owner[shared] == KV
    e.check_integrity()
    e.kv.refs[shared] += 1   # a count that no block table backs
    with pytest.raises(AssertionError, match="reference counts"):
        e.check_integrity()
    e.kv.refs[shared] -= 1
    page = next(iter(e.kv.page_hash))
    e.kv.page_hash[page] = b"another key"   # the two maps disagree
    with pytest.raises(AssertionError, match="hash maps"):
        e.check_integrity()


def test_one_eviction_order_over_cached_blocks_and_idle_adapters():
    order = EvictionOrder("cost", block_size=16, page_bytes=1 << 16)
    order.recompute_s_per_token, order.miss_s_per_byte = 1e-3, 1e-9  # recompute dear: keep blocks
    now = time.monotonic()
    assert not order.kv_first(now - 10, now - 1, now)   # the younger adapter goes first
    assert order.kv_first(now - 10, None, now) and not order.kv_first(None, now - 1, now)
    lru = EvictionOrder("lru", block_size=16, page_bytes=1 << 16)
    assert lru.kv_first(now - 10, now - 1, now)         # LRU: the older block goes first
    order.observe_prefill(2.0, 1000)
    assert order.recompute_s_per_token == pytest.approx(1e-3 + 0.2 * (2e-3 - 1e-3))
    order.observe_miss(0.5, 1 << 20)
    assert order.miss_s_per_byte == pytest.approx(1e-9 + 0.2 * (0.5 / (1 << 20) - 1e-9))
    with pytest.raises(ValueError, match="eviction policy"):
        EvictionOrder("random", 16, 1)


@pytest.mark.parametrize("policy", ["cost", "lru"])
def test_the_engine_evicts_in_its_order(llama_dir, adapters, policy):
    """A pool holding cached blocks and an idle adapter; a new adapter needs their pages. With
    recompute measured dear, the cost order gives up the adapter first, LRU the older blocks."""
    probe = engine(llama_dir, adapters)
    probe.load_adapter("kv", adapters["kv"])
    need = len(probe.adapters.get("kv").pages)
    # room for "kv", the 4 blocks the first prompt leaves cached, and one page more
    e = engine(llama_dir, adapters, pool_bytes=(need + 5) * probe.pool.page_bytes, eviction=policy)
    e.generate(shared_prompts(1, prefix_len=64, tails=(0, 0)), GREEDY)
    e.generate([[5, 6, 7]], GREEDY, adapters=["kv"])                   # then the adapter goes idle
    cached = e.pool.num_cached
    assert cached >= 3 and e.adapters.get("kv").ready
    e.arbiter.order.recompute_s_per_token = 1.0  # recomputing is dear (a measured figure, forced)
    e.adapters.step += 100                        # no hysteresis in the way
    e.generate([[5, 6, 7]], GREEDY, adapters=["kv2"])
    ev = e.stats()["eviction"]
    assert ev["miss_s_per_byte"] != PRIOR_MISS_S_PER_BYTE  # measured: both requests found their adapter cold
    if policy == "cost":
        assert ev["evicted_adapters"] == 1 and not e.adapters.get("kv").ready
    else:
        assert ev["evicted_kv_blocks"] > 0 and ev["evicted_kv_blocks"] + e.pool.num_cached >= cached


def test_an_adapter_a_waiting_request_wants_is_evicted_for_kv_last(llama_dir, adapters):
    """The cost order would give up the idle adapter before dear cached blocks; when a waiting
    request wants that adapter (just loaded for it), the blocks go first and the adapter only
    when nothing else is left. Without `wanted`, the adapter goes first."""
    probe = engine(llama_dir, adapters)
    probe.load_adapter("kv", adapters["kv"])
    need = len(probe.adapters.get("kv").pages)
    for wanted in (False, True):
        e = engine(llama_dir, adapters, pool_bytes=(need + 5) * probe.pool.page_bytes, eviction="cost")
        e.generate(shared_prompts(1, prefix_len=64, tails=(0, 0)), GREEDY)
        e.generate([[5, 6, 7]], GREEDY, adapters=["kv"])
        kv, cached = e.adapters.get("kv"), e.pool.num_cached
        assert cached >= 3 and kv.ready
        e.arbiter.order.recompute_s_per_token = 1.0  # recomputing is dear: the order prefers the adapter
        e.adapters.step += 100
        assert e.arbiter.make_room(e.pool.num_free + 1, for_kv=True, wanted={kv} if wanted else ())
        assert kv.ready == wanted and e.pool.num_cached == (cached - 1 if wanted else cached)
        if wanted:  # only the wanted adapter is left to give: it goes
            assert e.arbiter.make_room(e.pool.num_free + cached, for_kv=True, wanted={kv})
            assert not kv.ready and e.pool.num_cached == 0
        e.check_integrity()


def test_the_cache_can_be_turned_off(llama_dir):
    e = engine(llama_dir, prefix_cache=False)
    prompts = shared_prompts(4)
    e.generate(prompts, GREEDY)
    e.generate(prompts, GREEDY)
    assert e.kv.hit_tokens == 0 and e.pool.num_cached == 0 and not e.kv.page_hash
    with pytest.raises(ConfigError, match="eviction"):
        Engine(llama_dir, pool_bytes=4 << 20, eviction="mru")


def test_finished_outputs_report_their_cached_tokens(llama_dir):
    e = engine(llama_dir)
    prompt = shared_prompts(1, prefix_len=48)[0]
    first = e.generate([prompt], GREEDY)[0]
    second = e.generate([prompt], GREEDY)[0]
    assert first.metrics["cached_tokens"] == 0 and second.metrics["cached_tokens"] == 48
    assert np.isclose(e.stats()["prefix_cache"]["hit_rate"], 48 / (2 * len(prompt)))


def test_the_cost_order_gives_back_never_reused_blocks_before_reused_ones(llama_dir):
    """A system prompt reused by a second request, then a one-off prompt released later: the
    cost order evicts the one-off's blocks first, LRU the older system prompt's."""
    for policy, survivor in (("cost", "system"), ("lru", "one-off")):
        e = engine(llama_dir, eviction=policy)
        system = shared_prompts(1, prefix_len=48, tails=(4, 4))[0]
        e.generate([system], GREEDY)
        e.generate([system[:48] + [7, 8, 9, 10]], GREEDY)     # reuses the 3 system blocks
        one_off = shared_prompts(1, prefix_len=48, seed=9, tails=(4, 4))[0]
        e.generate([one_off], GREEDY)
        assert len(e.kv.hot) == 3 and len(e.kv.cold) > 0
        for _ in range(len(e.kv.cold)):
            e.arbiter.make_room(e.pool.num_free + 1)           # one page at a time, as a load would
        hits = {name: hits_for(e, p, None)[0] for name, p in (("system", system), ("one-off", one_off))}
        assert hits[survivor] == 48, (policy, hits)
