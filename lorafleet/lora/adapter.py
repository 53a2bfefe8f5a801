"""Parse and validate a Hugging Face PEFT LoRA adapter folder against a base model's shapes.

An adapter folder holds `adapter_config.json` and `adapter_model.safetensors`. `load_adapter`
checks both against a `BaseShapes` and returns plain per-(layer, module) tensors plus the scale
PEFT would apply, ready for the engine to copy into its page pool. Everything an adapter author
can get wrong is refused with an `AdapterError` whose message names the file, tensor or field and
the form expected. The caller chooses the path, so messages quote nothing read from the files
but structure: a tensor's name only when it is a LoRA weight key, and a LoRA weight's shape
beside the one the base expects (a few integers; without them a mismatch cannot be told from
another), never values, text or dtypes.

PEFT semantics mirrored here (peft 0.21, `tuners/tuners_utils.py::check_target_module_exists`,
`utils/other.py::get_pattern_key`, `tuners/lora/model.py::_create_and_replace`,
`tuners/lora/layer.py::update_layer`):

* `target_modules` as a list: a module is targeted when its full name equals an item or ends with
  "." + item; `layers_to_transform` (with `layers_pattern`) then filters by layer index, but only
  for the "ends with" case. As a string: a regex full-matched against the full name
  (`layers_to_transform` is ignored, as in PEFT), or "all-linear" (any case): every projection.
* `exclude_modules`: a regex string (full match) or a list (equal, or ends with "." + item).
* `rank_pattern` / `alpha_pattern`: the first key, in file order, for which
  `re.match(rf"(.*\\.)?({key})$", full_name)` succeeds gives that module's r / lora_alpha.
* scale = lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`.
* `lora_bias`: lora_B has a bias b_B ([out]), so the delta is scale * (B A x + b_B): it is served
  as the module's epilogue (`memory/layout.py`), c = scale * b_B, g = 1.
* `use_dora` (DoRA, Liu et al. 2024; PEFT's `DoraLinearLayer`): each module has a magnitude m
  ([out], `lora_magnitude_vector`) and its output is bias + g * (W x + scale * B A x) with
  g = m / ||W + scale * B A|| (the norm of each output row, fp32, the base's weight as served):
  the epilogue g * (out + delta) + c with c = (1 - g) * bias. g needs the base's weights, so it
  is computed where the adapter is loaded (`memory/host_cache.py`), once; here m is kept.
* `fan_in_fan_out`: PEFT stores lora_A / lora_B as `nn.Linear` weights ([r, in] and [out, r])
  whatever this flag says; the flag describes the *base* layer (GPT-2 style Conv1D). For a Llama
  base (nn.Linear) PEFT resets it to False, so it changes nothing here either.

A pickled `adapter_model.bin` is never opened: unpickling runs arbitrary code.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lorafleet.errors import AdapterError
from lorafleet.lora.heads import HEAD_KEY_RE, HEAD_MODULES, HeadWeights, read_heads, vocab_of
from lorafleet.lora.peft_config import (  # noqa: F401  MODULES, BaseShapes, read_adapter_config: re-exported
    CONFIG_NAME, MODULE_BLOCK, MODULES, BaseShapes, Matcher, _is_int, _pattern_key, _read_config, _targeted,
    _unreadable, _weights_file, read_adapter_config, targeted_heads,
)


# An adapter's safetensors header: a few hundred bytes a tensor (70B's 80 layers, all seven
# projections: ~190 KB). Parsing JSON holds the GIL: a header is bounded well below safetensors'
# own 100 MB, so a hostile file cannot stall the threads beside its load.
_MAX_HEADER_BYTES = 1 << 20
# The tensor keys PEFT writes for a supported module; only these are quoted in messages. The layer
# index is canonical and short (a huge one would be echoed, and int() refuses over 4300 digits).
_KEY_RE = re.compile(
    r"base_model\.model\.model\.layers\.(?P<layer>0|[1-9]\d{0,8})\."
    rf"(?P<module>{'|'.join(re.escape(f'{b}.{m}') for m, b in MODULE_BLOCK.items())})"
    r"\.(?:lora_(?P<ab>A|B)(?:\.(?P<name>[^.]+))?\.(?P<kind>weight|bias)"
    r"|lora_magnitude_vector(?:\.(?P<mname>[^.]+))?(?:\.weight)?)")
_EXPECTED_KEY = ("'base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_A.weight' / lora_B, "
                 f"<proj> one of {', '.join(MODULES)}")
_ST_DTYPES = {  # safetensors dtype -> bytes per element (floating types only are accepted)
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1,
}
_FLOAT_ST_DTYPES = ("F64", "F32", "F16", "BF16")
_FLOAT_FORM = f"LoRA weights must be {', '.join(_FLOAT_ST_DTYPES[:-1])} or {_FLOAT_ST_DTYPES[-1]}"


def _tensor(key: str) -> str:
    """How a message names the tensor `key`: quoted when it is a LoRA weight key (structure, with
    any adapter name left out), else described, as other text read from the file is never echoed."""
    m = _KEY_RE.fullmatch(key) or HEAD_KEY_RE.fullmatch(key)
    if m is None:
        return f"a tensor whose name is not a LoRA weight of a supported module (expected {_EXPECTED_KEY})"
    for group in ("name", "mname", "ename"):
        if group in m.re.groupindex and m.group(group) is not None:
            key = f"{key[:m.start(group)]}<adapter name>{key[m.end(group):]}"
    return f"tensor {key!r}"


# ---------------------------------------------------------------------------------------------
# Data classes
# ---------------------------------------------------------------------------------------------


@dataclass
class LoraWeights:
    a: torch.Tensor  # [r, in_features]  (lora_A)
    b: torch.Tensor  # [out_features, r] (lora_B)
    scale: float
    magnitude: torch.Tensor | None = None  # [out_features]: DoRA's m (use_dora)
    bias: torch.Tensor | None = None       # [out_features]: lora_B's bias (lora_bias)

    @property
    def post(self) -> str | None:
        """The module's epilogue: "dora", "bias" or None (plain LoRA)."""
        return "dora" if self.magnitude is not None else "bias" if self.bias is not None else None

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass
class LoraAdapter:
    path: Path
    digest: str
    config: dict
    weights: dict[tuple[int, str], LoraWeights]
    heads: dict[str, HeadWeights] = field(default_factory=dict)  # "model.embed_tokens" / "lm_head" -> (`lora/heads.py`)
    vocab_size: int = 0            # the vocabulary its requests see: its copies' rows, else the base's
    used: frozenset[str] = frozenset()  # the file's tensor keys it serves (`lorafleet verify` names the others)

    @property
    def num_params(self) -> int:
        return sum(w.a.numel() + w.b.numel() + sum(t.numel() for t in (w.magnitude, w.bias) if t is not None)
                   for w in self.weights.values()) + sum(
            t.numel() for w in self.heads.values() for t in (w.copy, w.a, w.b) if t is not None)

    @property
    def posts(self) -> dict[tuple[int, str], str]:
        """(layer, module) -> its epilogue ("dora" or "bias"), for the modules that have one."""
        return {k: w.post for k, w in self.weights.items() if w.post is not None}

    @property
    def ranks(self) -> dict[str, int]:
        """module -> its largest rank over the layers (the embedding's and LM head's LoRA too)."""
        out: dict[str, int] = {}
        for (_, module), w in self.weights.items():
            out[module] = max(out.get(module, 0), w.rank)
        out.update({HEAD_MODULES[full]: w.rank for full, w in self.heads.items() if w.rank})
        return out

    @property
    def saved(self) -> tuple[str, ...]:
        """The modules it holds its own copy of ("embed_tokens", "lm_head")."""
        return tuple(HEAD_MODULES[full] for full, w in self.heads.items() if w.copy is not None)


