"""PEFT's `adapter_config.json`: what it may say, what lorafleet refuses, and which modules of
the base it targets, mirroring PEFT's own matching rules (`adapter.py` reads the tensors).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.errors import AdapterError

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Llama modules that exist but cannot carry a LoRA here (named so refusals can say so).
_OTHER_BASE_MODULES = ("model.embed_tokens", "lm_head")
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"
_MAX_CONFIG_BYTES = 16 << 20
# init_lora_weights values whose adapters expect a base model rewritten at init time.
_BASE_MUTATING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq", "mica")
# Config fields naming LoRA variants / features whose forward pass is not plain `scale * B @ A @ x`
# or which need more than the LoRA tensors; refused when set to anything truthy.
_UNSUPPORTED_FIELDS = (
    "use_dora", "lora_bias", "use_qalora", "layer_replication", "target_parameters",
    "trainable_token_indices", "alora_invocation_tokens", "use_bdlora", "arrow_config",
    "kasa_config", "monteclora_config",
)


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter is checked against: layer count and each projection's (in, out) features.
    Module full names follow the HF Llama layout: `model.layers.{i}.self_attn.{q,k,v,o}_proj`,
    `model.layers.{i}.mlp.{gate,up,down}_proj`."""

    num_layers: int
    features: dict[str, tuple[int, int]]

    @classmethod
    def from_model_config(cls, cfg: Any) -> BaseShapes:
        """From anything with `num_layers` and `linear_features()` (lorafleet's ModelConfig)."""
        return cls(num_layers=int(cfg.num_layers), features=dict(cfg.linear_features()))

    def module_names(self) -> dict[str, tuple[int, str]]:
        """Full module name -> (layer, module) for every projection the base has."""
        out: dict[str, tuple[int, str]] = {}
        for i in range(self.num_layers):
            for m in MODULES:
                if m in self.features:
                    out[f"model.layers.{i}.{_BLOCK[m]}.{m}"] = (i, m)
        return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _no_duplicate_keys(source: Path):
    def hook(pairs: list[tuple[str, Any]]) -> dict:
        out: dict = {}
        for k, v in pairs:
            if k in out:
                raise AdapterError(f"{source}: duplicate key {k!r} in JSON object")
            out[k] = v
        return out
    return hook


def _folder(path: str | Path) -> Path:
    folder = Path(path)
    if not folder.exists():
        raise AdapterError(f"adapter folder {folder} does not exist")
    if not folder.is_dir():
        raise AdapterError(f"adapter path {folder} is not a folder (expected a folder holding "
                           f"{CONFIG_NAME} and {WEIGHTS_NAME})")
    return folder


def _weights_file(folder: Path) -> Path:
    st = folder / WEIGHTS_NAME
    if st.is_file():
        return st
    if (folder / PICKLE_NAME).exists():
        raise AdapterError(
            f"{folder / PICKLE_NAME}: pickled adapter weights are refused (loading a pickle can run "
            f"arbitrary code); convert the adapter to {WEIGHTS_NAME}")
    raise AdapterError(f"{st}: file missing")


