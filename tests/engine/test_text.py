"""Text in, text out: tokenization, incremental detokenization, stop strings, chat templates."""

from __future__ import annotations

import pytest

from lorafleet import Engine, SamplingParams
from tests.fixtures import build_chat_model, stepping

FREE = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine(build_chat_model(tmp_path_factory.mktemp("chat")), pool_bytes=4 << 20)


def stream(engine, prompt, params):
    rid = engine.add_request(prompt, params)
    deltas, last = [], None
    for outs in stepping(engine):
        for out in outs:
            assert out.request_id == rid
            deltas.append(out.new_text)
            last = out
    return deltas, last


def test_text_prompts_are_tokenized_and_outputs_detokenized(engine):
    out = engine.generate(["hello world"], FREE)[0]
    assert out.prompt_token_ids == engine.tokenizer.encode("hello world")
    assert out.prompt_token_ids[0] == engine.tokenizer.bos_token_id
    assert out.text == engine.tokenizer.decode(out.token_ids)
    assert len(out.token_ids) == 24


def test_streamed_text_deltas_add_up_to_the_final_text(engine):
    deltas, last = stream(engine, "héllo wörld", FREE)
    assert "".join(deltas) == last.text  # (no split characters: tests/unit/test_tokenizer.py)
    assert len(deltas) == 24


def test_a_stop_string_ends_the_request_and_is_cut_from_the_text(engine):
    free = engine.generate(["the quick"], FREE)[0].text
    assert len(free) > 8
    stop = free[4:7]
    first = free.find(stop)
    out = engine.generate(["the quick"], SamplingParams(max_tokens=24, temperature=0.0,
                                                       ignore_eos=True, stop=[stop, "never-seen"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == free[:first]
    kept = engine.generate(["the quick"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                        stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.text == free[:first + len(stop)]
    deltas, last = stream(engine, "the quick", SamplingParams(max_tokens=24, temperature=0.0,
                                                              ignore_eos=True, stop=[stop]))
    assert "".join(deltas) == last.text == free[:first]


def test_chat_template_renders_and_generates(engine):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    text = engine.tokenizer.apply_chat_template(messages)
    assert text.endswith("<|im_start|>assistant\n")
    ids = engine.tokenizer.apply_chat_template(messages, tokenize=True)
    out = engine.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_eos_from_the_tokenizer_config_stops_generation(engine):
    assert engine.tokenizer.token_to_id("</s>") in engine.outputs.eos_token_ids
