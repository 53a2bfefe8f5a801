"""Load a Hugging Face model folder (config.json + safetensors, single file or sharded) into the
fused weight dict `LlamaModel` reads. Safetensors only: a folder with only pickle weights
(`pytorch_model.bin`) is refused, never unpickled.

Quantized bases (`lorafleet.model.quant`): a folder `lorafleet pull --quantize` wrote (its
`quant.QUANT_FILE` names the scheme; each quantized weight `X.weight` stored as `X.qweight`, the
codes, and `X.scales`) is read as it is; a full-precision folder loaded with `quantize=` is
quantized tensor by tensor as it is read, so the full-precision model is never whole in memory
(an 8B base in int4 loads on a 24 GiB machine)."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from lorafleet.errors import ConfigError, ModelLoadError
from lorafleet import hugepages
from lorafleet.model import quant
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


def _read(files: dict[str, Path], wanted: dict[str, tuple[int, ...]], dtype, device,
          quantized: Collection[str] = frozenset(), scheme: str | None = None, stored: bool = False) -> dict[str, torch.Tensor]:
    """The `wanted` tensors, each checked against its shape. `quantized` names the weights that
    are quantized (`scheme`): read as codes and scales (`stored`: X.qweight and X.scales), or
    read in full precision and quantized at once; their codes come under X.weight and their
    scales under X.weight_s."""
    if stored:
        files = {n: f for n, f in {**files, **{n: files.get(n[:-len("weight")] + "qweight") for n in quantized}}.items()
                 if f is not None}
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
                    if stored and name in quantized:
                        stem = name[:-len("weight")]
                        q, scales = f.get_tensor(stem + "qweight"), _scales(f, stem, path)
                        quant.check(q, scales, wanted[name], f"{path}: {stem}qweight")
                        if quant.scheme_of(q) != scheme and scheme != quant.MIXED \
                                and name != "model.embed_tokens.weight":  # rows: any
                            raise ModelLoadError(f"{path}: {stem}qweight holds {quant.scheme_of(q)} codes in an "
                                                 f"{scheme} model")
                        out[name], out[name + "_s"] = q.to(device), scales.to(device=device, dtype=torch.float16)
                        if stem + "offsets" in f.keys():  # a GGUF file's affine types (`model/gguf.py`)
                            offsets = f.get_tensor(stem + "offsets")
                            if offsets.shape != scales.shape:
                                raise ModelLoadError(f"{path}: {stem}offsets has shape {tuple(offsets.shape)}, its "
                                                     f"scales {tuple(scales.shape)}")
                            out[name + "_o"] = offsets.to(device=device, dtype=torch.float32)
                        continue
                    t = f.get_tensor(name)
                    if tuple(t.shape) != wanted[name]:
                        raise ModelLoadError(f"{path}: tensor {name} has shape {tuple(t.shape)}, "
                                             f"config.json implies {wanted[name]}")
                    if name in quantized:
                        assert scheme is not None  # names are quantized in a scheme
                        out[name], out[name + "_s"] = quant.quantize(t.to(device), scheme)
                    else:
                        out[name] = t.to(device=device, dtype=dtype)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{path}: unreadable safetensors file ({e})") from None
    return out


def _scales(f, stem: str, path: Path) -> torch.Tensor:
    """X.scales, which the writer keeps in X.qweight's file."""
    try:
        return f.get_tensor(stem + "scales")
    except (SafetensorError, KeyError):
        raise ModelLoadError(f"{path}: {stem}qweight has no {stem}scales beside it") from None


def _check_widths(folder: Path, wanted: dict[str, tuple[int, ...]], quantized: set[str], scheme: str | None) -> None:
    """Every weight to quantize has a width its groups divide, said before any is read."""
    for name in quantized:
        if not quant.quantizable(wanted[name][1], quant.INT4_GROUP):
            raise ModelLoadError(f"{folder}: {name} has {wanted[name][1]} input features; {scheme} needs a "
                                 f"multiple of {quant.QUANT_ALIGN}")


