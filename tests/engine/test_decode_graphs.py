"""Decode steps at fixed shapes (engine/graphs.py), the path CUDA graphs capture, run here
without capture (`decode_graphs="fixed"`): padded batches give the eager path's tokens, adapters
switching in and out (evicted, reloaded into other pages) change only the graph's input data,
and the number of captures depends on the buckets used, never on the adapters."""

from __future__ import annotations

from lorafleet import Engine, SamplingParams
from lorafleet.engine.graphs import RANK_BUCKETS, buckets, max_captures, segment_buckets
from lorafleet.engine.runner import ModelRunner
from lorafleet.model.upload import Upload
from tests.engine.test_batching import random_prompts
from tests.fixtures import ALL7, build_adapter

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_buckets_cover_every_batch_size():
    assert buckets(1) == [1]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert segment_buckets(1) == [1, 4] and segment_buckets(8) == [1, 4, 8, 32]
    assert segment_buckets(64) == [1, 4, 16, 64, 256]
    # per batch bucket: one graph without LoRA, one per (segment bucket, rank bucket)
    assert max_captures(8) == (1 + 2 * 3) + (1 + 3 * 3) + (1 + 3 * 3) + (1 + 4 * 3)
    assert max_captures(256) == 9 + 3 * sum(len(segment_buckets(b)) for b in buckets(256)) == 123


def test_lora_grids_are_sized_to_the_steps_segments_and_ranks(llama_dir, tmp_path):
    """One adapter over 8 rows is one segment at its rank's bucket; 8 adapters are 8 segments; a
    rank-32 adapter takes the 64 bucket: each a graph of its own, and none re-captured."""
    files = {r: build_adapter(llama_dir, tmp_path / f"r{r}", seed=r, r=r, lora_alpha=2 * r, target_modules=ALL7)
             for r in (2, 32)}
    fixed = Engine(llama_dir, pool_bytes=8 << 20, decode_graphs="fixed", max_num_seqs=8)
    eager = Engine(llama_dir, pool_bytes=8 << 20, decode_graphs="off", max_num_seqs=8)
    for i in range(8):
        for engine in (fixed, eager):
            engine.load_adapter(f"a{i}", files[2 if i < 7 else 32])
    prompts = random_prompts(8)
    for adapters in (["a0"] * 8, [f"a{i}" for i in range(8)], ["a7"] * 8, ["a0"] * 8):
        want = [o.token_ids for o in eager.generate(prompts, PARAMS, adapters=adapters)]
        assert [o.token_ids for o in fixed.generate(prompts, PARAMS, adapters=adapters)] == want
    graphs = fixed.stats()["decode_graphs"]
    assert graphs["keys"] == [[8, 1, 16], [8, 1, 64], [8, 8, 64]]  # (batch, segments, rank bound)
    assert graphs["captures"] == 3 <= graphs["max_captures"] == max_captures(8) and graphs["recaptures"] == 0
    assert RANK_BUCKETS == (16, 64, 256)


def test_fixed_shapes_give_the_eager_tokens_and_captures_do_not_grow_with_adapters(llama_dir, tmp_path):
    files = [build_adapter(llama_dir, tmp_path / f"r{r}", seed=r, r=r, lora_alpha=2 * r, target_modules=ALL7)
             for r in (2, 8, 32)]
    probe = Engine(llama_dir, pool_bytes=4 << 20)
    per_adapter = probe.load_adapter("probe", files[2])["pages"]
    pool = (4 * per_adapter + 24) * probe.pool.page_bytes  # room for ~4 adapters: rounds evict
    eager = Engine(llama_dir, pool_bytes=pool, decode_graphs="off")
    fixed = Engine(llama_dir, pool_bytes=pool, decode_graphs="fixed")
    names = [f"a{i}" for i in range(12)]
    prompts = random_prompts(3)  # 3 requests decoding together: bucket 4, one padding row every step
    rounds = [names[0:3], names[3:6], [None] * 3, names[6:9], names[9:12], [names[0], None, names[11]]]
    seen = []
    for adapters in rounds:
        for engine in (eager, fixed):  # loaded before the round (evicting earlier ones): in lockstep
            for name in filter(None, adapters):
                engine.load_adapter(name, files[names.index(name) % 3])
        want = [o.token_ids for o in eager.generate(prompts, PARAMS, adapters=adapters)]
        got = [o.token_ids for o in fixed.generate(prompts, PARAMS, adapters=adapters)]
        assert got == want, f"round {adapters}"
        seen.append(fixed.stats()["decode_graphs"]["captures"])
    graphs = fixed.stats()["decode_graphs"]
    assert seen == [1, 1, 2, 2, 2, 2]  # (4, with LoRA) then (4, base only): 12 adapters, 2 captures
    assert graphs["recaptures"] == 0 and graphs["eager_fallbacks"] == 0
    assert graphs["replays"] == len(rounds) * (PARAMS.max_tokens - 1)
    assert sum(fixed.adapters.get(n).evictions for n in names) > 0  # adapters really moved pages
    assert eager.stats()["decode_graphs"] == {"enabled": False}


def test_a_step_reaches_the_device_in_one_copy(llama_dir, tmp_path, monkeypatch):
    """Each step sends its inputs, its LoRA segments and its sampler's per-row numbers (seeded
    draws with top-k and min-p, logprobs, greedy rows beside them) in one copy: at a fixed shape
    the staging buffer's (as many uploads as replays, no `Upload.send`), eagerly one
    `Upload.send`; the sampled tokens are the eager path's."""
    file = build_adapter(llama_dir, tmp_path / "a", seed=3, r=4, lora_alpha=8, target_modules=ALL7)
    fixed = Engine(llama_dir, pool_bytes=8 << 20, decode_graphs="fixed", max_num_seqs=8)
    eager = Engine(llama_dir, pool_bytes=8 << 20, decode_graphs="off", max_num_seqs=8)
    sends, launches = [], []
    send, launch = Upload.send, ModelRunner.launch
    monkeypatch.setattr(Upload, "send", lambda self, dev: sends.append(len(self.columns)) or send(self, dev))
    monkeypatch.setattr(ModelRunner, "launch", lambda self, *a, **k: launches.append(1) or launch(self, *a, **k))
    adapters = ["a", None, "a", None, "a"]
    params = [SamplingParams(max_tokens=6, temperature=0.8, top_k=5, min_p=0.05, seed=i, ignore_eos=True,
                             logprobs=1 if i % 2 else None) if i % 3 else PARAMS for i in range(5)]
    for engine in (fixed, eager):
        engine.load_adapter("a", file)
    want = [o.token_ids for o in eager.generate(random_prompts(5), params, adapters=adapters)]
    assert len(sends) == len(launches) and all(sends)  # one copy an eager step, never an empty one
    sends.clear()
    launches.clear()
    assert [o.token_ids for o in fixed.generate(random_prompts(5), params, adapters=adapters)] == want
    graphs = fixed.stats()["decode_graphs"]
    assert graphs["replays"] == graphs["uploads"] >= PARAMS.max_tokens - 1 and graphs["eager_fallbacks"] == 0
    assert len(sends) + graphs["uploads"] == len(launches)  # the steps with prefill rows ran eagerly