def _regex(pattern: str, where: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise AdapterError(f"{where}: invalid regular expression {pattern!r}: {e}") from None


def _validate_config(cfg: dict, source: Path) -> None:
    def bad(field: str, why: str) -> AdapterError:
        return AdapterError(f"{source}: {field}: {why}")

    peft_type = cfg.get("peft_type")
    if peft_type is None:
        raise bad("peft_type", "missing (expected \"LORA\")")
    if peft_type != "LORA":
        raise bad("peft_type", f"{peft_type!r} is not supported (only \"LORA\")")

    for field in _UNSUPPORTED_FIELDS:
        if cfg.get(field):
            extra = " (DoRA)" if field == "use_dora" else ""
            raise bad(field, f"{cfg[field]!r}: not supported{extra}")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MUTATING_INITS):
        raise bad("init_lora_weights", f"{init!r} adapters need a base model modified at init "
                  "time; convert the adapter to plain LoRA (save_pretrained with "
                  "path_initial_model_for_weight_conversion)")

    bias = cfg.get("bias", "none")
    if bias != "none":
        raise bad("bias", f"{bias!r} is not supported (only \"none\": trained biases are not served)")
    if cfg.get("modules_to_save"):
        raise bad("modules_to_save", f"{cfg['modules_to_save']!r}: fully trained modules are not "
                  "supported (only LoRA deltas)")

    r = cfg.get("r")
    if not _is_int(r) or r <= 0:
        raise bad("r", f"{r!r} must be a positive integer")
    alpha = cfg.get("lora_alpha", 8)
    if not _is_number(alpha):
        raise bad("lora_alpha", f"{alpha!r} must be a finite number")
    for field in ("use_rslora", "fan_in_fan_out"):
        if not isinstance(cfg.get(field, False), bool):
            raise bad(field, f"{cfg[field]!r} must be true or false")

    for field, check, what in (("rank_pattern", lambda v: _is_int(v) and v > 0, "a positive integer"),
                               ("alpha_pattern", _is_number, "a finite number")):
        pat = cfg.get(field) or {}
        if not isinstance(pat, dict):
            raise bad(field, f"{pat!r} must be an object")
        for key, value in pat.items():
            _regex(rf"(.*\.)?({key})$", f"{source}: {field}[{key!r}]")
            if not check(value):
                raise bad(f"{field}[{key!r}]", f"{value!r} must be {what}")

    tm = cfg.get("target_modules")
    if tm is None:
        raise bad("target_modules", "missing")
    if isinstance(tm, str):
        if tm.lower() != "all-linear":
            _regex(tm, f"{source}: target_modules")
    elif not (isinstance(tm, list) and tm and all(isinstance(t, str) and t for t in tm)):
        raise bad("target_modules", f"{tm!r} must be a non-empty list of names, a regex string "
                  "or \"all-linear\"")

    ex = cfg.get("exclude_modules")
    if isinstance(ex, str):
        _regex(ex, f"{source}: exclude_modules")
    elif ex is not None and not (isinstance(ex, list) and all(isinstance(t, str) for t in ex)):
        raise bad("exclude_modules", f"{ex!r} must be a list of names or a regex string")

    lt = cfg.get("layers_to_transform")
    if lt is not None:
        items = [lt] if not isinstance(lt, list) else lt
        if not all(_is_int(i) and i >= 0 for i in items):
            raise bad("layers_to_transform", f"{lt!r} must be a non-negative integer or a list of them")
    lp = cfg.get("layers_pattern")
    if lp is not None:
        items = [lp] if isinstance(lp, str) else lp
        if not (isinstance(items, list) and all(isinstance(p, str) for p in items)):
            raise bad("layers_pattern", f"{lp!r} must be a string or a list of strings")
        for p in items:
            _regex(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", f"{source}: layers_pattern")


def _read_config(folder: Path) -> dict:
    cfg_path = folder / CONFIG_NAME
    if not cfg_path.is_file():
        raise AdapterError(f"{cfg_path}: file missing")
    if cfg_path.stat().st_size > _MAX_CONFIG_BYTES:
        raise AdapterError(f"{cfg_path}: file too large for an adapter config")
    try:
        text = cfg_path.read_text(encoding="utf-8")
        cfg = json.loads(text, object_pairs_hook=_no_duplicate_keys(cfg_path))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{cfg_path}: not valid JSON: {e}") from None
    except OSError as e:
        raise AdapterError(f"{cfg_path}: unreadable: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    _validate_config(cfg, cfg_path)
    return cfg


def read_adapter_config(path: str | Path, base: BaseShapes | None = None) -> dict:
    """The validated `adapter_config.json` of the adapter folder `path`, without reading tensors.

    Also checks that the weights file is present (and refuses a pickle-only folder). With `base`,
    also checks that the target modules select projections the base has."""
    folder = _folder(path)
    cfg = _read_config(folder)
    _weights_file(folder)
    if base is not None:
        _targeted(cfg, base, folder / CONFIG_NAME)
    return cfg


def _pattern_key(patterns: dict, name: str) -> str | None:
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return None


def _layer_index(cfg: dict, name: str) -> int | None:
    lp = cfg.get("layers_pattern")
    match = None
    if not lp:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    else:
        for p in [lp] if isinstance(lp, str) else lp:
            match = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", name)
            if match is not None:
                break
    return int(match.group("idx")) if match else None


def _excluded(cfg: dict, name: str) -> bool:
    ex = cfg.get("exclude_modules")
    if not ex:
        return False
    if isinstance(ex, str):
        return re.fullmatch(ex, name) is not None
    return name in ex or any(name.endswith(f".{e}") for e in ex)


def _is_target(cfg: dict, name: str) -> bool:
    if _excluded(cfg, name):
        return False
    tm = cfg["target_modules"]
    if isinstance(tm, str):
        if tm.lower() == "all-linear":
            return True  # only called on projection names; lm_head is never one
        return re.fullmatch(tm, name) is not None
    if name in tm:
        return True
    if not any(name.endswith(f".{t}") for t in tm):
        return False
    lt = cfg.get("layers_to_transform")
    if lt is None or (isinstance(lt, list) and not lt):
        return True
    idx = _layer_index(cfg, name)
    if idx is None:
        return False
    return idx == lt if _is_int(lt) else idx in lt


def _targeted(cfg: dict, base: BaseShapes, source: Path) -> dict[str, tuple[int, str]]:
    """Full name -> (layer, module) of every base projection the config targets; refuses target
    entries that cannot select a supported projection of this base."""
    names = base.module_names()
    tm = cfg["target_modules"]
    supported = ", ".join(MODULES)
    if isinstance(tm, list):
        for item in tm:
            if not any(n == item or n.endswith(f".{item}") for n in names):
                raise AdapterError(
                    f"{source}: target_modules entry {item!r} matches no supported module of the "
                    f"base model (LoRA is served on {supported} of its {base.num_layers} layers)")
    elif tm.lower() != "all-linear":
        for other in _OTHER_BASE_MODULES:
            if re.fullmatch(tm, other) and not _excluded(cfg, other):
                raise AdapterError(f"{source}: target_modules {tm!r} matches {other!r}, which is not "
                                   f"a supported LoRA target (only {supported})")
    targeted = {n: lm for n, lm in names.items() if _is_target(cfg, n)}
    if not targeted:
        raise AdapterError(f"{source}: target_modules {tm!r} (with exclude_modules / "
                           f"layers_to_transform) matches no module of the base model")
    return targeted
