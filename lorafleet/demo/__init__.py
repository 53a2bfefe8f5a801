"""The bundled demo fleet: what `lorafleet serve` serves when no MODEL is given.

`fleet/demo-base` is a tiny Llama (1.7 M parameters, byte-level tokenizer, chat template) trained
to echo its user turn; `fleet/<skill>` are PEFT LoRA adapters on it, one per skill in
`skills.SKILLS` (uppercase, reverse, rot13, ...), of different ranks and target modules. All of it
is in the formats any Hugging Face model and PEFT adapter folder uses (safetensors), so
`transformers` + `peft` load it too. `train.py` rebuilds it from nothing.

Every answer is checkable: a request served with the wrong adapter, or with none, gives a visibly
different string. That makes the fleet the oracle of the end-to-end tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lorafleet.demo.skills import SKILLS
from lorafleet.errors import ModelLoadError

FLEET_DIR = Path(__file__).parent / "fleet"
BASE_DIR = FLEET_DIR / "demo-base"
BASE_NAME = "demo"  # the base's name in `model` fields


@dataclass(frozen=True)
class Fleet:
    model: Path                                   # the base model's folder
    name: str                                     # the base's name in `model` fields
    adapters: dict[str, Path] = field(default_factory=dict)  # loaded at start, by name


def default_fleet() -> Fleet:
    """The bundled fleet; `ModelLoadError` naming what is missing if the package lost files."""
    adapters = {name: FLEET_DIR / name for name in SKILLS}
    for folder in (BASE_DIR, *adapters.values()):
        if not folder.is_dir():
            raise ModelLoadError(f"the bundled demo fleet is incomplete: {folder} is missing "
                                    "(reinstall lorafleet, or rebuild it: python -m lorafleet.demo.train)")
    return Fleet(model=BASE_DIR, name=BASE_NAME, adapters=adapters)
