"""GGUF LoRA adapters, as llama.cpp's `convert_lora_to_gguf.py` writes them, served as the PEFT
folder they came from: `as_folder(path, base)` converts the file once into a cache folder keyed by
its content and the base's head counts (both decide the folder), and every reader of adapters
(`peft_config`, `adapter`, the store, the engine) reads that folder.

What the file holds, and what becomes of it:
- `general.type` "adapter", `adapter.type` "lora" (anything else is refused, naming it), and
  `adapter.lora.alpha`: PEFT's `lora_alpha`. llama.cpp scales each module by alpha / its rank, as
  PEFT does with a rank per module (`rank_pattern`); an alpha of 0 means a scale of 1 there, so it
  becomes that module's rank (`alpha_pattern`).
- Tensors `<base tensor>.lora_a` [r, in] and `.lora_b` [out, r] (GGUF's dimensions reversed)
  on the attention and MLP projections and the output (`lm_head`), in F32, F16, BF16 or Q8_0
  (dequantized exactly). llama.cpp's converter permutes the rows of the llama architecture's Q
  and K weights, so it permutes their `lora_b` rows too: undone with the base's head counts. The
  embedding's LoRA and the norms mergekit adds are refused, naming the tensor.
- `adapter.alora.invocation_tokens` (an array of token ids): an activated LoRA, PEFT's
  `alora_invocation_tokens` (its count bounded before it is read; the folder's checks then apply:
  `adapters/alora.py`).
- `general.base_model.0.name` / `general.basename`, where present: `base_model_name_or_path`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import gguf
import numpy as np
import torch

from lorafleet.adapters.alora import FIELD, MAX_INVOCATION_TOKENS
from lorafleet.errors import AdapterError
from lorafleet.model import gguf_header, gguf_quants

T = gguf.GGMLQuantizationType
FLOATS = {T.F32: np.float32, T.F16: np.float16}
PERMUTED = {"llama"}  # as `model/gguf.py`: the architectures whose Q and K rows llama.cpp permutes
CACHE = "gguf-adapters"  # under $LORAFLEET_HOME/cache
ALORA_KEY = "adapter.alora.invocation_tokens"


def is_gguf(path: str | Path) -> bool:
    """A GGUF file, by its magic (an Ollama blob has no .gguf in its name)."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _reader(path: Path) -> gguf.GGUFReader:
    gguf_header.check(path)  # every count the file declares bounded before the reader believes it
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise AdapterError(f"{path}: unreadable GGUF file ({e})") from None


def _field(reader: gguf.GGUFReader, key: str):
    f = reader.get_field(key)
    return None if f is None else f.contents()


def _invocation(reader: gguf.GGUFReader, path: Path) -> list | None:
    """The aLoRA's invocation tokens as the file holds them (a short array of integers), or None."""
    f = reader.get_field(ALORA_KEY)
    if f is None:
        return None
    if len(f.data) > MAX_INVOCATION_TOKENS:  # counted before the values are read
        raise AdapterError(f"{path}: {ALORA_KEY} holds {len(f.data)} tokens; at most {MAX_INVOCATION_TOKENS}")
    value = f.contents()
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise AdapterError(f"{path}: {ALORA_KEY} must be an array of token ids")
    return value


def is_adapter(path: str | Path) -> bool:
    """Whether a .gguf file says it is an adapter (`general.type`), not a model."""
    return is_gguf(path) and _field(_reader(Path(path)), "general.type") == "adapter"


def config_hint(path: str | Path) -> dict:
    """What the file says of its base, as adapter_config.json would (`base_model_name_or_path`),
    without reading its tensors: for choosing the base to convert it against."""
    reader = _reader(Path(path))
    name = _field(reader, "general.base_model.0.name") or _field(reader, "general.basename")
    return {"base_model_name_or_path": name} if isinstance(name, str) else {}


def _hf_module(name: str) -> str | None:
    """A GGUF tensor's base name (blk.3.attn_q.weight) -> the HF module (model.layers.3.self_attn.q_proj)."""
    from lorafleet.model.gguf import _hf_name

    hf = _hf_name(name)
    return hf[:-len(".weight")] if hf and hf.endswith(".weight") and (hf.endswith("_proj.weight")
                                                                      or hf == "lm_head.weight") else None


