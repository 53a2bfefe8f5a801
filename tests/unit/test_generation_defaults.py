"""A model's generation_config.json gives the sampling defaults a request without its own gets
(as vLLM does): do_sample false means greedy; a request's fields always win; junk is ignored."""

from __future__ import annotations

import json

import pytest

from lorafleet.model.config import generation_defaults
from lorafleet.server.protocol import parse_completion

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("cfg, want", [
    ({"do_sample": False, "temperature": 0.6}, {"temperature": 0.0}),
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 50}, {"temperature": 0.6, "top_p": 0.9, "top_k": 50}),
    ({"temperature": -1, "top_p": 0, "top_k": "x"}, {}),
    ({"bos_token_id": 1}, {}),
])
def test_defaults_from_the_generation_config(tmp_path, cfg, want):
    (tmp_path / "generation_config.json").write_text(json.dumps(cfg))
    assert generation_defaults(tmp_path) == want


def test_no_or_unreadable_generation_config_means_no_defaults(tmp_path):
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert generation_defaults(tmp_path) == {}


def test_a_request_field_beats_the_model_default():
    defaults = {"temperature": 0.0, "top_p": 0.5}
    assert parse_completion({"prompt": "x"}, "base", defaults).params.temperature == 0.0
    assert parse_completion({"prompt": "x"}, "base", defaults).params.top_p == 0.5
    got = parse_completion({"prompt": "x", "temperature": 0.8, "top_p": 1.0}, "base", defaults).params
    assert (got.temperature, got.top_p) == (0.8, 1.0)
    assert parse_completion({"prompt": "x"}, "base").params.temperature == 1.0  # OpenAI's default
