"""ModelConfig: the few numbers of a Hugging Face `config.json` that a Llama-family decoder needs.

One parser for every supported family; anything we cannot serve exactly is refused here, with
the name of the field, so a model never runs with silently different maths.
"""

from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafleet.errors import ModelLoadError, UnsupportedModelError

# The block each projection lives in, in HF Llama module names (`model.layers.{i}.<block>.<proj>`):
# the one table the loader, the adapter checks and the bench's adapters all read.
MODULE_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}

# architecture name in config.json -> family, and what each family adds to plain Llama
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Decoder layers: several times the deepest published model's; a config naming more is refused
# before anything is built per layer (tensor names, shapes).
MAX_LAYERS = 1 << 10
# Positions served at most (the rope cache holds one row each, built at load): the longest contexts
# published; a model declaring more is served this many, a longer --max-model-len is cut to it.
MAX_CONTEXT = 1 << 20


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", ...}; None = default
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        """Longest sequence served: the position limit, or the sliding window when one is active
        (we serve full attention only, which equals sliding attention up to the window), at most
        MAX_CONTEXT."""
        window = _active_sliding_window(self.raw)
        return min(self.max_position_embeddings, window or MAX_CONTEXT, MAX_CONTEXT)

    def linear_features(self) -> dict[str, tuple[int, int]]:
        """Projection name -> (in_features, out_features), the shapes adapters are checked against."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size), "k_proj": (h, self.kv_size), "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            model_type = cfg.get("model_type")
            family = ({v: v for v in SUPPORTED_ARCHITECTURES.values()}.get(model_type)
                      if not archs and isinstance(model_type, str) else None)
        if family is None:
            named = ", ".join(archs) or f"model_type={cfg.get('model_type')!r}"
            raise UnsupportedModelError(
                f"{source}: architecture {named} is not supported; lorafleet serves "
                + ", ".join(SUPPORTED_ARCHITECTURES))
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
        try:
            hidden, heads = _count(cfg["hidden_size"], "hidden_size", source), \
                _count(cfg["num_attention_heads"], "num_attention_heads", source)
            conf: dict[str, Any] = dict(
                family=family,
                vocab_size=_count(cfg["vocab_size"], "vocab_size", source),
                hidden_size=hidden,
                intermediate_size=_count(cfg["intermediate_size"], "intermediate_size", source),
                num_layers=_count(cfg["num_hidden_layers"], "num_hidden_layers", source, MAX_LAYERS),
                num_heads=heads,
                num_kv_heads=_count(cfg.get("num_key_value_heads") or heads, "num_key_value_heads", source),
                head_dim=_count(cfg.get("head_dim") or hidden // heads, "head_dim", source),
                rms_norm_eps=_positive(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
                max_position_embeddings=_count(cfg.get("max_position_embeddings", 4096), "max_position_embeddings",
                                               source),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing field {e}") from None
        if cfg.get("sliding_window"):  # `max_model_len` reads it
            _count(cfg["sliding_window"], "sliding_window", source)
        rope_theta, rope_scaling = _parse_rope(cfg, source)
        attention_bias = bool(cfg.get("attention_bias", False))
        if family == "qwen2":
            conf.update(qkv_bias=True, o_bias=False)
        else:
            conf.update(qkv_bias=attention_bias, o_bias=attention_bias)
        conf.update(qk_norm=family == "qwen3", rope_theta=rope_theta, rope_scaling=rope_scaling)
        eos = cfg.get("eos_token_id")
        conf["eos_token_ids"] = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        conf["bos_token_id"] = cfg.get("bos_token_id")
        conf["torch_dtype"] = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
        if conf["num_heads"] % conf["num_kv_heads"]:
            raise ModelLoadError(f"{source}: num_attention_heads must be a multiple of num_key_value_heads")
        return cls(raw=cfg, **conf)

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: not found; a model folder needs a Hugging Face config.json")
        try:
            cfg = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
        except RecursionError:
            raise ModelLoadError(f"{path}: not a config.json (nested too deeply to read)") from None
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{path}: expected a JSON object")
        return cls.from_dict(cfg, source=str(path))


def _parse_rope(cfg: dict, source: str) -> tuple[float, dict | None]:
    """RoPE settings from either layout: transformers 4 (`rope_theta` + `rope_scaling`) or
    transformers 5 (`rope_parameters` holding both)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    if not isinstance(params, dict) or not isinstance(scaling, (dict, type(None))):
        raise ModelLoadError(f"{source}: rope_parameters and rope_scaling must be JSON objects")
    theta = _positive(params.get("rope_theta", cfg.get("rope_theta", 10000.0)), "rope_theta", source)
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"{source}: rope scaling type {rope_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if rope_type == "default":
            return theta, None
        numbers = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        checked = {k: _positive(scaling.get(k), f"rope_scaling.{k}", source)
                   for k in numbers[:1 if rope_type == "linear" else None]}
        if rope_type == "llama3" and checked["high_freq_factor"] <= checked["low_freq_factor"]:
            raise ModelLoadError(f"{source}: rope_scaling.high_freq_factor must be above low_freq_factor (the "
                                 "blend divides by their difference)")
        return theta, {**scaling, "rope_type": rope_type}
    return theta, None