# ---------------------------------------------------------------------------------------------
# safetensors
# ---------------------------------------------------------------------------------------------


def _check_safetensors_header(path: Path) -> dict:
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
            if n > _MAX_HEADER_BYTES:
                raise AdapterError(f"{path}: its header is over {_MAX_HEADER_BYTES >> 20} MiB (an adapter's header "
                                   "lists its tensors in a few hundred bytes each)")
            if n < 2 or 8 + n > size:
                raise not_st
            raw = f.read(n)
    except OSError:
        raise _unreadable(path) from None
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
        malformed = AdapterError(f"{path}: {_tensor(name)}: malformed header entry (expected dtype, "
                                 "shape and data_offsets)")
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise malformed from None
        if not (isinstance(dtype, str) and dtype in _ST_DTYPES):
            raise AdapterError(f"{path}: {_tensor(name)}: unknown dtype ({_FLOAT_FORM})")
        if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)
                and _is_int(begin) and _is_int(end) and 0 <= begin <= end):
            raise malformed
        if end > data_len:
            raise AdapterError(f"{path}: {_tensor(name)}: its data runs past the end of the file "
                               "(truncated)")
        if end - begin != math.prod(shape) * _ST_DTYPES[dtype]:
            raise AdapterError(f"{path}: {_tensor(name)}: byte range does not match its dtype and shape")
        tensors[name] = info
    return tensors


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    header = _check_safetensors_header(path)
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


