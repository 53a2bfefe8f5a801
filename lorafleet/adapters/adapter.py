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
  as the module's epilogue (`adapters/layout.py`), c = scale * b_B, g = 1.
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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lorafleet.errors import AdapterError
from lorafleet.adapters.alora import invocation_tokens
from lorafleet.adapters.heads import HEAD_KEY_RE, HEAD_MODULES, HeadWeights, read_heads, vocab_of
from lorafleet.adapters.peft_config import (  # noqa: F401  MODULES, BaseShapes, read_adapter_config: re-exported
    CONFIG_NAME, MODULE_BLOCK, MODULES, BaseShapes, Matcher, pattern_key, read_config, read_adapter_config,
    targeted_heads, targeted_modules, weights_file,
)
from lorafleet.adapters.weights_file import FLOAT_FORM, KEY_RE, read_tensors, tensor_label


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
    heads: dict[str, HeadWeights] = field(default_factory=dict)  # "model.embed_tokens" / "lm_head" -> (`adapters/heads.py`)
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
    def invocation(self) -> tuple[int, ...] | None:
        """Its aLoRA invocation sequence (`adapters/alora.py`); None: plain LoRA."""
        return invocation_tokens(self.config)

    @property
    def saved(self) -> tuple[str, ...]:
        """The modules it holds its own copy of ("embed_tokens", "lm_head")."""
        return tuple(HEAD_MODULES[full] for full, w in self.heads.items() if w.copy is not None)


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
    m = KEY_RE.fullmatch(key)
    if m is None:
        raise AdapterError(f"{path}: holds {tensor_label(key)}")
    layer, proj = int(m.group("layer")), m.group("module").split(".")[1]
    if proj not in base.features:
        raise AdapterError(f"{path}: {tensor_label(key)} targets {proj!r}, which the base model lacks")
    if layer >= base.num_layers:
        raise AdapterError(f"{path}: {tensor_label(key)} is for layer {layer}, but the base model has "
                           f"{base.num_layers} layers")
    part = "m" if m.group("ab") is None else "bias" if m.group("kind") == "bias" else m.group("ab")
    if part == "bias" and m.group("ab") == "A":
        raise AdapterError(f"{path}: holds {tensor_label(key)}: lora_A has no bias (PEFT's lora_bias puts it on lora_B)")
    return layer, proj, part, m.group("name") or m.group("mname")


def _scale(cfg: dict, full: str, r: int, match: Matcher) -> float:
    """PEFT's scale for module `full` of rank r: lora_alpha (or its alpha_pattern entry) / r, or
    / sqrt(r) with use_rslora."""
    alpha_pattern = cfg.get("alpha_pattern") or {}
    key = pattern_key(alpha_pattern, full, match, "alpha_pattern")
    alpha = alpha_pattern[key] if key is not None else cfg.get("lora_alpha", 8)
    return alpha / math.sqrt(r) if cfg.get("use_rslora", False) else alpha / r


def _checked(st_path: Path, shown: str, t: torch.Tensor) -> torch.Tensor:
    """`t` when it is floating point and finite; an AdapterError naming it otherwise."""
    if t.dtype not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        raise AdapterError(f"{st_path}: {shown} is not floating point ({FLOAT_FORM})")
    if not bool(torch.isfinite(t).all()):
        raise AdapterError(f"{st_path}: {shown} holds non-finite values (NaN or Inf)")
    return t


Slot = dict[str, tuple[str, torch.Tensor]]  # "A" | "B" | "m" | "bias" -> (key, tensor) of one module


def _sort_tensors(tensors: dict[str, torch.Tensor], cfg: dict, base: BaseShapes, st_path: Path,
                  targeted: dict[str, tuple[int, str]]) -> tuple[dict[tuple[int, str], Slot], dict[str, tuple[str, torch.Tensor]]]:
    """Every tensor to its module's slot, or to the heads' tensors: each checked for its kind
    (floating, finite, the shape's rank its part has, asked for by the config), one adapter
    name throughout."""
    slots: dict[tuple[int, str], Slot] = {}
    names: set[str | None] = set()
    head_tensors: dict[str, tuple[str, torch.Tensor]] = {}
    for key in sorted(tensors):
        head = HEAD_KEY_RE.fullmatch(key)
        if head is not None:
            names.add(next((head.group(g) for g in ("name", "ename", "mname") if head.group(g)), None))
            shown = tensor_label(key)
            head_tensors[key] = (shown, _checked(st_path, shown, tensors[key]))
        else:
            layer, proj, part, name = _key_slot(key, base, st_path)
            names.add(name)
            shown = tensor_label(key)
            full = f"model.layers.{layer}.{MODULE_BLOCK[proj]}.{proj}"
            if full not in targeted:
                raise AdapterError(f"{st_path}: {shown} is for module {full!r}, which {CONFIG_NAME} "
                                   "does not target (target_modules, exclude_modules, layers_to_transform)")
            t = _checked(st_path, shown, tensors[key])
            if part in ("m", "bias"):
                option = "use_dora" if part == "m" else "lora_bias"
                if not cfg.get(option, False):
                    raise AdapterError(f"{st_path}: {shown} is present but {CONFIG_NAME}'s {option} is not true")
                if t.dim() != 1:
                    raise AdapterError(f"{st_path}: {shown} is not a vector (expected [out_features])")
            elif t.dim() != 2:
                raise AdapterError(f"{st_path}: {shown} is not a 2-D matrix (expected [r, in_features] "
                                   "for lora_A, [out_features, r] for lora_B)")
            slots.setdefault((layer, proj), {})[part] = (key, t)
        if len(names) > 1:
            raise AdapterError(f"{st_path}: tensor keys carry several adapter names (expected one "
                               "adapter per file: the same '.lora_A.<name>.weight' throughout, or none)")
    return slots, head_tensors


