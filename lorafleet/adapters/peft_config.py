"""PEFT's `adapter_config.json`: what it may say, what lorafleet refuses, and which modules of
the base it targets, mirroring PEFT's own matching rules (`adapter.py` reads the tensors).

Whoever asks the daemon to load an adapter chooses its path, so a refusal must tell them nothing
about files on this machine beyond "this is not a valid adapter": messages name the file, the
field and the form expected, never a value read from the file, and a folder or file that is
missing, unreadable or of the wrong kind gets one message whatever the reason.

The config's regular expressions (target_modules, exclude_modules, rank_pattern, alpha_pattern,
layers_pattern) are the file's code: a pattern like `(.*?)*?.*?q.*?_.*?x` backtracks for seconds
on one module name. Each is at most `MAX_PATTERN_CHARS` long and is matched by `Matcher`, with
`regex` (Python's `re` semantics, compiled once) under a timeout of `MATCH_TIMEOUT_S` a name and
`CONFIG_BUDGET_S` for the whole config, releasing the GIL while it runs; past either, the adapter
is refused naming the field. Only workers match (loads, and the server's inspection before a lazy
registration), never the engine thread of a daemon.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import regex

from lorafleet.errors import AdapterError
from lorafleet.adapters import alora
from lorafleet.adapters.heads import HEAD_MODULES, saved_modules
from lorafleet.model.config import MODULE_BLOCK

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The embedding and the LM head: LoRA targets and saved modules too (`adapters/heads.py`).
HEAD_NAMES = tuple(HEAD_MODULES)
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"
_MAX_CONFIG_BYTES = 1 << 20  # a config is a few KB (one rank_pattern key a module: tens); parsing holds the GIL
MAX_PATTERN_CHARS = 4096   # one regular expression of the config
MAX_PATTERN_KEYS = 4096    # rank_pattern / alpha_pattern entries (PEFT writes one per module at most)
MAX_SAVED_ENTRIES = 64     # modules_to_save entries (PEFT configs name a handful)
MATCH_TIMEOUT_S = 0.02     # one pattern against one module name: real ones take microseconds
CONFIG_BUDGET_S = 2.0      # every pattern against every module name of the base
# init_lora_weights values whose adapters expect a base model rewritten at init time.
_BASE_MUTATING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq", "mica")
# Config fields naming LoRA variants / features whose forward pass is not plain `scale * B @ A @ x`
# (or DoRA's, or lora_bias's, which are served: `adapter.py`) or which need more than the LoRA
# tensors; refused when set to anything truthy.
_SERVED_VARIANTS = ("use_dora", "lora_bias")
_UNSUPPORTED_FIELDS = (
    "use_qalora", "layer_replication", "target_parameters",
    "trainable_token_indices", "use_bdlora", "arrow_config",
    "kasa_config", "monteclora_config",
)
# LoraConfig's fields (peft 0.21): the only JSON keys a message may quote.
_PEFT_FIELDS = frozenset(_UNSUPPORTED_FIELDS) | frozenset(_SERVED_VARIANTS) | {alora.FIELD} | {
    "alpha_pattern", "auto_mapping", "base_model_name_or_path", "bias", "corda_config",
    "ensure_weight_tying", "eva_config", "exclude_modules", "fan_in_fan_out", "inference_mode",
    "init_lora_weights", "layers_pattern", "layers_to_transform", "loftq_config", "lora_alpha",
    "lora_dropout", "lora_ga_config", "megatron_config", "megatron_core", "modules_to_save",
    "peft_type", "peft_version", "qalora_group_size", "r", "rank_pattern", "revision",
    "runtime_config", "target_modules", "task_type", "velora_config",
}
_SHAPE = f"a folder holding {CONFIG_NAME} and {WEIGHTS_NAME}"


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter is checked against: layer count and each projection's (in, out) features.
    Module full names follow the HF Llama layout: `model.layers.{i}.self_attn.{q,k,v,o}_proj`,
    `model.layers.{i}.mlp.{gate,up,down}_proj`."""

    num_layers: int
    features: dict[str, tuple[int, int]]
    vocab_size: int = 0   # the embedding's rows and the LM head's (0: neither may be adapted)
    hidden_size: int = 0
    qk_norm: bool = False  # q_norm / k_norm in each layer (Qwen3): modules a saved-modules entry may match

    @classmethod
    def from_model_config(cls, cfg: Any) -> BaseShapes:
        """From anything with `num_layers`, `vocab_size`, `hidden_size` and `linear_features()`
        (lorafleet's ModelConfig)."""
        return cls(num_layers=int(cfg.num_layers), features=dict(cfg.linear_features()),
                   vocab_size=int(cfg.vocab_size), hidden_size=int(cfg.hidden_size), qk_norm=bool(cfg.qk_norm))

    def module_names(self) -> dict[str, tuple[int, str]]:
        """Full module name -> (layer, module) for every projection the base has."""
        out: dict[str, tuple[int, str]] = {}
        for i in range(self.num_layers):
            for m in MODULES:
                if m in self.features:
                    out[f"model.layers.{i}.{MODULE_BLOCK[m]}.{m}"] = (i, m)
        return out


