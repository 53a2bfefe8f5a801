"""Structured output in the engine, on the demo fleet: constrained rows (a JSON schema, a choice, a
regex, a grammar) and free rows, different adapters and a mix, greedy and seeded sampling, in the
same steps: every constrained answer matches its constraint and ends when its grammar does, every
free row's answer is the one it gets alone, the steps read late (`async_decode`) give the same
answers, logprobs stay the model's own, and an adapter with its own vocabulary gets masks of it."""

from __future__ import annotations

import json
import re

import pytest

from lorafleet import Engine, SamplingParams
from lorafleet.adapters.mix import Mix
from lorafleet.demo import default_fleet
from lorafleet.errors import InvalidRequestError
from lorafleet.model.grammar import Constraint

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 5},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["word", "n"], "additionalProperties": False}
CHOICES = ["yes", "no", "maybe"]


@pytest.fixture(scope="module")
def fleet():
    return default_fleet()


def engine_for(fleet, **options) -> Engine:
    engine = Engine(fleet.model, pool_bytes=8 << 20, debug_checks=True, **options)
    for name in list(fleet.adapters)[:3]:
        engine.load_adapter(name, fleet.adapters[name])
    return engine


def workload(fleet):
    a, b, c = list(fleet.adapters)[:3]
    mix = Mix.of({c: 1.0})  # the demo adapters serve their own LM heads: a mix of one
    rows = [  # (adapter, params)
        (a, SamplingParams(max_tokens=40, temperature=0, structured=Constraint.of("json_schema", SCHEMA, "t"))),
        (None, SamplingParams(max_tokens=12, temperature=0)),
        (b, SamplingParams(max_tokens=12, temperature=0.9, seed=5, structured=Constraint.of("choice", CHOICES, "t"))),
        (c, SamplingParams(max_tokens=12, temperature=0)),
        (mix, SamplingParams(max_tokens=12, temperature=0, structured=Constraint.of("regex", r"[a-z]{2}-[0-9]", "t"))),
        (a, SamplingParams(max_tokens=12, temperature=0.7, seed=9)),
        (None, SamplingParams(max_tokens=12, temperature=0, logprobs=3,
                              structured=Constraint.of("grammar", 'root ::= "x" [0-9] [0-9]', "t"))),
    ]
    prompts = ["hello world", "the quick brown fox", "hello", "a b c", "jumps over", "lazy dog", "hi"]
    return prompts, [p for _, p in rows], [a for a, _ in rows]


def check_constrained(outs):
    value = json.loads(outs[0].text)
    assert set(value) == {"word", "n"} and len(value["word"]) <= 5 and 0 <= value["n"] <= 99
    assert outs[2].text in CHOICES
    assert re.fullmatch(r"[a-z]{2}-[0-9]", outs[4].text)
    assert re.fullmatch(r"x[0-9][0-9]", outs[6].text)
    assert all(outs[i].finish_reason == "stop" for i in (0, 2, 4, 6))


@pytest.mark.parametrize("async_decode", ["off", "on"])
def test_constrained_and_free_rows_in_the_same_steps(fleet, async_decode):
    prompts, params, adapters = workload(fleet)
    engine = engine_for(fleet, async_decode=async_decode)
    outs = engine.generate(prompts, params, adapters=adapters)
    check_constrained(outs)
    assert engine.constrained == 0 and not engine.has_unfinished()
    alone = engine_for(fleet)
    for i in (1, 3, 5):  # the free rows: what each gets alone
        assert alone.generate([prompts[i]], [params[i]], adapters=[adapters[i]])[0].token_ids == outs[i].token_ids
    if async_decode == "off":
        test_constrained_and_free_rows_in_the_same_steps.want = [o.token_ids for o in outs]
    else:  # the steps read late: the same answers
        assert [o.token_ids for o in outs] == test_constrained_and_free_rows_in_the_same_steps.want