def _count(value, key: str, source: str, bound: int | None = None) -> int:
    """`value` of field `key` as an integer from 1 to `bound`, else a ModelLoadError naming it."""
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        number = 0
    if isinstance(value, bool) or number < 1 or (bound is not None and number > bound):
        within = f"from 1 to {bound}" if bound else "a positive integer"
        raise ModelLoadError(f"{source}: {key} is {reprlib.repr(value)}; it must be {within}")
    return number


def _positive(value, name: str, source: str) -> float:
    """`value` as a finite number > 0 (a norm's epsilon, a rope's base or factor), else a
    ModelLoadError naming it: NaN or 0 there gives NaN logits on every request."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not (math.isfinite(number) and number > 0):
        raise ModelLoadError(f"{source}: {name} is {reprlib.repr(value)}; it must be a finite number > 0")
    return number


def _active_sliding_window(cfg: dict) -> int | None:
    window = cfg.get("sliding_window")
    if not window:
        return None
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
        return None
    return int(window)


# What llama.cpp's server samples with where a request names nothing (its common defaults): a GGUF
# file carries no generation config, and its users expect these, not temperature 1 untruncated
LLAMA_CPP_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


def generation_defaults(folder: Path) -> dict:
    """The sampling defaults a model folder's generation_config.json asks for, as request fields
    (temperature, top_p, top_k, min_p); {} without one; for a GGUF file, llama.cpp's
    (LLAMA_CPP_DEFAULTS). `do_sample: false` means greedy (temperature 0), as
    `transformers.generate` reads it. A server applies these where a request names nothing, like
    vLLM's default `--generation-config auto`. Unreadable or out-of-range values are ignored (the
    request defaults stay), never fatal: the file is advice, not the model."""
    if Path(folder).suffix.lower() == ".gguf" and Path(folder).is_file():
        return dict(LLAMA_CPP_DEFAULTS)
    try:
        cfg = json.loads((Path(folder) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return sampling_fields(cfg)


def sampling_fields(cfg) -> dict:
    """A generation config's (or Ollama's params') sampling fields, as request fields, the valid ones."""
    if not isinstance(cfg, dict):
        return {}
    out: dict = {}
    t, p, k = cfg.get("temperature"), cfg.get("top_p"), cfg.get("top_k")
    if cfg.get("do_sample") is False:
        out["temperature"] = 0.0
    elif isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0:
        out["temperature"] = float(t)
    if isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= 1:
        out["top_p"] = float(p)
    if isinstance(k, int) and not isinstance(k, bool) and k >= -1:
        out["top_k"] = k
    m = cfg.get("min_p")
    if isinstance(m, (int, float)) and not isinstance(m, bool) and 0 <= m <= 1:
        out["min_p"] = float(m)
    return out
