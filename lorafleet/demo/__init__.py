"""What `lorafleet serve` serves when no MODEL is given.

`default_fleet()` is the one place that decides it. Until the bundled demo fleet exists it
returns the placeholder (a tiny random Llama built locally, see placeholder.py) with no
adapters; the demo fleet replaces the body of this function, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Fleet:
    model: Path                                   # the base model's folder
    name: str                                     # the base's name in `model` fields
    adapters: dict[str, Path] = field(default_factory=dict)  # loaded at start, by name
    placeholder: bool = False                     # outputs are noise: say so in the log


def default_fleet() -> Fleet:
    from lorafleet import paths
    from lorafleet.demo.placeholder import ensure_placeholder

    return Fleet(model=ensure_placeholder(paths.models_dir()), name="placeholder", placeholder=True)