def test_logprobs_of_a_constrained_row_are_the_models_own(fleet):
    """The first token's top logprobs under a grammar equal those of the same request free (the
    mask picks the token, it does not change the distribution reported)."""
    engine = engine_for(fleet)
    free = SamplingParams(max_tokens=1, temperature=0, logprobs=4)
    held = SamplingParams(max_tokens=1, temperature=0, logprobs=4,
                          structured=Constraint.of("choice", ["zz"], "t"))
    a, b = engine.generate(["hello world"] * 2, [free, held])
    assert b.text == "z"
    assert all(b.logprobs[0][t] == pytest.approx(v) for t, v in a.logprobs[0].items() if t != a.token_ids[0])


def test_an_adapter_with_its_own_vocabulary_gets_masks_of_it(fleet, tmp_path):
    """Its grammar is compiled for its own tokenizer at its own width, the base's for the base's;
    a constrained answer under it matches."""
    from tests.engine.test_heads import vocab_adapter

    engine = Engine(fleet.model, pool_bytes=8 << 20)
    engine.load_adapter("v", vocab_adapter(fleet.model, tmp_path / "vocab"))
    c = Constraint.of("regex", r"[a-z]{4}", "t")
    own, base = engine.grammar(c, "v").vocabulary, engine.grammar(c).vocabulary
    assert own is not base and own.width == engine.tokenizer_for("v").vocab_size > base.lt.vocab_size - 1
    out = engine.generate(["hello"], [SamplingParams(max_tokens=8, temperature=0, structured=c)], adapters=["v"])[0]
    assert re.fullmatch(r"[a-z]{4}", out.text) and out.finish_reason == "stop"


def test_a_constraint_refused_fails_only_its_request(fleet):
    engine = engine_for(fleet)
    with pytest.raises(InvalidRequestError, match="Unimplemented keys"):
        engine.add_request("hi", SamplingParams(structured=Constraint.of("json_schema", {"not": {}}, "t")))
    assert engine.constrained == 0 and not engine.requests
    assert engine.generate(["hi"], [SamplingParams(max_tokens=3, temperature=0)])[0].finish_reason == "length"


def random_schema(rng, depth: int = 0, kind: str | None = None) -> dict:
    """A random JSON schema whose every instance is short: bounded strings, integers, arrays,
    enums, booleans and nested objects, some properties optional."""
    kinds = ["string", "integer", "boolean", "enum", "array"] + (["object"] if depth < 2 else [])
    kind = kind or rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2, True, None], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    names = rng.sample(["a", "bb", "id", "kind", "size", "tags", "x", "yz"], rng.randint(1, 4))
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": rng.sample(names, rng.randint(0, len(names))), "additionalProperties": False}


def test_200_random_schemas_give_answers_that_validate(fleet):
    """Batches of 64 rows, each a random schema (under the base or one of three adapters, greedy or
    seeded), beside 8 free rows: every answer completes, parses and validates (jsonschema); the
    free rows get what they get alone."""
    import random

    import jsonschema

    rng = random.Random(7)
    engine = engine_for(fleet, max_num_seqs=72)
    names = [None, *list(fleet.adapters)[:3]]
    free = [SamplingParams(max_tokens=10, temperature=0)] * 8
    alone = [o.token_ids for o in engine.generate(["free row"] * 8, free, adapters=names * 2)]
    checked = 0
    for start in range(0, 200, 64):
        schemas = [random_schema(rng, kind="object" if i % 2 else None)
                   for i in range(min(64, 200 - start))]
        params = [SamplingParams(max_tokens=400, temperature=0 if i % 3 else 0.8, seed=i,
                                 structured=Constraint.of("json_schema", s, "t")) for i, s in enumerate(schemas)]
        outs = engine.generate([f"record {i}" for i in range(len(schemas))] + ["free row"] * 8, params + free,
                               adapters=[names[i % 4] for i in range(len(schemas))] + names * 2)
        for schema, out in zip(schemas, outs):
            assert out.finish_reason == "stop", (schema, out.text)
            jsonschema.validate(json.loads(out.text), schema)
            checked += 1
        assert [o.token_ids for o in outs[len(schemas):]] == alone
    assert checked == 200