def _digest(cfg: dict, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()

    def put(b) -> None:  # bytes, or a tensor's bytes in place: hashlib hashes those without the GIL
        b = memoryview(b)
        h.update(b.nbytes.to_bytes(8, "little"))
        h.update(b)

    put(b"lorafleet-lora-adapter-v1")
    put(json.dumps(cfg, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())
    for name in sorted(tensors):
        t = tensors[name]
        put(name.encode())
        put(str(t.dtype).encode())
        put(json.dumps(list(t.shape)).encode())
        put(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy: a copy holds the GIL
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _key_slot(key: str, base: BaseShapes, path: Path) -> tuple[int, str, str, str | None]:
    """Tensor key -> (layer, module, "A" | "B" | "bias" | "m", adapter name or None); refuses
    anything else."""
    m = _KEY_RE.fullmatch(key)
    if m is None:
        raise AdapterError(f"{path}: holds {_tensor(key)}")
    layer, proj = int(m.group("layer")), m.group("module").split(".")[1]
    if proj not in base.features:
        raise AdapterError(f"{path}: {_tensor(key)} targets {proj!r}, which the base model lacks")
    if layer >= base.num_layers:
        raise AdapterError(f"{path}: {_tensor(key)} is for layer {layer}, but the base model has "
                           f"{base.num_layers} layers")
    part = "m" if m.group("ab") is None else "bias" if m.group("kind") == "bias" else m.group("ab")
    if part == "bias" and m.group("ab") == "A":
        raise AdapterError(f"{path}: holds {_tensor(key)}: lora_A has no bias (PEFT's lora_bias puts it on lora_B)")
    return layer, proj, part, m.group("name") or m.group("mname")


def _scale(cfg: dict, full: str, r: int, match: Matcher) -> float:
    """PEFT's scale for module `full` of rank r: lora_alpha (or its alpha_pattern entry) / r, or
    / sqrt(r) with use_rslora."""
    alpha_pattern = cfg.get("alpha_pattern") or {}
    key = _pattern_key(alpha_pattern, full, match, "alpha_pattern")
    alpha = alpha_pattern[key] if key is not None else cfg.get("lora_alpha", 8)
    return alpha / math.sqrt(r) if cfg.get("use_rslora", False) else alpha / r


def load_adapter(path: str | Path, base: BaseShapes, dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """Load and validate the PEFT LoRA adapter folder `path` against `base`; tensors come back
    contiguous, at `dtype`."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch dtype, got {dtype!r}")
    folder = Path(path)
    cfg = _read_config(folder)
    cfg_path = folder / CONFIG_NAME
    st_path = _weights_file(folder)
    match = Matcher(cfg_path)
    targeted = _targeted(cfg, base, cfg_path, match)
    tensors = _read_tensors(st_path)

    if not tensors:
        raise AdapterError(f"{st_path}: holds no LoRA tensors")
    lora_heads = targeted_heads(cfg, base, cfg_path, match)
    if cfg.get("modules_to_save") and not base.vocab_size:
        raise AdapterError(f"{cfg_path}: modules_to_save: this base does not serve saved modules")

    slots: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    adapter_names: set[str | None] = set()
    head_tensors: dict[str, tuple[str, torch.Tensor]] = {}
    for key in sorted(tensors):
        head = HEAD_KEY_RE.fullmatch(key)
        if head is not None:
            adapter_names.add(next((head.group(g) for g in ("name", "ename", "mname") if head.group(g)), None))
            shown, t = _tensor(key), tensors[key]
            if t.dtype not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
                raise AdapterError(f"{st_path}: {shown} is not floating point ({_FLOAT_FORM})")
            if not bool(torch.isfinite(t).all()):
                raise AdapterError(f"{st_path}: {shown} holds non-finite values (NaN or Inf)")
            head_tensors[key] = (shown, t)
            continue
        layer, proj, ab, name = _key_slot(key, base, st_path)
        adapter_names.add(name)
        if len(adapter_names) > 1:
            raise AdapterError(f"{st_path}: tensor keys carry several adapter names (expected one "
                               "adapter per file: the same '.lora_A.<name>.weight' throughout, or none)")
        shown = _tensor(key)
        full = f"model.layers.{layer}.{MODULE_BLOCK[proj]}.{proj}"
        if full not in targeted:
            raise AdapterError(f"{st_path}: {shown} is for module {full!r}, which {CONFIG_NAME} "
                               "does not target (target_modules, exclude_modules, layers_to_transform)")
        t = tensors[key]
        if t.dtype not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
            raise AdapterError(f"{st_path}: {shown} is not floating point ({_FLOAT_FORM})")
        if ab in ("m", "bias"):
            field = "use_dora" if ab == "m" else "lora_bias"
            if not cfg.get(field, False):
                raise AdapterError(f"{st_path}: {shown} is present but {CONFIG_NAME}'s {field} is not true")
            if t.dim() != 1:
                raise AdapterError(f"{st_path}: {shown} is not a vector (expected [out_features])")
        elif t.dim() != 2:
            raise AdapterError(f"{st_path}: {shown} is not a 2-D matrix (expected [r, in_features] "
                               "for lora_A, [out_features, r] for lora_B)")
        if not bool(torch.isfinite(t).all()):
            raise AdapterError(f"{st_path}: {shown} holds non-finite values (NaN or Inf)")
        slot = slots.setdefault((layer, proj), {})
        slot[ab] = (key, t)

    digest = _digest(cfg, tensors)
    rank_pattern = cfg.get("rank_pattern") or {}
    weights: dict[tuple[int, str], LoraWeights] = {}
    for full, (layer, proj) in sorted(targeted.items(), key=lambda kv: (kv[1][0], MODULES.index(kv[1][1]))):
        if (layer, proj) not in slots:
            raise AdapterError(f"{st_path}: no lora_A/lora_B tensors for {full!r}, which "
                               f"{CONFIG_NAME} targets")
        slot = slots[(layer, proj)]
        for have, miss in (("A", "B"), ("B", "A")):
            if have in slot and miss not in slot:
                raise AdapterError(f"{st_path}: {_tensor(slot[have][0])} has no matching lora_{miss}")
        (a_key, a), (b_key, b) = slot["A"], slot["B"]
        fin, fout = base.features[proj]
        if a.shape[1] != fin:
            raise AdapterError(f"{st_path}: {_tensor(a_key)}: in_features does not match the base "
                               f"{proj}: its shape is {list(a.shape)}, expected [r, {fin}]")
        if b.shape[0] != fout:
            raise AdapterError(f"{st_path}: {_tensor(b_key)}: out_features does not match the base "
                               f"{proj}: its shape is {list(b.shape)}, expected [{fout}, r]")
        rank = int(a.shape[0])
        if b.shape[1] != rank:
            raise AdapterError(f"{st_path}: rank mismatch: {_tensor(a_key)} and {_tensor(b_key)} "
                               f"differ in rank: shapes {list(a.shape)} and {list(b.shape)}, expected [r, {fin}] and "
                               f"[{fout}, r] with the same r")
        post = {}
        for part, field in (("m", "use_dora"), ("bias", "lora_bias")):
            if cfg.get(field, False) and part not in slot:
                what = "lora_magnitude_vector" if part == "m" else "lora_B bias"
                raise AdapterError(f"{st_path}: no {what} for {full!r}, which {CONFIG_NAME}'s {field} asks for")
            if part in slot:
                key, t = slot[part]
                if t.shape[0] != fout:
                    raise AdapterError(f"{st_path}: {_tensor(key)}: its length does not match the base "
                                       f"{proj}'s out_features: its shape is {list(t.shape)}, expected [{fout}]")
                post[part] = t
        r_key = _pattern_key(rank_pattern, full, match)
        r = rank_pattern[r_key] if r_key is not None else cfg["r"]
        if rank != r:
            where = f"rank_pattern entry matching {full!r}" if r_key is not None else "r"
            raise AdapterError(f"{st_path}: {_tensor(a_key)}: its rank (rows) differs from "
                               f"{CONFIG_NAME}'s {where}")
        scale = _scale(cfg, full, r, match)
        a_out = a.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)
        b_out = b.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)
        post = {part: t.to(dtype=dtype, copy=True) for part, t in post.items()}
        for key, t in ((a_key, a_out), (b_key, b_out), *((slot[p][0], t) for p, t in post.items())):
            if not bool(torch.isfinite(t).all()):
                raise AdapterError(f"{st_path}: {_tensor(key)} overflows {dtype}")
        weights[(layer, proj)] = LoraWeights(a=a_out, b=b_out, scale=float(scale), magnitude=post.get("m"),
                                             bias=post.get("bias"))
    if len(adapter_names) > 1:
        raise AdapterError(f"{st_path}: tensor keys carry several adapter names (expected one adapter per file)")

    def rank_of(full: str) -> int:
        key = _pattern_key(rank_pattern, full, match)
        return rank_pattern[key] if key is not None else cfg["r"]

    used = {key for slot in slots.values() for key, _ in slot.values()}  # every part of a targeted module serves
    heads = read_heads(head_tensors, cfg, lora_heads, base, st_path,
                       lambda full, r: _scale(cfg, full, r, match), rank_of, used)
    if not weights and not heads:
        raise AdapterError(f"{st_path}: holds no LoRA tensors for the modules {CONFIG_NAME} targets")
    return LoraAdapter(path=folder, digest=digest, config=cfg, weights=weights, heads=heads,
                       vocab_size=vocab_of(heads, base.vocab_size), used=frozenset(used))
