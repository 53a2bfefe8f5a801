"""The bundled demo fleet through the engine: every skill is learned (>= 95% exact on 200 held-out
texts, greedy), the adapters really differ (< 20% on any other skill), and one batch mixing every
skill and the base gives each request what it gets alone. Also: the shipped files are small and
in standard formats (config, safetensors only)."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from lorafleet.demo import BASE_DIR, FLEET_DIR
from lorafleet.demo.evaluate import accuracy, evaluate, fleet_engine, run_greedy
from lorafleet.demo.skills import SKILLS, expected, held_out_texts

TASKS = [None, *SKILLS]  # None: the base, which echoes


@pytest.fixture(scope="module")
def engine():
    eng = fleet_engine()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def answers(engine):
    """Every task on the 200 held-out texts, all 1,600 requests in one continuously batched run."""
    return evaluate(engine, 200)


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t or "base-echo")
def test_each_skill_is_learned(answers, task):
    acc = accuracy(answers[task], task)
    assert acc >= 0.95, f"{task or 'base echo'}: {acc:.1%} exact on the held-out texts"


@pytest.mark.parametrize("skill", SKILLS)
def test_adapters_are_really_different(answers, skill):
    """An adapter's answers are not another skill's answers (nor the base's echo)."""
    for other in TASKS:
        if other == skill:
            continue
        acc = accuracy(answers[skill], other)
        assert acc < 0.20, f"{skill} answers {acc:.1%} like {other or 'echo'}"


def test_the_held_out_texts_are_distinct_and_never_trained_on():
    from lorafleet.demo.train import Data

    texts = held_out_texts(200)
    assert len(set(texts)) == 200
    data = Data(_tokenizer_backend(), seed=0)
    assert not set(data.texts(5000)) & set(texts)


def _tokenizer_backend():
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(BASE_DIR / "tokenizer.json"))


def test_a_batch_mixing_every_skill_matches_each_request_alone(engine):
    """64 requests interleaved (base, upper, rot13, ... base, upper, ...) in one batch: each
    output is token for token what the same request gets alone, and right where that is."""
    texts = held_out_texts(64)
    jobs = [(TASKS[i % len(TASKS)], t) for i, t in enumerate(texts)]
    start = len(engine.step_records())
    mixed = run_greedy(engine, jobs)
    steps = engine.step_records()[start:]
    # one step really held every adapter and the base at once (the count includes the base)
    assert max(s["distinct_adapters"] for s in steps) == len(TASKS)
    right = 0
    for (task, t), out in zip(jobs, mixed):
        alone = run_greedy(engine, [(task, t)])[0]
        assert out.token_ids == alone.token_ids, f"{task}({t!r}): {out.text!r} in the batch, {alone.text!r} alone"
        if alone.text == expected(task, t):
            assert out.text == expected(task, t)
            right += 1
    assert right >= 0.95 * len(jobs)


def test_the_fleet_is_small_and_in_standard_formats():
    files = [p for p in FLEET_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 20 * 2**20
    assert not [p for p in files if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt")], "no pickles"
    base = json.loads((BASE_DIR / "config.json").read_text())
    assert base["architectures"] == ["LlamaForCausalLM"]
    assert json.loads((BASE_DIR / "generation_config.json").read_text())["do_sample"] is False
    ranks, targets = set(), set()
    for name, skill in SKILLS.items():
        cfg = json.loads((FLEET_DIR / name / "adapter_config.json").read_text())
        assert cfg["peft_type"] == "LORA" and cfg["r"] == skill.rank
        assert set(cfg["target_modules"]) == set(skill.targets)
        assert cfg.get("use_dora", False) is skill.dora
        assert (cfg.get("modules_to_save") or []) == list(skill.saves)
        ranks.add(cfg["r"])
        targets.add(frozenset(cfg["target_modules"]))
        with safe_open(FLEET_DIR / name / "adapter_model.safetensors", "pt") as f:
            assert all(".lora_A." in k or ".lora_B." in k or (skill.dora and k.endswith(".lora_magnitude_vector"))
                       or (k == "base_model.model.lm_head.weight" and "lm_head" in skill.saves) for k in f.keys())
    assert len(SKILLS) >= 6 and len(ranks) >= 3 and sum(s.dora for s in SKILLS.values()) == 1  # one DoRA
    assert [s.saves for s in SKILLS.values() if s.saves] == [("lm_head",)]  # one saves its LM head
    assert frozenset(("q_proj", "k_proj", "v_proj", "o_proj")) in targets          # attention only
    assert frozenset(("gate_proj", "up_proj", "down_proj")) in targets             # MLP only


def test_the_prefix_cache_never_serves_one_skill_anothers_kv(engine):
    """Every skill gets the very same prompt tokens (the text alone): served one skill after
    another, each finds the previous skill's blocks of those tokens cached, and must not use
    them. Outputs equal a cacheless engine's; the same skill again does hit its own blocks."""
    from lorafleet.demo.evaluate import chat_prompt

    first = next(iter(SKILLS))
    texts = [t for t in held_out_texts(200) if len(chat_prompt(engine, first, t)) > 16][:16]
    assert len(texts) >= 8  # prompts of a full block and more
    engine.reset_prefix_cache()  # what earlier tests left: every skill's own blocks of these texts
    off = fleet_engine(prefix_cache=False)
    try:
        for task in [*SKILLS, None]:
            jobs = [(task, t) for t in texts]
            before = engine.kv.hit_tokens
            got = [o.token_ids for o in run_greedy(engine, jobs)]
            assert got == [o.token_ids for o in run_greedy(off, jobs)], task
            assert engine.kv.hit_tokens == before, f"{task} reused KV computed under another skill"
        run_greedy(engine, [(first, t) for t in texts])
        assert engine.kv.hit_tokens > before  # its own blocks, from the first round
    finally:
        off.close()
