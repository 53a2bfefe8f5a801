"""An adapter's safetensors file: its header checked and bounded before anything is read
(`check_header`), its tensors read (`read_tensors`), and what its header alone says of its
size and its layout in pages (`read_plan`, no tensor data read: cheap, before a load). Messages
name a tensor only when its key is a LoRA weight's (`tensor_label`): the caller chooses the path."""

from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path
from typing import NamedTuple

import torch

from lorafleet.adapters.heads import HEAD_KEY_RE, header_parts
from lorafleet.adapters.peft_config import MODULE_BLOCK, MODULES, BaseShapes, is_int, unreadable, weights_file
from lorafleet.errors import AdapterError

# An adapter's safetensors header: a few hundred bytes a tensor (70B's 80 layers, all seven
# projections: ~190 KB). Parsing JSON holds the GIL: a header is bounded well below safetensors'
# own 100 MB, so a hostile file cannot stall the threads beside its load.
MAX_HEADER_BYTES = 1 << 20
# The tensor keys PEFT writes for a supported module; only these are quoted in messages. The layer
# index is canonical and short (a huge one would be echoed, and int() refuses over 4300 digits).
KEY_RE = re.compile(
    r"base_model\.model\.model\.layers\.(?P<layer>0|[1-9]\d{0,8})\."
    rf"(?P<module>{'|'.join(re.escape(f'{b}.{m}') for m, b in MODULE_BLOCK.items())})"
    r"\.(?:lora_(?P<ab>A|B)(?:\.(?P<name>[^.]+))?\.(?P<kind>weight|bias)"
    r"|lora_magnitude_vector(?:\.(?P<mname>[^.]+))?(?:\.weight)?)")
EXPECTED_KEY = ("'base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_A.weight' / lora_B, "
                 f"<proj> one of {', '.join(MODULES)}")
ST_DTYPES = {  # safetensors dtype -> bytes per element (floating types only are accepted)
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1,
}
FLOAT_ST_DTYPES = ("F64", "F32", "F16", "BF16")
FLOAT_FORM = f"LoRA weights must be {', '.join(FLOAT_ST_DTYPES[:-1])} or {FLOAT_ST_DTYPES[-1]}"


def tensor_label(key: str) -> str:
    """How a message names the tensor `key`: quoted when it is a LoRA weight key (structure, with
    any adapter name left out), else described, as other text read from the file is never echoed."""
    m = KEY_RE.fullmatch(key) or HEAD_KEY_RE.fullmatch(key)
    if m is None:
        return f"a tensor whose name is not a LoRA weight of a supported module (expected {EXPECTED_KEY})"
    for group in ("name", "mname", "ename"):
        if group in m.re.groupindex and m.group(group) is not None:
            key = f"{key[:m.start(group)]}<adapter name>{key[m.end(group):]}"
    return f"tensor {key!r}"



def check_header(path: Path) -> dict:
    """Checks that `path` is a complete safetensors file; returns its header (without metadata)."""
    not_st = AdapterError(f"{path}: not a safetensors file, or truncated (expected an 8-byte header "
                          "length, a JSON header and the tensor data)")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise not_st
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise AdapterError(f"{path}: its header is over {MAX_HEADER_BYTES >> 20} MiB (an adapter's header "
                                   "lists its tensors in a few hundred bytes each)")
            if n < 2 or 8 + n > size:
                raise not_st
            raw = f.read(n)
    except OSError:
        raise unreadable(path) from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # the parser's text would quote the file
        header = None
    if not isinstance(header, dict):
        raise AdapterError(f"{path}: malformed safetensors header (expected a UTF-8 JSON object)")
    data_len = size - 8 - n
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        malformed = AdapterError(f"{path}: {tensor_label(name)}: malformed header entry (expected dtype, "
                                 "shape and data_offsets)")
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise malformed from None
        if not (isinstance(dtype, str) and dtype in ST_DTYPES):
            raise AdapterError(f"{path}: {tensor_label(name)}: unknown dtype ({FLOAT_FORM})")
        if not (isinstance(shape, list) and all(is_int(d) and d >= 0 for d in shape)
                and is_int(begin) and is_int(end) and 0 <= begin <= end):
            raise malformed
        if end > data_len:
            raise AdapterError(f"{path}: {tensor_label(name)}: its data runs past the end of the file "
                               "(truncated)")
        if end - begin != math.prod(shape) * ST_DTYPES[dtype]:
            raise AdapterError(f"{path}: {tensor_label(name)}: byte range does not match its dtype and shape")
        tensors[name] = info
    return tensors


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    header = check_header(path)
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            if set(keys) != set(header):
                raise AdapterError(f"{path}: malformed safetensors file (tensor list disagrees with header)")
            for k in keys:
                out[k] = f.get_tensor(k)
    except AdapterError:
        raise
    except Exception:  # safetensors raises SafetensorError and friends; their text may quote the file
        raise AdapterError(f"{path}: malformed safetensors file (expected tensors laid out as its "
                           "header says, without overlaps)") from None
    return out


class HeaderPlan(NamedTuple):
    numel: int                                 # elements of all its tensors: for a valid adapter, its A and B matrices
    ranks: dict[tuple[int, str], int]          # (layer, module) -> rank, from the lora_A shapes
    posts: dict[tuple[int, str], str]          # (layer, module) -> "dora" (a magnitude vector) or "bias" (a lora_B bias)
    heads: dict[str, tuple[int, int]]          # the embedding's and LM head's parts (`adapters/heads.py`) -> (rows, width)


def read_plan(path: str | Path, base: BaseShapes) -> HeaderPlan:
    """The adapter's size and what its layout in pages will need, from its weights file's header
    alone (read once; the data is not read)."""
    header = check_header(weights_file(Path(path)))
    ranks: dict[tuple[int, str], int] = {}
    posts: dict[tuple[int, str], str] = {}
    for key, info in header.items():
        m = KEY_RE.fullmatch(key)
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
