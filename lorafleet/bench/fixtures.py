"""Random base models of named shapes, built locally with transformers and cached on disk.

The benchmark never downloads a model: a shape's weights are random (seeded), so every machine
builds the same folder, and only the shapes matter for throughput. Outputs are forced to their
length with `ignore_eos`, so random weights do not shorten them.

Cache: `<root>/<shape>-<spec digest>-seed<seed>/` with root = the `root` argument, else
`$LORAFLEET_HOME/bench`, else `~/.cache/lorafleet/bench`. A folder is built in a temporary
sibling and renamed into place, so the cache holds only complete models.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from lorafleet.errors import ConfigError

SPECIAL_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


@dataclass(frozen=True)
class Shape:
    """A Llama-family shape. `head_dim` is hidden_size // num_heads."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    note: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


SHAPES: dict[str, Shape] = {
    "micro": Shape(64, 2, 4, 2, 128, 512, note="for tests"),
    "tiny": Shape(512, 8, 8, 4, 1536, 8192, note="~34M parameters"),
    "smol": Shape(576, 30, 9, 3, 1536, 49152, tie_word_embeddings=True, rope_theta=100000.0,
                  note="SmolLM2-135M's shapes"),
    "1b": Shape(2048, 16, 32, 8, 8192, 32000, note="~1.1B parameters, Llama-style, for GPUs"),
    "8b": Shape(4096, 32, 32, 8, 14336, 128256, rope_theta=500000.0, max_position_embeddings=8192,
                note="Llama-3-8B's shapes, for GPUs: weights made on the device"),
}
ON_DEVICE_ONLY = ("8b",)  # shapes whose weights are never written (fp32 files of 32 GB)


def get_shape(name: str) -> Shape:
    if name not in SHAPES:
        raise ConfigError(f"unknown model shape {name!r} (choose from {', '.join(SHAPES)})")
    return SHAPES[name]


def cache_root() -> Path:
    home = os.environ.get("LORAFLEET_HOME")
    return Path(home) / "bench" if home else Path.home() / ".cache" / "lorafleet" / "bench"


def cache_key(name: str, seed: int = 0, on_device: bool = False) -> str:
    """Shape name + seed, plus a digest of the shape's sizes so an edited table never reuses
    old files (the free-text `note` is left out: rewording it rebuilds nothing)."""
    sizes = {k: v for k, v in asdict(get_shape(name)).items() if k != "note"}
    digest = hashlib.sha256(json.dumps(sizes, sort_keys=True).encode()).hexdigest()[:8]
    return f"{name}-{digest}-seed{seed}" + ("-on-device" if on_device else "")


def build_base(shape: str, root: Path | None = None, seed: int = 0, on_device: bool = False) -> Path:
    """Return the folder of the random `shape` model, building it on first use (fp32,
    safetensors, config.json + generation_config.json, no tokenizer). `on_device` (required for
    `ON_DEVICE_ONLY` shapes): no weight files, only the loader's `RANDOM_WEIGHTS` spec, so the
    engine makes the weights where it runs them (seconds on a GPU, no disk)."""
    spec = get_shape(shape)
    if shape in ON_DEVICE_ONLY and not on_device:
        raise ConfigError(f"the {shape} shape has no weight files (they would take {_fp32_gib(spec):.0f} GiB): "
                          "its weights are made on the device, for `lorafleet bench gpu` only")
    root = Path(root) if root is not None else cache_root()
    final = root / cache_key(shape, seed, on_device)
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
    try:
        _save_random_llama(spec, seed, tmp, on_device)
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "config.json").is_file():  # not a concurrent builder's finished copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _fp32_gib(spec: Shape) -> float:
    h, i, v, layers = spec.hidden_size, spec.intermediate_size, spec.vocab_size, spec.num_layers
    kv = spec.num_kv_heads * spec.head_dim
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i
    return 4 * (layers * per_layer + (1 if spec.tie_word_embeddings else 2) * v * h) / 2 ** 30


def _save_random_llama(spec: Shape, seed: int, folder: Path, on_device: bool = False) -> None:
    import torch
    import transformers

    from lorafleet.model.loader import RANDOM_WEIGHTS

    transformers.utils.logging.disable_progress_bar()
    rope = ({"rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta}}
            if int(transformers.__version__.split(".")[0]) >= 5 else {"rope_theta": spec.rope_theta})
    config = transformers.LlamaConfig(
        hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size, vocab_size=spec.vocab_size,
        tie_word_embeddings=spec.tie_word_embeddings,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=0.02, **rope, **SPECIAL_TOKENS)
    if on_device:
        config.save_pretrained(folder)
        (folder / RANDOM_WEIGHTS).write_text(json.dumps({"seed": seed, "std": config.initializer_range}))
        return
    with torch.random.fork_rng(devices=[]):  # seeded without touching the caller's RNG
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
