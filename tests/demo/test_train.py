"""`python -m lorafleet.demo.train` (run by hand for the real fleet, ~1 h) still works: two steps
of each phase write a base and adapters that lorafleet, transformers and peft all load."""

from __future__ import annotations

import pytest

import json

from lorafleet import Engine, SamplingParams
from lorafleet.demo.skills import SKILLS
from lorafleet.demo.train import main


@pytest.mark.heavy  # a whole training run (short)
def test_the_training_script_writes_a_loadable_fleet(tmp_path, capsys):
    main(["--out", str(tmp_path), "--base-steps", "2", "--adapter-steps", "2", "--batch", "4",
          "--adapters", "upper", "reverse"])
    assert "done in" in capsys.readouterr().out
    assert {p.name for p in tmp_path.iterdir()} == {"demo-base", "upper", "reverse", "training.json"}
    record = json.loads((tmp_path / "training.json").read_text())
    assert record["base"]["steps"] == 2 and set(record["adapters"]) == {"upper", "reverse"}
    for name in ("upper", "reverse"):
        cfg = json.loads((tmp_path / name / "adapter_config.json").read_text())
        assert cfg["r"] == SKILLS[name].rank and cfg["base_model_name_or_path"] == "demo-base"
    engine = Engine(tmp_path / "demo-base", pool_bytes=16 << 20)
    try:
        engine.load_adapter("reverse", tmp_path / "reverse")
        out = engine.generate(["<|user|>abc<|end|><|assistant|>"], SamplingParams(max_tokens=3, temperature=0.0),
                              ["reverse"])[0]
        assert len(out.token_ids) >= 1  # untrained: any answer, but served
    finally:
        engine.close()