def quantized_names(cfg: ModelConfig) -> set[str]:
    """The checkpoint's weights a quantized base holds quantized: the projections, the LM head and
    the embedding (one tensor where tied)."""
    return {n for n in expected_shapes(cfg) if n.endswith("_proj.weight")} | \
        {"model.embed_tokens.weight"} | (set() if cfg.tie_word_embeddings else {"lm_head.weight"})


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
    """Hugging Face names -> the fused names `LlamaModel` documents (a quantized weight's scales,
    `X.weight_s`, fused with its codes under `<name>_s`)."""
    def join(out: str, names: list[str]) -> None:
        if names[0] + "_s" in t:  # quantized: in one scheme and group (a GGUF mix may differ by tensor)
            parts = quant.fusable([(t[n], t[n + "_s"], t.get(n + "_o")) for n in names])
            q, s, o = (None if p[0] is None else torch.cat(p) if len(p) > 1 else p[0] for p in zip(*parts))
            assert q is not None and s is not None  # every part has its codes and scales
            w[out], w[out + "_s"] = q, s
            if o is not None:  # a GGUF file's affine types: each group's offset
                w[out + "_o"] = o
        else:
            mats = [t[n] for n in names]
            w[out] = mats[0] if len(mats) == 1 else torch.cat(mats)

    w = {"norm": t["model.norm.weight"]}
    join("embed", ["model.embed_tokens.weight"])
    if cfg.tie_word_embeddings:
        w["lm_head"] = w["embed"]
        if "embed_s" in w:
            w["lm_head_s"] = w["embed_s"]
    else:
        join("lm_head", ["lm_head.weight"])
    for i in range(cfg.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        w[q + "in_norm"] = t[p + "input_layernorm.weight"]
        w[q + "post_norm"] = t[p + "post_attention_layernorm.weight"]
        join(q + "qkv", [a + f"{x}_proj.weight" for x in "qkv"])
        join(q + "o", [a + "o_proj.weight"])
        join(q + "gate_up", [m + "gate_proj.weight", m + "up_proj.weight"])
        join(q + "down", [m + "down_proj.weight"])
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
            t.pop(name + "_s", None)
            t.pop(name + "_o", None)
            del t[name]  # the fused copy replaces it: free the original layer by layer, not at the end
    return w


RANDOM_WEIGHTS = "lorafleet-random-weights.json"


def random_weights(folder: Path, wanted: dict[str, tuple[int, ...]], dtype, device,
                   quantized: Collection[str] = frozenset(), scheme: str | None = None) -> dict[str, torch.Tensor]:
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
    out: dict[str, torch.Tensor] = {}
    for name, shape in wanted.items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=dtype, device=device)
        elif name in quantized:  # quantized as made: the full-precision model is never whole (8B in int4)
            assert scheme is not None  # names are quantized in a scheme
            out[name], out[name + "_s"] = quant.quantize(
                torch.randn(shape, generator=g, dtype=dtype, device=device).mul_(std), scheme)
        else:
            out[name] = torch.randn(shape, generator=g, dtype=dtype, device=device).mul_(std)
    return out


def load_model(folder: str | Path, device: str | torch.device = "cpu", dtype=None,
               max_len: int | None = None, quantize: str | None = None, kernels: str | None = None,
               prefill: str = "float32") -> LlamaModel:
    """The model in `folder` on `device`, computing in `dtype` (`resolve_dtype`); `quantize`
    (int8 | int4): a full-precision base quantized as it is read. A quantized folder is served in
    its own scheme (`quantize` None or the same). `kernels`: `backend.select`'s choice (None:
    LORAFLEET_KERNELS, else auto). `prefill`: a quantized base's prefill matmuls at float32 or bfloat16
    (`LlamaModel.project`)."""
    folder = Path(folder)
    if folder.suffix.lower() == ".gguf" and folder.is_file():  # a llama.cpp file, a scheme per tensor (model/gguf.py)
        from lorafleet.model import gguf

        f, cfg, scheme = gguf.open_model(folder, quantize)
        device = torch.device(device)
        tensors = f.read(expected_shapes(cfg), resolve_dtype(dtype, cfg, device), device,
                         quantized_names(cfg) if scheme else set(), scheme)
        return _model(cfg, tensors, device, max_len, kernels, prefill)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: not a model folder (nor a .gguf file)")
    cfg = ModelConfig.from_folder(folder)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, cfg, device)
    stored = quant.stored_scheme(folder)
    if stored and quantize and quantize != stored:
        raise ModelLoadError(f"{folder}: the base is stored in {stored}; it cannot be served in {quantize} "
                             "(pull the full-precision model with --quantize " + quantize + ")")
    scheme = stored or (quant.check_scheme(quantize) if quantize else None)
    wanted = expected_shapes(cfg)
    quantized = quantized_names(cfg) if scheme else set()
    _check_widths(folder, wanted, quantized, scheme)
    if (folder / RANDOM_WEIGHTS).is_file() and not any(folder.glob("*.safetensors")):
        tensors = random_weights(folder, wanted, dtype, device, quantized, scheme)
    else:
        tensors = _read(weight_files(folder), wanted, dtype, device, quantized, scheme, stored is not None)
    return _model(cfg, tensors, device, max_len, kernels, prefill)


