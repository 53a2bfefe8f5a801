"""Load a Hugging Face model folder (config.json + safetensors, single file or sharded) into the
fused weight dict `LlamaModel` reads. Safetensors only: a folder with only pickle weights
(`pytorch_model.bin`) is refused, never unpickled."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from lorafleet.errors import ConfigError, ModelLoadError
from lorafleet.memory import hugepages
from lorafleet.model.config import MODULE_BLOCK, ModelConfig
from lorafleet.model.llama import LlamaModel

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_device(name: str | torch.device) -> torch.device:
    """auto: CUDA when torch sees a GPU, else the CPU. The one place a device name is read."""
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for, but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str | torch.dtype | None, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """None means: fp32 on the CPU (its bf16 matmuls are slow), the checkpoint's dtype elsewhere."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return torch.float32 if device.type == "cpu" else DTYPES.get(cfg.torch_dtype, torch.bfloat16)
    if name not in DTYPES:
        raise ModelLoadError(f"dtype {name!r} is not supported (choose one of {', '.join(DTYPES)})")
    return DTYPES[name]


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> file holding it."""
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: malformed index ({e})") from None
        files = {name: folder / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise ModelLoadError(f"{f}: weight shard listed in {index.name} is missing")
        return files
    if single.is_file():
        return {name: single for name in _tensor_names(single)}
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise ModelLoadError(f"{folder}: only pickle weights (.bin/.pt) found; lorafleet loads "
                             "safetensors only (convert with `save_pretrained(safe_serialization=True)`)")
    raise ModelLoadError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def _tensor_names(path: Path) -> list[str]:
    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: unreadable safetensors file ({e})") from None


def _read(files: dict[str, Path], wanted: dict[str, tuple[int, ...]], dtype, device) -> dict[str, torch.Tensor]:
    missing = [n for n in wanted if n not in files]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"weights missing from the checkpoint: {shown}")
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        try:
            with safe_open(path, framework="pt") as f:
                for name in names:
                    t = f.get_tensor(name)
                    if tuple(t.shape) != wanted[name]:
                        raise ModelLoadError(f"{path}: tensor {name} has shape {tuple(t.shape)}, "
                                             f"config.json implies {wanted[name]}")
                    out[name] = t.to(device=device, dtype=dtype)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{path}: unreadable safetensors file ({e})") from None
    return out


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, v = cfg.hidden_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    feats = cfg.linear_features()
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for mod, (fin, fout) in feats.items():
            block = MODULE_BLOCK[mod]
            shapes[f"{p}{block}.{mod}.weight"] = (fout, fin)
            has_bias = (cfg.qkv_bias if mod in ("q_proj", "k_proj", "v_proj") else
                        cfg.o_bias if mod == "o_proj" else cfg.mlp_bias)
            if has_bias:
                shapes[f"{p}{block}.{mod}.bias"] = (fout,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
    return shapes


def fuse(cfg: ModelConfig, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face names -> the fused names `LlamaModel` documents."""
    w = {"embed": t["model.embed_tokens.weight"], "norm": t["model.norm.weight"]}
    w["lm_head"] = w["embed"] if cfg.tie_word_embeddings else t["lm_head.weight"]
    for i in range(cfg.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        w[q + "in_norm"] = t[p + "input_layernorm.weight"]
        w[q + "post_norm"] = t[p + "post_attention_layernorm.weight"]
        w[q + "qkv"] = torch.cat([t[a + f"{x}_proj.weight"] for x in "qkv"])
        w[q + "o"] = t[a + "o_proj.weight"]
        w[q + "gate_up"] = torch.cat([t[m + "gate_proj.weight"], t[m + "up_proj.weight"]])
        w[q + "down"] = t[m + "down_proj.weight"]
        if cfg.qkv_bias:
            w[q + "qkv_b"] = torch.cat([t[a + f"{x}_proj.bias"] for x in "qkv"])
        if cfg.o_bias:
            w[q + "o_b"] = t[a + "o_proj.bias"]
        if cfg.mlp_bias:
            w[q + "gate_up_b"] = torch.cat([t[m + "gate_proj.bias"], t[m + "up_proj.bias"]])
            w[q + "down_b"] = t[m + "down_proj.bias"]
        if cfg.qk_norm:
            w[q + "q_norm"] = t[a + "q_norm.weight"]
            w[q + "k_norm"] = t[a + "k_norm.weight"]
        for name in (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight",
                     m + "gate_proj.weight", m + "up_proj.weight"):
            del t[name]  # the fused copy replaces it: free the original layer by layer, not at the end
    return w


RANDOM_WEIGHTS = "lorafleet-random-weights.json"


def random_weights(folder: Path, wanted: dict[str, tuple[int, ...]], dtype, device) -> dict[str, torch.Tensor]:
    """A benchmark's base whose folder holds `RANDOM_WEIGHTS` ({"seed": s, "std": x}) in place of
    weight files: every tensor made on `device` (norms at 1, the rest normal with that std), so
    an 8B-shaped model costs no disk and no download. Never a served model's path: such a folder
    is only written by `lorafleet.bench.fixtures.build_base`."""
    try:
        spec = json.loads((folder / RANDOM_WEIGHTS).read_text())
        seed, std = int(spec["seed"]), float(spec["std"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ModelLoadError(f"{folder / RANDOM_WEIGHTS}: expected {{\"seed\": int, \"std\": float}}") from None
    g = torch.Generator(device=device).manual_seed(seed)
    return {name: (torch.ones(shape, dtype=dtype, device=device) if name.endswith("norm.weight") else
                   torch.randn(shape, generator=g, dtype=dtype, device=device).mul_(std))
            for name, shape in wanted.items()}


def load_model(folder: str | Path, device: str | torch.device = "cpu", dtype=None,
               max_len: int | None = None) -> LlamaModel:
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: not a model folder")
    cfg = ModelConfig.from_folder(folder)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, cfg, device)
    if (folder / RANDOM_WEIGHTS).is_file() and not any(folder.glob("*.safetensors")):
        tensors = random_weights(folder, expected_shapes(cfg), dtype, device)
    else:
        tensors = _read(weight_files(folder), expected_shapes(cfg), dtype, device)
    weights = fuse(cfg, tensors)
    if device.type == "cpu":
        tensors.clear()  # `weights` holds the last reference: each old tensor is freed as it moves
        hugepages.place(weights)  # a decode step streams them all: on huge pages, fewer TLB misses
    return LlamaModel(cfg, weights, max_len or cfg.max_model_len)