def _tensor(path: Path, t) -> torch.Tensor:
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    kind = T(t.tensor_type)
    if kind in FLOATS:
        a = np.asarray(t.data, dtype=FLOATS[kind]).reshape(shape).astype(np.float32)
    elif kind == T.BF16:
        a = (np.ascontiguousarray(t.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    elif kind == T.Q8_0:
        raw = torch.from_numpy(np.ascontiguousarray(t.data).reshape(shape[0], -1))
        return gguf_quants.dequantize(raw, kind)
    else:
        raise AdapterError(f"{path}: {t.name} is {kind.name}; a GGUF adapter's tensors are F32, F16, BF16 or Q8_0")
    return torch.from_numpy(np.array(a))


def convert(path: str | Path, out: Path, heads: tuple[int, int] | None) -> None:
    """The GGUF adapter at `path` as a PEFT folder in `out` (adapter_config.json and
    adapter_model.safetensors). `heads`: the base's (attention heads, KV heads), needed to undo
    llama.cpp's Q/K row permutation."""
    from safetensors.torch import save_file

    path = Path(path)
    reader = _reader(path)
    if _field(reader, "general.type") != "adapter":
        raise AdapterError(f"{path}: a GGUF model, not an adapter (general.type is "
                           f"{_field(reader, 'general.type')!r}); serve it as the base")
    kind = _field(reader, "adapter.type")
    if kind != "lora":
        raise AdapterError(f"{path}: a GGUF adapter of type {kind!r}; lorafleet serves LoRA adapters (\"lora\")")
    invocation = _invocation(reader, path)
    alpha = _field(reader, "adapter.lora.alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not np.isfinite(alpha) or alpha < 0:
        raise AdapterError(f"{path}: adapter.lora.alpha is {alpha!r}; it must be a finite number >= 0")
    arch = _field(reader, "general.architecture")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        stem, _, part = t.name.rpartition(".")
        module = _hf_module(stem)
        if part not in ("lora_a", "lora_b") or module is None:
            raise AdapterError(f"{path}: tensor {t.name} is not the LoRA of a projection or the output lorafleet "
                               "serves (an embedding's LoRA and norms are not)")
        pairs.setdefault(module, {})[part] = _tensor(path, t)
    if not pairs:
        raise AdapterError(f"{path}: the GGUF adapter holds no LoRA tensor")
    tensors, ranks = {}, {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"lora_a", "lora_b"}:
            raise AdapterError(f"{path}: {module} has {', '.join(ab)} but not both lora_a and lora_b")
        a, b = ab["lora_a"], ab["lora_b"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{path}: {module}'s lora_a {list(a.shape)} and lora_b {list(b.shape)} do not share "
                               "a rank")
        if arch in PERMUTED and module.endswith(("q_proj", "k_proj")):
            if heads is None:
                raise AdapterError(f"{path}: undoing llama.cpp's Q/K row order needs the base's head counts")
            n = heads[0] if module.endswith("q_proj") else heads[1]
            if b.shape[0] % (2 * n):
                raise AdapterError(f"{path}: {module}'s lora_b has {b.shape[0]} rows, not a multiple of 2 x {n} heads")
            b = b.reshape(n, b.shape[0] // n // 2, 2, -1).transpose(1, 2).reshape(b.shape)
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
        ranks[module] = int(a.shape[0])
    r = max(ranks.values(), key=list(ranks.values()).count)
    config = {"peft_type": "LORA", "r": r, "lora_alpha": float(alpha) or r, "target_modules": sorted(
        {m.rsplit(".", 1)[1] for m in ranks}), "bias": "none", "fan_in_fan_out": False,
        "rank_pattern": {m: k for m, k in ranks.items() if k != r},
        "alpha_pattern": {m: k for m, k in ranks.items() if k != r} if not alpha else {},
        "base_model_name_or_path": _field(reader, "general.base_model.0.name") or _field(reader, "general.basename"),
        **({FIELD: invocation} if invocation is not None else {})}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


_converted: dict[tuple, Path] = {}  # (file identity, heads) -> folder: the engine thread never hashes twice
_lock = threading.Lock()


def as_folder(path: str | Path, heads: tuple[int, int] | None) -> Path:
    """`path` itself unless it is a GGUF adapter; then its PEFT folder, converted once into
    $LORAFLEET_HOME/cache/gguf-adapters/<sha256 of the file and the heads> (written beside and
    renamed into place, so a killed conversion leaves nothing a reader takes)."""
    from lorafleet.paths import home

    path = Path(path)
    if not is_gguf(path):
        return path
    st = path.stat()
    identity = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, heads)
    with _lock:
        if identity in _converted and _converted[identity].is_dir():
            return _converted[identity]
    digest = hashlib.sha256(repr(heads).encode())
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    folder = home() / "cache" / CACHE / digest.hexdigest()[:32]
    if not folder.is_dir():
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
        try:
            convert(path, tmp, heads)
            try:
                os.rename(tmp, folder)
            except OSError:  # another conversion of the same file won the race: its folder is the same
                if not folder.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    with _lock:
        _converted[identity] = folder
    return folder
