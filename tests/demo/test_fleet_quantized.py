"""The demo fleet on a quantized base (issue 51): every skill's exact match on the 200 held-out
texts, greedy, loses at most 1 point with the base in int8 and at most 5 in int4 (adapters in full
precision), as `python -m lorafleet.demo.evaluate --quantize int8|int4` prints it."""

from __future__ import annotations

import pytest

from lorafleet.demo.evaluate import compare
from lorafleet.demo.skills import SKILLS

LOSS = {"int8": 0.01, "int4": 0.05}
HELD_LOSS = 0.01  # adapters held in bf16 (`serve --lora-dtype`): at most 1 point a skill
pytestmark = pytest.mark.heavy  # whole evaluations of the fleet


@pytest.mark.parametrize("scheme", LOSS)
def test_each_skill_loses_at_most_its_scheme_s_points(scheme, capsys):
    rates = compare(200, scheme)
    assert len(rates) == 1 + len(SKILLS)  # the base's echo and every skill
    for task, (full, quantized) in rates.items():
        assert full - quantized <= LOSS[scheme] + 1e-9, f"{task or 'echo'}: {full:.1%} -> {quantized:.1%} in {scheme}"
    assert "points lost" in capsys.readouterr().out


def test_adapters_held_in_bf16_lose_at_most_a_point_a_skill(capsys):
    rates = compare(200, None, "bfloat16")
    assert len(rates) == 1 + len(SKILLS)
    for task, (full, held) in rates.items():
        assert full - held <= HELD_LOSS + 1e-9, f"{task or 'echo'}: {full:.1%} -> {held:.1%} with bf16 adapters"
    assert "adapters bfloat16" in capsys.readouterr().out
