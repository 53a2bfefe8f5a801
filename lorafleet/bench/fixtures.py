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
from typing import TypedDict

from lorafleet.errors import ConfigError


class _SpecialTokens(TypedDict):
    pad_token_id: int
    bos_token_id: int
    eos_token_id: int


SPECIAL_TOKENS = _SpecialTokens(pad_token_id=0, bos_token_id=1, eos_token_id=2)


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
    rope_scaling: tuple[tuple[str, float | int | str], ...] = ()  # config.json's, as pairs; () none

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def params(self) -> int:
        """The weights' elements (the embedding and LM head once each where tied)."""
        return sum(n * k for n, k in self.matrices()) + (2 * self.num_layers + 1) * self.hidden_size

    def matrices(self) -> list[tuple[int, int]]:
        """Every weight matrix [N, K]: the embedding, each layer's projections, the LM head where untied."""
        h, i, kv, layers = self.hidden_size, self.intermediate_size, self.num_kv_heads * self.head_dim, self.num_layers
        per_layer = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]
        return [(self.vocab_size, h)] * (1 if self.tie_word_embeddings else 2) + per_layer * layers


SHAPES: dict[str, Shape] = {
    "micro": Shape(64, 2, 4, 2, 128, 512, note="for tests"),
    "tiny": Shape(512, 8, 8, 4, 1536, 8192, note="~34M parameters"),
    "smol": Shape(576, 30, 9, 3, 1536, 49152, tie_word_embeddings=True, rope_theta=100000.0,
                  note="SmolLM2-135M's shapes"),
    "1b": Shape(2048, 16, 32, 8, 8192, 128256, tie_word_embeddings=True, rope_theta=500000.0,
                max_position_embeddings=131072, note="Llama-3.2-1B's shapes",
                rope_scaling=(("rope_type", "llama3"), ("factor", 32.0), ("low_freq_factor", 1.0),
                              ("high_freq_factor", 4.0), ("original_max_position_embeddings", 8192))),
    "8b": Shape(4096, 32, 32, 8, 14336, 128256, rope_theta=500000.0, max_position_embeddings=8192,
                note="Llama-3-8B's shapes: weights made where they run (on the CPU in int4 only)"),
}
ON_DEVICE_ONLY = ("8b",)  # shapes whose weights are never written (fp32 files of 32 GB)
# shapes the CPU runs only quantized, and in which schemes: 8b's fp32 weights (30 GiB) do not fit
# in the 24 GiB of the machines the bench's CPU figures are taken on; int4 (6 GiB) does
CPU_SCHEMES = {"8b": ("int4",)}
CPU_MEMORY_GIB = 24


def get_shape(name: str) -> Shape:
    if name not in SHAPES:
        raise ConfigError(f"unknown model shape {name!r} (choose from {', '.join(SHAPES)})")
    return SHAPES[name]


def cache_root() -> Path:
    home = os.environ.get("LORAFLEET_HOME")
    return Path(home) / "bench" if home else Path.home() / ".cache" / "lorafleet" / "bench"


def check_cpu_fit(shape: str, quantize: str | None) -> None:
    """Refuse a shape the CPU cannot hold in this precision (`CPU_SCHEMES`), in one clear line."""
    schemes = CPU_SCHEMES.get(shape)
    if schemes is not None and quantize not in schemes:
        spec = get_shape(shape)
        raise ConfigError(
            f"the {shape} shape runs on the CPU only with --quantize {' or '.join(schemes)}: its weights take "
            f"{weight_gib(spec, None):.0f} GiB in float32, which do not fit in {CPU_MEMORY_GIB} GiB of memory "
            f"({' and '.join(f'{weight_gib(spec, q):.1f} GiB in {q}' for q in schemes)}, scales included)")


def weight_gib(spec: Shape, quantize: str | None) -> float:
    """The base's weights in GiB as lorafleet holds them on the CPU: fp32, or quantized in
    `quantize` (`lorafleet.model.quant`'s layout: the projections, the LM head and the embedding;
    the norms stay fp32)."""
    if quantize is None:
        return 4 * spec.params() / 2 ** 30
    from lorafleet.model.quant import INT4_GROUP

    total = 4 * (2 * spec.num_layers + 1) * spec.hidden_size
    for n, k in spec.matrices():
        total += n * k if quantize == "int8" else n * k // 2 + 2 * n * (k // INT4_GROUP)
        total += 2 * n if quantize == "int8" else 0
    return total / 2 ** 30


def cache_key(name: str, seed: int = 0, on_device: bool = False) -> str:
    """Shape name + seed, plus a digest of the shape's sizes so an edited table never reuses
    old files (the free-text `note` is left out: rewording it rebuilds nothing; so is an empty
    `rope_scaling`, so the shapes without one keep the folders built before it was a field)."""
    sizes = {k: v for k, v in asdict(get_shape(name)).items() if k != "note" and not (k == "rope_scaling" and not v)}
    digest = hashlib.sha256(json.dumps(sizes, sort_keys=True).encode()).hexdigest()[:8]
    return f"{name}-{digest}-seed{seed}" + ("-on-device" if on_device else "")


def build_base(shape: str, root: Path | None = None, seed: int = 0, on_device: bool = False) -> Path:
    """Return the folder of the random `shape` model, building it on first use (fp32,
    safetensors, config.json + generation_config.json, no tokenizer). `on_device` (required for
    `ON_DEVICE_ONLY` shapes): no weight files, only the loader's `RANDOM_WEIGHTS` spec, so the
    engine makes the weights where it runs them (seconds on a GPU, no disk)."""
    spec = get_shape(shape)
    if shape in ON_DEVICE_ONLY and not on_device:
        raise ConfigError(f"the {shape} shape has no weight files (they would take {weight_gib(spec, None):.0f} GiB): "
                          "its weights are made on the device, where they run (on_device=True)")
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


def _save_random_llama(spec: Shape, seed: int, folder: Path, on_device: bool = False) -> None:
    import torch
    import transformers

    from lorafleet.model.loader import RANDOM_WEIGHTS

    transformers.utils.logging.disable_progress_bar()
    scaling = dict(spec.rope_scaling)
    rope = ({"rope_parameters": {"rope_type": "default", **scaling, "rope_theta": spec.rope_theta}}
            if int(transformers.__version__.split(".")[0]) >= 5 else
            {"rope_theta": spec.rope_theta, **({"rope_scaling": scaling} if scaling else {})})
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
        model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()  # type: ignore[arg-type]  # @wraps(Module.to): typed unbound
    model.save_pretrained(folder, safe_serialization=True)