def _model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], device: torch.device, max_len: int | None,
           kernels: str | None = None, prefill: str = "float32") -> LlamaModel:
    weights = fuse(cfg, tensors)
    if device.type == "cpu":
        tensors.clear()  # `weights` holds the last reference: each old tensor is freed as it moves
        hugepages.place(weights)  # a decode step streams them all: on huge pages, fewer TLB misses
    return LlamaModel(cfg, weights, min(max_len or cfg.max_model_len, cfg.max_model_len), kernels=kernels,
                      prefill=prefill)


SHARD_BYTES = 2 << 30  # a quantized folder's shards: at most this much each (as Hub checkpoints cut theirs)


def write_quantized(folder: Path, out: Path, scheme: str) -> list[str]:
    """The full-precision base in `folder` quantized in `scheme` into `out`: its weights in
    safetensors (`quantized_names`' as X.qweight + X.scales, the rest as they are, shards of at
    most SHARD_BYTES with their index) and `quant.QUANT_FILE`; one tensor in memory at a time.
    Returns the files written, by name. `folder` is checked first as `load_model` reads it."""
    quant.check_scheme(scheme)
    if quant.stored_scheme(folder):
        raise ModelLoadError(f"{folder}: already quantized ({quant.stored_scheme(folder)}); quantize the "
                             "full-precision model")
    cfg = ModelConfig.from_folder(folder)
    wanted, files = expected_shapes(cfg), weight_files(folder)
    quantized = quantized_names(cfg)
    _check_widths(folder, wanted, quantized, scheme)
    out.mkdir(parents=True, exist_ok=True)
    return write_weights(out, (_read(files, {name: wanted[name]}, None, "cpu", quantized & {name}, scheme)
                               for name in wanted), quantized, scheme)


def write_weights(out: Path, tensors, quantized: set[str], scheme: str | None, record: dict | None = None) -> list[str]:
    """Weights into `out` in the layout `load_model` reads: `tensors` yields dicts as `_read` gives
    them (a quantized X.weight's codes under X.weight, its scales under X.weight_s), written as
    X.qweight and X.scales, in safetensors shards of at most SHARD_BYTES (with their index where
    there are several), and `quant.QUANT_FILE` where `scheme` is set (with `record`'s entries).
    Returns the files written."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for t in tensors:
        for key, tensor in t.items():
            key = key[:-len("weight_s")] + "scales" if key.endswith("weight_s") else \
                key[:-len("weight_o")] + "offsets" if key.endswith("weight_o") else \
                key[:-len("weight")] + "qweight" if key in quantized else key
            nbytes = quant.nbytes(tensor)
            if size and size + nbytes > SHARD_BYTES:
                shards.append({})
                size = 0
            shards[-1][key] = tensor.contiguous()
            size += nbytes
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, shard in zip(names, shards):
        save_file(shard, out / fname, metadata={"format": "pt", **({"lorafleet_quantization": scheme} if scheme else {})})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(quant.nbytes(*s.values()) for s in shards)},
                 "weight_map": {k: f for f, s in zip(names, shards) for k in s}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        names.append("model.safetensors.index.json")
    if scheme:
        (out / quant.QUANT_FILE).write_text(json.dumps({"scheme": scheme, **(record or {})}) + "\n")
        names.append(quant.QUANT_FILE)
    return names