def is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _no_duplicate_keys(source: Path):
    def hook(pairs: list[tuple[str, Any]]) -> dict:
        out: dict = {}
        for k, v in pairs:
            if k in out:
                named = f" {k!r}" if k in _PEFT_FIELDS else ""
                raise AdapterError(f"{source}: duplicate key{named} in a JSON object (each key may "
                                   "appear once)")
            out[k] = v
        return out
    return hook


def unreadable(path: Path) -> AdapterError:
    """The one refusal for a file that is absent, unreadable, or not a regular file (its folder
    likewise): which of these it is would tell the caller about files on this machine."""
    return AdapterError(f"{path}: missing or unreadable (an adapter is {_SHAPE})")


def weights_file(folder: Path) -> Path:
    st = folder / WEIGHTS_NAME
    if os.path.isfile(st):  # False, not an error, for any OSError or a NUL in the path
        return st
    if os.path.isfile(folder / PICKLE_NAME):
        raise AdapterError(
            f"{folder / PICKLE_NAME}: pickled adapter weights are refused (loading a pickle can run "
            f"arbitrary code); convert the adapter to {WEIGHTS_NAME}")
    raise unreadable(st)


def _compiles(pattern: str) -> bool:
    """A valid `re` pattern (PEFT's matcher) of at most MAX_PATTERN_CHARS."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return False
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError):
        return False
    return True


class Matcher:
    """Every pattern match of one config's evaluation, each pattern compiled once, each match
    under MATCH_TIMEOUT_S and all of them under CONFIG_BUDGET_S (see the module doc)."""

    def __init__(self, source: Path):
        self.source = source
        self.deadline = time.monotonic() + CONFIG_BUDGET_S
        self._compiled: dict[str, Any] = {}

    def __call__(self, field: str, pattern: str, name: str, full: bool = False):
        """`pattern` matched at the start of `name` (the whole of it with `full`)."""
        compiled = self._compiled.get(pattern)
        if compiled is None:
            compiled = self._compiled[pattern] = regex.compile(pattern)
        timeout = min(MATCH_TIMEOUT_S, self.deadline - time.monotonic())
        try:
            if timeout <= 0:
                raise TimeoutError
            return (compiled.fullmatch if full else compiled.match)(name, timeout=timeout, concurrent=True)
        except TimeoutError:
            raise AdapterError(
                f"{self.source}: {field}: a regular expression takes too long to match the base's module names "
                f"(over {MATCH_TIMEOUT_S * 1e3:.0f} ms for one name, or {CONFIG_BUDGET_S:.0f} s in all); the "
                "names look like 'model.layers.0.self_attn.q_proj'") from None


def _bad(source: Path, field: str, why: str) -> AdapterError:
    """A refusal naming the file and the field (never a value read from the file)."""
    return AdapterError(f"{source}: {field}: {why}")


def _validate_config(cfg: dict, source: Path) -> None:
    """Refuses a config lorafleet cannot serve, naming the first field at fault (checked in this order)."""
    _check_method(cfg, source)
    _check_trained_beside(cfg, source)
    _check_ranks(cfg, source)
    _check_targets(cfg, source)


def _check_method(cfg: dict, source: Path) -> None:
    """peft_type LORA, no unsupported variant, and an init that left the base as it was."""
    if "peft_type" not in cfg:
        raise _bad(source, "peft_type", "missing (expected \"LORA\")")
    if cfg["peft_type"] != "LORA":
        raise _bad(source, "peft_type", "must be \"LORA\" (other PEFT methods are not supported)")
    for field in _UNSUPPORTED_FIELDS:
        if cfg.get(field):
            raise _bad(source, field, "must be absent, false or empty (this LoRA variant is not supported)")
    if bad := next((f for f in _SERVED_VARIANTS if not isinstance(cfg.get(f, False), bool)), None):
        raise _bad(source, bad, "must be true or false")
    alora.check_config(cfg, source)  # aLoRA's form and the options it combines with
    if cfg.get("use_dora") and cfg.get("lora_bias"):
        raise _bad(source, "lora_bias", "DoRA with lora_bias is not supported (either alone is)")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MUTATING_INITS):
        raise _bad(source, "init_lora_weights", f"{'/'.join(_BASE_MUTATING_INITS)} adapters need a base model "
                   "modified at init time; convert the adapter to plain LoRA (save_pretrained with "
                   "path_initial_model_for_weight_conversion)")


def _check_trained_beside(cfg: dict, source: Path) -> None:
    """What was trained beside the LoRA: no base biases; modules_to_save only the served ones."""
    if cfg.get("bias", "none") != "none":
        raise _bad(source, "bias", "must be \"none\" (trained base biases are not supported; lora_bias is)")
    mts = cfg.get("modules_to_save")
    if mts is not None and not (isinstance(mts, list) and all(isinstance(t, str) and t for t in mts)):
        raise _bad(source, "modules_to_save", "must be a list of module names")
    if mts and len(mts) > MAX_SAVED_ENTRIES:  # each is matched against every module name of the base
        raise _bad(source, "modules_to_save", f"at most {MAX_SAVED_ENTRIES} entries")
    try:
        saved_modules(cfg)
    except AdapterError as e:
        raise AdapterError(f"{source}: {e}") from None


def _check_ranks(cfg: dict, source: Path) -> None:
    """r, lora_alpha and their per-module patterns, and the scaling and layout flags."""
    r = cfg.get("r")
    if not is_int(r) or r <= 0:
        raise _bad(source, "r", "must be a positive integer")
    if not _is_number(cfg.get("lora_alpha", 8)):
        raise _bad(source, "lora_alpha", "must be a finite number")
    for field in ("use_rslora", "fan_in_fan_out"):
        if not isinstance(cfg.get(field, False), bool):
            raise _bad(source, field, "must be true or false")
    for field, check, what in (("rank_pattern", lambda v: is_int(v) and v > 0, "a positive integer"),
                               ("alpha_pattern", _is_number, "a finite number")):
        pat = cfg.get(field) or {}
        if not isinstance(pat, dict):
            raise _bad(source, field, f"must be an object mapping module-name regexes to {what}s")
        if len(pat) > MAX_PATTERN_KEYS:
            raise _bad(source, field, f"at most {MAX_PATTERN_KEYS} entries")
        for key, value in pat.items():
            if not _compiles(rf"(.*\.)?({key})$"):
                raise _bad(source, field, "every key must be a valid regular expression (of at most "
                           f"{MAX_PATTERN_CHARS} characters)")
            if not check(value):
                raise _bad(source, field, f"every value must be {what}")


def _check_targets(cfg: dict, source: Path) -> None:
    """The fields that select the modules: target_modules, exclude_modules and the layer filters."""
    tm = cfg.get("target_modules")
    if tm is None:
        raise _bad(source, "target_modules", "missing (expected a list of module names, a regex string or "
                   "\"all-linear\")")
    if isinstance(tm, str):
        if tm.lower() != "all-linear" and not _compiles(tm):
            raise _bad(source, "target_modules",
                       f"not a valid regular expression of at most {MAX_PATTERN_CHARS} characters")
    elif not (isinstance(tm, list) and tm and all(isinstance(t, str) and t for t in tm)):
        raise _bad(source, "target_modules", "must be a non-empty list of names, a regex string or "
                   "\"all-linear\"")
    ex = cfg.get("exclude_modules")
    if isinstance(ex, str):
        if not _compiles(ex):
            raise _bad(source, "exclude_modules",
                       f"not a valid regular expression of at most {MAX_PATTERN_CHARS} characters")
    elif ex is not None and not (isinstance(ex, list) and all(isinstance(t, str) for t in ex)):
        raise _bad(source, "exclude_modules", "must be a list of names or a regex string")
    lt = cfg.get("layers_to_transform")
    if lt is not None:
        items = [lt] if not isinstance(lt, list) else lt
        if not all(is_int(i) and i >= 0 for i in items):
            raise _bad(source, "layers_to_transform", "must be a non-negative integer or a list of them")
    lp = cfg.get("layers_pattern")
    if lp is not None:
        items = [lp] if isinstance(lp, str) else lp
        if not (isinstance(items, list) and all(isinstance(p, str) for p in items)):
            raise _bad(source, "layers_pattern", "must be a string or a list of strings")
        if not all(_compiles(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.") for p in items):
            raise _bad(source, "layers_pattern", "every pattern must be a valid regular expression (of at most "
                       f"{MAX_PATTERN_CHARS} characters)")


def read_config(folder: Path) -> dict:
    cfg_path = folder / CONFIG_NAME
    if not os.path.isfile(cfg_path):  # a FIFO or device would block or never end
        raise unreadable(cfg_path)
    try:
        with open(cfg_path, "rb") as f:
            raw = f.read(_MAX_CONFIG_BYTES + 1)
    except OSError:
        raise unreadable(cfg_path) from None
    if len(raw) > _MAX_CONFIG_BYTES:
        raise AdapterError(f"{cfg_path}: too large (an adapter config is at most "
                           f"{_MAX_CONFIG_BYTES >> 20} MiB of JSON)")
    try:
        cfg = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys(cfg_path))
    except (UnicodeDecodeError, ValueError, RecursionError):  # the parser's text would quote the file
        raise AdapterError(f"{cfg_path}: not valid JSON (expected a UTF-8 JSON object)") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_path}: not a JSON object (expected an object of LoraConfig fields)")
    _validate_config(cfg, cfg_path)
    return cfg


def read_adapter_config(path: str | Path, base: BaseShapes | None = None) -> dict:
    """The validated `adapter_config.json` of the adapter folder `path`, without reading tensors. Also
    checks that the weights file is present (and refuses a pickle-only folder). With `base`, also checks
    that the target modules select projections the base has (and an aLoRA's tokens its vocabulary)."""
    cfg = read_config(folder := Path(path))
    weights_file(folder)
    if base is not None:
        targeted_modules(cfg, base, folder / CONFIG_NAME, Matcher(folder / CONFIG_NAME))
    return cfg


def pattern_key(patterns: dict, name: str, match: Matcher, field: str = "rank_pattern") -> str | None:
    for key in patterns:
        if match(field, rf"(.*\.)?({key})$", name):
            return key
    return None


def _layer_index(cfg: dict, name: str, match: Matcher) -> int | None:
    lp = cfg.get("layers_pattern")
    found = None
    if not lp:
        found = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)  # ours: a fixed, linear pattern
    else:
        for p in [lp] if isinstance(lp, str) else lp:
            found = match("layers_pattern", rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", name)
            if found is not None:
                break
    return int(found.group("idx")) if found else None


def _excluded(cfg: dict, name: str, match: Matcher) -> bool:
    ex = cfg.get("exclude_modules")
    if not ex:
        return False
    if isinstance(ex, str):
        return match("exclude_modules", ex, name, full=True) is not None
    return name in ex or any(name.endswith(f".{e}") for e in ex)


def _is_target(cfg: dict, name: str, match: Matcher) -> bool:
    if _excluded(cfg, name, match):
        return False
    tm = cfg["target_modules"]
    if isinstance(tm, str):
        if tm.lower() == "all-linear":
            return True  # only called on projection names; lm_head is never one
        return match("target_modules", tm, name, full=True) is not None
    if name in tm:
        return True
    if not any(name.endswith(f".{t}") for t in tm):
        return False
    lt = cfg.get("layers_to_transform")
    if lt is None or (isinstance(lt, list) and not lt):
        return True
    idx = _layer_index(cfg, name, match)
    if idx is None:
        return False
    return idx == lt if is_int(lt) else idx in lt


def targeted_modules(cfg: dict, base: BaseShapes, source: Path, match: Matcher) -> dict[str, tuple[int, str]]:
    """Full name -> (layer, module) of every base projection the config targets; refuses target
    entries that cannot select a supported projection of this base."""
    names = base.module_names()
    tm = cfg["target_modules"]
    supported = ", ".join(MODULES + ("embed_tokens", "lm_head"))
    if isinstance(tm, list):
        for item in tm:
            if not any(n == item or n.endswith(f".{item}") for n in (*names, *HEAD_NAMES)):
                raise AdapterError(
                    f"{source}: target_modules has an entry that matches no supported module of the "
                    f"base model (LoRA is served on {supported} of its {base.num_layers} layers)")
    targeted = {n: lm for n, lm in names.items() if _is_target(cfg, n, match)}
    heads = targeted_heads(cfg, base, source, match)
    alora.check_base(cfg, heads, base.vocab_size, source)
    if not targeted and not heads:  # as PEFT, which refuses target_modules that match nothing
        raise AdapterError(f"{source}: target_modules (with exclude_modules / layers_to_transform) "
                           f"matches no module of the base model (LoRA is served on {supported} of "
                           f"its {base.num_layers} layers)")
    return targeted


def targeted_heads(cfg: dict, base: BaseShapes, source: Path, match: Matcher) -> set[str]:
    """The full names of the embedding and LM head that target_modules selects for a LoRA
    ("all-linear" selects neither, as in PEFT)."""
    tm = cfg["target_modules"]
    if isinstance(tm, str) and tm.lower() == "all-linear":
        return set()
    out = {full for full in HEAD_NAMES if _is_target(cfg, full, match)}  # PEFT's rules, layers_to_transform too
    if out and not base.vocab_size:
        raise AdapterError(f"{source}: target_modules selects {HEAD_MODULES[min(out)]!r}, which this base "
                           "does not offer as a LoRA target")
    return out
