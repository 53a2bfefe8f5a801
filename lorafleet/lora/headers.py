"""What an adapter's files say from the safetensors header alone, no tensor data read (cheap,
bounded: `lora/adapter.py` checks the header): its size and what its layout in pages will need,
before it is loaded (`memory.residency.inspect`). The header is read and parsed once (`read_plan`).
Keys that are not LoRA tensors of the base are skipped here; loading the adapter refuses them."""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

from lorafleet.lora.adapter import _KEY_RE, BaseShapes, _check_safetensors_header, _weights_file
from lorafleet.lora.heads import header_parts


class HeaderPlan(NamedTuple):
    numel: int                                 # elements of all its tensors: for a valid adapter, its A and B matrices
    ranks: dict[tuple[int, str], int]          # (layer, module) -> rank, from the lora_A shapes
    posts: dict[tuple[int, str], str]          # (layer, module) -> "dora" (a magnitude vector) or "bias" (a lora_B bias)
    heads: dict[str, tuple[int, int]]          # the embedding's and LM head's parts (`lora/heads.py`) -> (rows, width)


def read_plan(path: str | Path, base: BaseShapes) -> HeaderPlan:
    """The adapter's size and what its layout in pages will need, from its weights file's header
    alone (read once; the data is not read)."""
    header = _check_safetensors_header(_weights_file(Path(path)))
    ranks: dict[tuple[int, str], int] = {}
    posts: dict[tuple[int, str], str] = {}
    for key, info in header.items():
        m = _KEY_RE.fullmatch(key)
        if m is None:
            continue
        layer, proj = int(m.group("layer")), m.group("module").split(".")[1]
        if proj not in base.features or layer >= base.num_layers:
            continue
        if m.group("kind") != "weight":
            posts[(layer, proj)] = "bias" if m.group("kind") == "bias" else "dora"
        elif m.group("ab") == "A" and len(info["shape"]) == 2:
            ranks[(layer, proj)] = int(info["shape"][0])
    return HeaderPlan(sum(math.prod(info["shape"]) for info in header.values()), ranks, posts, header_parts(header))
