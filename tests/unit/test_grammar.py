"""Structured output's grammars (`lorafleet/model/grammar.py`) on the demo base's tokenizer: a
constraint's text decides its output (random logits, many seeds, every output matches), the mask
forbids exactly what the matcher refuses, a compiled grammar is reused, and what llguidance cannot
honour is refused with the field and the feature named."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from lorafleet.demo import default_fleet
from lorafleet.errors import InvalidRequestError
from lorafleet.model import grammar
from lorafleet.model.grammar import Constraint
from lorafleet.model.tokenizer import Tokenizer

pytestmark = pytest.mark.unit

WIDTH = 300  # the logits' width: past the tokenizer's 261 ids, as a padded LM head is
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                          "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                                          "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(default_fleet().model)


def run(tok, c: Constraint, seed: int, max_tokens: int = 80) -> tuple[str, bool]:
    """Random logits, masked, argmax: the text and whether the grammar finished."""
    m = grammar.compile(c, tok, WIDTH).matcher()
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(max_tokens):
        logits = torch.randn(2, WIDTH, generator=g)
        grammar.apply_masks(logits, [(1, m)])
        t = int(logits[1].argmax())
        if t in tok.eos_token_ids:
            break
        assert m.accept(t) is None
        out.append(t)
        if m.done:
            break
    return tok.decode(out), m.done


@pytest.mark.parametrize("seed", range(12))
def test_every_output_matches_its_constraint(tok, seed):
    text, _ = run(tok, Constraint.of("json_schema", SCHEMA, "response_format"), seed)
    value = json.loads(text)
    assert list(value)[:2] == ["name", "n"]  # the schema's order, as written
    assert set(value) <= set(SCHEMA["properties"]) and {"name", "n", "ok"} <= set(value)
    assert len(value["name"]) <= 6 and 0 <= value["n"] <= 999 and isinstance(value["ok"], bool)
    assert set(value.get("tags", [])) <= {"a", "b"}
    text, done = run(tok, Constraint.of("regex", r"[a-z]{3}-[0-9]{2}", "guided_regex"), seed)
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", text) and done
    text, done = run(tok, Constraint.of("choice", ["yes", "no", "maybe"], "guided_choice"), seed)
    assert text in ("yes", "no", "maybe") and done
    text, done = run(tok, Constraint.of("grammar", 'root ::= "x" [0-9] [0-9]?', "guided_grammar"), seed)
    assert re.fullmatch(r"x[0-9][0-9]?", text)


def test_any_json_object(tok):
    text, _ = run(tok, Constraint("json_schema", grammar.ANY_JSON_OBJECT), 0, max_tokens=400)
    assert isinstance(json.loads(text), dict)


def test_the_mask_forbids_exactly_what_the_matcher_refuses(tok):
    """Token by token along an answer: each allowed token is accepted by a copy of the matcher, each
    forbidden one refused, and ids past the tokenizer's vocabulary are never allowed."""
    g = grammar.compile(Constraint.of("json_schema", SCHEMA, "response_format"), tok, WIDTH)
    m, chosen = g.matcher(), []
    for step in range(6):
        logits = torch.zeros(1, WIDTH)
        grammar.apply_masks(logits, [(0, m)])
        allowed = torch.isfinite(logits[0]).nonzero()[:, 0].tolist()
        assert allowed and max(allowed) < tok.vocab_size
        for t in range(tok.vocab_size):
            probe = g.matcher()
            assert all(probe.accept(prev) is None for prev in chosen)
            assert (probe.accept(t) is None) == (t in allowed), (step, t)
        chosen.append(allowed[len(allowed) // 2])
        assert m.accept(chosen[-1]) is None


def test_masks_touch_only_their_rows_and_compiled_grammars_are_reused(tok):
    c = Constraint.of("choice", ["yes", "no"], "guided_choice")
    vocab = grammar.vocabulary(tok, WIDTH)
    before = len(vocab._grammars)
    a, b = grammar.compile(c, tok, WIDTH), grammar.compile(Constraint.of("choice", ["yes", "no"], "other"), tok, WIDTH)
    assert len(vocab._grammars) == before + 1 and a._proto is b._proto and grammar.vocabulary(tok, WIDTH) is vocab
    logits = torch.randn(4, WIDTH)
    want = logits.clone()
    grammar.apply_masks(logits, [(2, a.matcher())])
    assert torch.equal(logits[[0, 1, 3]], want[[0, 1, 3]])
    assert torch.isinf(logits[2]).sum() > WIDTH - 10


@pytest.mark.parametrize("kind, value, named", [
    ("json_schema", {"type": "string", "not": {"const": "a"}}, "not"),
    ("json_schema", {"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ("json_schema", {"$ref": "#/$defs/missing"}, "missing"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", [1, 2], "is an object"),
    ("regex", "(", "unclosed group"),
    ("regex", "", "non-empty string"),
    ("choice", [], "non-empty strings"),
    ("choice", ["a", 3], "non-empty strings"),
    ("grammar", "root ::= missing", "Rule 'missing' not found"),
])
def test_what_cannot_be_served_is_refused_naming_it(tok, kind, value, named):
    with pytest.raises(InvalidRequestError, match=re.escape(named)) as e:
        grammar.compile(Constraint.of(kind, value, "structured_outputs.x"), tok, WIDTH)
    assert e.value.param == "structured_outputs.x" and str(e.value).startswith("structured_outputs.x: ")


def test_a_constraint_is_bounded_before_it_is_parsed():
    with pytest.raises(InvalidRequestError, match="over 64 KiB"):
        Constraint.of("regex", "a" * (65 << 10), "guided_regex")
    with pytest.raises(InvalidRequestError, match="1 to 4096"):
        Constraint.of("choice", ["a"] * 4097, "guided_choice")


def test_a_mask_row_too_short_is_refused_before_any_write(tok):
    m = grammar.compile(Constraint.of("choice", ["yes"], "x"), tok, WIDTH).matcher()
    with pytest.raises(ValueError, match="int32 words"):
        m.fill(np.zeros(2, dtype=np.int32))


def test_the_devices_path_masks_as_the_hosts_does(tok, monkeypatch):
    """`apply_on_device` (a GPU's: shifts on the device) run here gives the host path's logits."""
    c = Constraint.of("json_schema", SCHEMA, "response_format")
    matchers = [grammar.compile(c, tok, WIDTH).matcher() for _ in range(3)]
    for m, text in zip(matchers[1:], ('{', '{"')):  # three places in the grammar
        for token in tok.encode(text, add_special_tokens=False):
            assert m.accept(token) is None
    logits = torch.randn(5, WIDTH)
    host, dev = logits.clone(), logits.clone()
    grammar.apply_masks(host, [(0, matchers[0]), (2, matchers[1]), (4, matchers[2])])
    monkeypatch.setattr(grammar, "_apply_on_host", grammar.apply_on_device)
    grammar.apply_masks(dev, [(0, matchers[0]), (2, matchers[1]), (4, matchers[2])])
    assert torch.equal(host, dev) and torch.equal(host[[1, 3]], logits[[1, 3]])
    assert len({tuple(torch.isfinite(host[r]).nonzero()[:, 0].tolist()) for r in (0, 2, 4)}) == 3
