"""What an adapter's files say from the safetensors header alone, no tensor data read (cheap,
bounded: `lora/adapter.py` checks the header): its size and what its layout in pages will need,
before it is loaded (`memory.residency.inspect`). Keys that are not LoRA tensors of the base are
skipped here; loading the adapter refuses them."""

from __future__ import annotations

import math
from pathlib import Path

from lorafleet.lora.adapter import _KEY_RE, BaseShapes, _check_safetensors_header, _weights_file
from lorafleet.lora.heads import header_parts


def weights_numel(path: str | Path) -> int:
    """Elements of all tensors in the adapter's safetensors file, from its header alone (cheap:
    the data is not read). For a valid adapter, the size of its A and B matrices."""
    header = _check_safetensors_header(_weights_file(Path(path)))
    return sum(math.prod(info["shape"]) for info in header.values())


def header_heads(path: str | Path) -> dict[str, tuple[int, int]]:
    """The embedding's and LM head's parts (`lora/heads.py`) -> (rows, width), from the
    safetensors header alone: what they take in pages."""
    return header_parts(_check_safetensors_header(_weights_file(Path(path))))


def header_ranks(path: str | Path, base: BaseShapes) -> dict[tuple[int, str], int]:
    """(layer, module) -> rank, from the lora_A shapes in the adapter's safetensors header alone
    (cheap: the data is not read): what its layout in pages will need. Keys that are not LoRA
    weights of the base are skipped here; loading the adapter refuses them."""
    header = _check_safetensors_header(_weights_file(Path(path)))
    ranks: dict[tuple[int, str], int] = {}
    for key, info in header.items():
        m = _KEY_RE.fullmatch(key)
        if m is None or m.group("ab") != "A" or m.group("kind") != "weight" or len(info["shape"]) != 2:
            continue
        layer, proj = int(m.group("layer")), m.group("module").split(".")[1]
        if proj in base.features and layer < base.num_layers:
            ranks[(layer, proj)] = int(info["shape"][0])
    return ranks


def header_posts(path: str | Path, base: BaseShapes) -> dict[tuple[int, str], str]:
    """(layer, module) -> "dora" (a lora_magnitude_vector) or "bias" (a lora_B bias), from the
    safetensors header alone: the modules whose layout holds an epilogue. As `header_ranks`,
    keys that are not LoRA tensors of the base are skipped (loading refuses them)."""
    header = _check_safetensors_header(_weights_file(Path(path)))
    posts: dict[tuple[int, str], str] = {}
    for key in header:
        m = _KEY_RE.fullmatch(key)
        if m is None or m.group("kind") == "weight":
            continue
        layer, proj = int(m.group("layer")), m.group("module").split(".")[1]
        if proj in base.features and layer < base.num_layers:
            posts[(layer, proj)] = "bias" if m.group("kind") == "bias" else "dora"
    return posts