def _module_weights(slot: Slot | None, full: str, proj: str, r: int, r_key: str | None, cfg: dict,
                    base: BaseShapes, st_path: Path, dtype: torch.dtype, scale: float) -> LoraWeights:
    """One targeted module's weights, its shapes checked against the base's and its rank against
    the config's, copied contiguous at `dtype` (refused where that overflows)."""
    if slot is None:
        raise AdapterError(f"{st_path}: no lora_A/lora_B tensors for {full!r}, which {CONFIG_NAME} targets")
    for have, miss in (("A", "B"), ("B", "A")):
        if have in slot and miss not in slot:
            raise AdapterError(f"{st_path}: {tensor_label(slot[have][0])} has no matching lora_{miss}")
    (a_key, a), (b_key, b) = slot["A"], slot["B"]
    fin, fout = base.features[proj]
    if a.shape[1] != fin:
        raise AdapterError(f"{st_path}: {tensor_label(a_key)}: in_features does not match the base "
                           f"{proj}: its shape is {list(a.shape)}, expected [r, {fin}]")
    if b.shape[0] != fout:
        raise AdapterError(f"{st_path}: {tensor_label(b_key)}: out_features does not match the base "
                           f"{proj}: its shape is {list(b.shape)}, expected [{fout}, r]")
    if b.shape[1] != a.shape[0]:
        raise AdapterError(f"{st_path}: rank mismatch: {tensor_label(a_key)} and {tensor_label(b_key)} "
                           f"differ in rank: shapes {list(a.shape)} and {list(b.shape)}, expected [r, {fin}] and "
                           f"[{fout}, r] with the same r")
    post = {}
    for part, option in (("m", "use_dora"), ("bias", "lora_bias")):
        if cfg.get(option, False) and part not in slot:
            what = "lora_magnitude_vector" if part == "m" else "lora_B bias"
            raise AdapterError(f"{st_path}: no {what} for {full!r}, which {CONFIG_NAME}'s {option} asks for")
        if part in slot:
            key, t = slot[part]
            if t.shape[0] != fout:
                raise AdapterError(f"{st_path}: {tensor_label(key)}: its length does not match the base "
                                   f"{proj}'s out_features: its shape is {list(t.shape)}, expected [{fout}]")
            post[part] = t
    if a.shape[0] != r:
        where = f"rank_pattern entry matching {full!r}" if r_key is not None else "r"
        raise AdapterError(f"{st_path}: {tensor_label(a_key)}: its rank (rows) differs from "
                           f"{CONFIG_NAME}'s {where}")
    a_out = a.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)
    b_out = b.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)
    post = {part: t.to(dtype=dtype, copy=True) for part, t in post.items()}
    for key, t in ((a_key, a_out), (b_key, b_out), *((slot[p][0], t) for p, t in post.items())):
        if not bool(torch.isfinite(t).all()):
            raise AdapterError(f"{st_path}: {tensor_label(key)} overflows {dtype}")
    return LoraWeights(a=a_out, b=b_out, scale=float(scale), magnitude=post.get("m"), bias=post.get("bias"))


def load_adapter(path: str | Path, base: BaseShapes, dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """Load and validate the PEFT LoRA adapter folder `path` against `base`; tensors come back
    contiguous, at `dtype`: the config read, the tensors sorted to their modules, each targeted
    module's weights checked and built, then the embedding's and LM head's parts."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch dtype, got {dtype!r}")
    folder = Path(path)
    cfg = read_config(folder)
    cfg_path = folder / CONFIG_NAME
    st_path = weights_file(folder)
    match = Matcher(cfg_path)
    targeted = targeted_modules(cfg, base, cfg_path, match)
    tensors = read_tensors(st_path)
    if not tensors:
        raise AdapterError(f"{st_path}: holds no LoRA tensors")
    lora_heads = targeted_heads(cfg, base, cfg_path, match)
    if cfg.get("modules_to_save") and not base.vocab_size:
        raise AdapterError(f"{cfg_path}: modules_to_save: this base does not serve saved modules")
    slots, head_tensors = _sort_tensors(tensors, cfg, base, st_path, targeted)
    digest = _digest(cfg, tensors)
    rank_pattern = cfg.get("rank_pattern") or {}

    def rank_of(full: str) -> tuple[int, str | None]:
        key = pattern_key(rank_pattern, full, match)
        return (rank_pattern[key] if key is not None else cfg["r"]), key

    weights: dict[tuple[int, str], LoraWeights] = {}
    for full, (layer, proj) in sorted(targeted.items(), key=lambda kv: (kv[1][0], MODULES.index(kv[1][1]))):
        r, r_key = rank_of(full)
        weights[(layer, proj)] = _module_weights(slots.get((layer, proj)), full, proj, r, r_key, cfg, base,
                                                 st_path, dtype, _scale(cfg, full, r, match))
    used = {key for slot in slots.values() for key, _ in slot.values()}  # every part of a targeted module serves
    heads = read_heads(head_tensors, cfg, lora_heads, base, st_path,
                       lambda full, r: _scale(cfg, full, r, match), lambda full: rank_of(full)[0], used)
    if not weights and not heads:
        raise AdapterError(f"{st_path}: holds no LoRA tensors for the modules {CONFIG_NAME} targets")
    return LoraAdapter(path=folder, digest=digest, config=cfg, weights=weights, heads=heads,
                       vocab_size=vocab_of(heads, base.vocab_size), used=frozenset(used))
