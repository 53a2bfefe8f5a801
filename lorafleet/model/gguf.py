"""GGUF bases: a llama.cpp / Ollama model file read directly, memory-mapped with the
`gguf` package, its Q8_0 and Q4_0 blocks mapped byte for byte to lorafleet's quantized layout
(`model.quant`), never dequantized to disk.

What a GGUF file gives, and what becomes of it:
- **The architecture** (`general.architecture`): llama (Llama 2/3, Mistral: llama.cpp writes
  them all as llama), qwen2, qwen3. Others are refused, naming them.
- **The hyperparameters** (`<arch>.block_count`, `.embedding_length`, ...) as the Hugging Face
  config.json `ModelConfig.from_dict` reads (`GGUFFile.config`): `pull` stores exactly that file.
  A llama3 rope is a tensor in GGUF (`rope_freqs.weight`, the divisor of each frequency): its
  parameters are recovered from it and checked to give the same frequencies, else refused.
- **The tensors**, renamed to Hugging Face's (`TENSOR_NAMES`). llama.cpp's converter permutes
  the rows of Q and K (and their biases) for the llama architecture, to its rope layout (the two
  halves of each head interleaved): the permutation is undone on whole rows (codes and scales
  move together, so quantized data stays exact). qwen2/qwen3 are written unpermuted.
- **The types, a scheme per tensor**: Q8_0 blocks (fp16 d, 32 int8) are int8 codes with groups
  of 32 and their fp16 scales; Q4_0 blocks (fp16 d, 16 bytes: byte i holds element i in its low
  nibble and i + 16 in its high one, w = d * (q - 8)) are int4 codes as they are: both read byte
  for byte. The other block types llama.cpp's files use (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K,
  Q5_K, Q6_K) are dequantized exactly (`gguf_quants`) and requantized at load to int8 with groups
  of 32, Q8_0's layout: within half an int8 step of each group's largest value, a sixteenth of a
  4-bit code's step, and twice the bytes of a 4-bit type (until kernels read those blocks in
  place). Each weight keeps its own scheme, so llama-quantize's mixes (Q4_K_M: Q6_K on the output
  and on half of attn_v / ffn_down) serve as they are; a float weight among quantized ones is
  quantized to int8 a scale per channel. A float file is served in full precision, or quantized
  at load with `quantize=`. An untied embedding (only looked up) keeps its codes (`Kernels.rows`
  dequantizes the rows a step looks up); in a float model it is dequantized at load, exactly.
  Norms and biases must be float. IQ and ternary types are refused, naming them.
- **The tokenizer** (`tokenizer.ggml.*`): `gguf_tokenizer.tokenizer_parts`.
- **The header** is walked first with every count and length bounded (`gguf_header`): the reader
  believes them.
"""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Collection
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import gguf
import numpy as np
import torch

from lorafleet.errors import ModelLoadError, UnsupportedModelError
from lorafleet.model import gguf_header, gguf_quants, gguf_weights, quant
from lorafleet.model.config import ModelConfig
from lorafleet.model.gguf_rope import ROPE_FREQS, llama3_rope

T = gguf.GGMLQuantizationType
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PERMUTED = {"llama"}  # the architectures whose Q and K rows llama.cpp's converter permutes
FLOAT_TYPES = {T.F32: np.float32, T.F16: np.float16, T.BF16: None}
QUANT_TYPES = {T.Q8_0: "int8", T.Q4_0: "int4"}  # read byte for byte as lorafleet's codes
# affine in groups of 32 (`gguf_quants.affine`): codes q - shift in a scheme, a float16 scale and a
# float32 offset a group (`quant.from_affine`); an offset needs the weight read by `linear`
AFFINE = {T.Q4_1: ("int4", 8), T.Q4_K: ("int4", 8), T.Q5_0: ("int8", 0), T.Q5_1: ("int8", 16),
          T.Q5_K: ("int8", 16)}
REQUANTIZED = (T.Q2_K, T.Q3_K, T.Q6_K)  # groups of 16: dequantized, requantized to int8 in groups of 32
CONVERTED = {**{t: scheme for t, (scheme, _) in AFFINE.items()}, **{t: "int8" for t in REQUANTIZED}}
CONVERTED_GROUP = 32
SUPPORTED = ("F32, F16, BF16 (norms, biases, embedding), Q8_0, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, and "
             "requantized to int8 at load: " + ", ".join(t.name for t in REQUANTIZED))

# GGUF tensor name -> Hugging Face name; "{i}" is the layer
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    **{f"blk.{{i}}.{g}.{kind}": f"model.layers.{{i}}.{block}.{hf}.{kind}"
       for g, (block, hf) in {"attn_q": ("self_attn", "q_proj"), "attn_k": ("self_attn", "k_proj"),
                              "attn_v": ("self_attn", "v_proj"), "attn_output": ("self_attn", "o_proj"),
                              "ffn_gate": ("mlp", "gate_proj"), "ffn_up": ("mlp", "up_proj"),
                              "ffn_down": ("mlp", "down_proj")}.items()
       for kind in ("weight", "bias")},
}

def is_gguf(path: str | Path) -> bool:
    path = Path(path)
    return path.suffix.lower() == ".gguf" and path.is_file()


def _hf_name(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        hf = TENSOR_NAMES.get(".".join(["blk", "{i}", *parts[2:]]))
        return hf.replace("{i}", parts[1]) if hf else None
    return TENSOR_NAMES.get(name)


@dataclass
class _Tensor:
    name: str               # Hugging Face's
    gguf_name: str
    type: T
    shape: tuple[int, ...]  # Hugging Face's order: [N, K] for a weight
    data: np.ndarray        # memory-mapped


class GGUFFile:
    """A GGUF model file, memory-mapped: its config (Hugging Face style), its scheme and its
    tensors by Hugging Face name. Raises `ModelLoadError` / `UnsupportedModelError` naming what
    cannot be served."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        gguf_header.check(self.path)  # the reader believes every count the file declares: each is bounded first
        try:
            self.reader = gguf.GGUFReader(self.path)
        except (ValueError, OSError, KeyError, IndexError) as e:  # an unknown type is a ValueError
            raise ModelLoadError(f"{self.path}: unreadable GGUF file ({e})") from None
        self.arch = self._str("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise UnsupportedModelError(f"{self.path}: GGUF architecture {self.arch!r} is not supported; lorafleet "
                                        f"serves {', '.join(ARCHITECTURES)}")
        self.tensors: dict[str, _Tensor] = {}
        self.rope_freqs: np.ndarray | None = None
        for t in self.reader.tensors:
            if t.name == ROPE_FREQS:
                self.rope_freqs = np.asarray(t.data, dtype=np.float32).reshape(-1)
                continue
            hf = _hf_name(t.name)
            if hf is None:
                raise UnsupportedModelError(f"{self.path}: tensor {t.name} is not one of a dense {self.arch} model "
                                            "lorafleet serves (mixture of experts and other extras are not)")
            self.tensors[hf] = _Tensor(hf, t.name, T(t.tensor_type), tuple(int(d) for d in reversed(t.shape.tolist())),
                                       t.data)

    # -- metadata --------------------------------------------------------------------------------

    def field(self, key: str, default=None):
        f = self.reader.get_field(key)
        return default if f is None else f.contents()

    def _str(self, key: str) -> str:
        value = self.field(key)
        if not isinstance(value, str):
            raise ModelLoadError(f"{self.path}: GGUF metadata {key} missing")
        return value

    def _hp(self, key: str, default=None, kind=int):
        """A hyperparameter: a positive integer (`kind` int: every size and count) or a finite number
        > 0 (float: the norm's epsilon, the rope's base); anything else is refused, named."""
        value = self.field(f"{self.arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata {self.arch}.{key} missing")
        if isinstance(value, list):
            raise UnsupportedModelError(f"{self.path}: {self.arch}.{key} varies by layer; lorafleet serves one value")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind is float and number:
            value = float(str(np.float32(value)))  # 1e-06, not 9.99999997e-07
        if not (number and (isinstance(value, int) and value >= 1 if kind is int else
                            math.isfinite(value) and value > 0)):
            want = "a positive integer" if kind is int else "a finite number > 0"
            raise ModelLoadError(f"{self.path}: GGUF metadata {self.arch}.{key} is {reprlib.repr(value)}; it must "
                                 f"be {want}")
        return value

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end generation: eos, and the end of turn and of message where named (llama.cpp's
        end-of-generation tokens)."""
        ids = [self.field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return list(dict.fromkeys(i for i in ids if i is not None))

    @cached_property
    def config(self) -> dict:
        """The model's Hugging Face config.json, as `ModelConfig.from_dict` reads it."""
        hidden, heads = self._hp("embedding_length"), self._hp("attention.head_count")
        head_dim = self._hp("attention.key_length", max(1, hidden // heads))
        layers, held = self._hp("block_count"), len({t.gguf_name.split(".")[1] for t in self.tensors.values()
                                                      if t.gguf_name.startswith("blk.")})
        if layers > held:  # before any layer's tensor names are built from it
            raise ModelLoadError(f"{self.path}: GGUF metadata {self.arch}.block_count is {layers}; the file holds the "
                                 f"tensors of {held} layers")
        if self._hp("attention.value_length", head_dim) != head_dim:
            raise UnsupportedModelError(f"{self.path}: key and value head sizes differ; lorafleet serves equal ones")
        if self._hp("rope.dimension_count", head_dim) != head_dim:
            raise UnsupportedModelError(f"{self.path}: rope on {self._hp('rope.dimension_count')} of {head_dim} "
                                        "dimensions (partial rope) is not supported")
        embed = self.tensors.get("model.embed_tokens.weight")
        vocab = self._hp("vocab_size", embed.shape[0] if embed else None)
        theta = self._hp("rope.freq_base", 10000.0, float)
        cfg = {
            "architectures": [ARCHITECTURES[self.arch]], "model_type": self.arch, "hidden_act": "silu",
            "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": self._hp("feed_forward_length"),
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": self._hp("attention.head_count_kv", heads), "head_dim": head_dim,
            "rms_norm_eps": self._hp("attention.layer_norm_rms_epsilon", kind=float), "rope_theta": theta,
            "rope_scaling": self._rope_scaling(theta, head_dim),
            "max_position_embeddings": self._hp("context_length", 4096),
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.eos_token_ids,
            "torch_dtype": {gguf.LlamaFileType.MOSTLY_F16: "float16", gguf.LlamaFileType.ALL_F32: "float32"}.get(
                self.field("general.file_type"), "bfloat16"),
        }
        if self.arch == "llama":
            cfg["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in self.tensors
        return cfg

    def _rope_scaling(self, theta: float, head_dim: int) -> dict | None:
        kind = self.field(f"{self.arch}.rope.scaling.type")
        factor = self.field(f"{self.arch}.rope.scaling.factor")
        if kind not in (None, "none") and self.rope_freqs is None:
            if kind == "linear" and factor:
                return {"rope_type": "linear", "factor": float(factor)}
            raise UnsupportedModelError(f"{self.path}: rope scaling {kind!r} is not supported (none, linear, "
                                        "llama3)")
        if self.rope_freqs is None:
            return None
        return llama3_rope(self.rope_freqs, theta, head_dim, str(self.path))

    @cached_property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.config, source=str(self.path))

    # -- weights ---------------------------------------------------------------------------------

    def scheme(self, quantized: set[str]) -> str | None:
        """How the weights in `quantized` (`loader.quantized_names`) are served: None (all float),
        int8 or int4 (all one scheme), or "mixed" (each its own: `read`); a type lorafleet cannot
        read is refused, naming the tensor and the types it reads."""
        embed = "model.embed_tokens.weight"  # untied, only looked up: its own type (`read`)
        present = [n for n in sorted(quantized) if n in self.tensors
                   and (n != embed or "lm_head.weight" not in self.tensors)]
        for name in present:
            if self.tensors[name].type not in (*QUANT_TYPES, *CONVERTED, *FLOAT_TYPES):
                raise UnsupportedModelError(self._unsupported(name))
        served = {QUANT_TYPES.get(t) or CONVERTED.get(t) for t in (self.tensors[n].type for n in present)}
        schemes = served - {None}
        if not schemes:
            return None
        if None in served:  # a float weight among quantized ones: int8, a scale per channel
            schemes.add("int8")
        return schemes.pop() if len(schemes) == 1 else "mixed"

    @property
    def file_type(self) -> str | None:
        """The mix llama-quantize names the file (general.file_type): Q4_K_M, Q8_0, F16..."""
        value = self.field("general.file_type")
        try:
            return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            return None

    def _unsupported(self, name: str) -> str:
        t = self.tensors[name]
        return (f"{self.path}: tensor {t.gguf_name} is of GGUF type {t.type.name}, which lorafleet does not serve; "
                f"supported types: {SUPPORTED}")

    def read(self, wanted: dict[str, tuple[int, ...]], dtype, device, quantized: Collection[str] = frozenset(),
             scheme: str | None = None) -> dict[str, torch.Tensor]:
        """The `wanted` tensors (Hugging Face names) as `loader._read` gives them: each checked against
        its shape; the `quantized` ones as codes (under X.weight) and fp16 scales (X.weight_s), from
        the file's blocks or, for a float file, quantized in `scheme` as read; the rest in `dtype`
        (None: the file's float dtype)."""
        missing = [n for n in wanted if n not in self.tensors]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ModelLoadError(f"{self.path}: tensors missing from the GGUF file (as Hugging Face names): {shown}")
        out: dict[str, torch.Tensor] = {}
        for name, shape in wanted.items():
            t = self.tensors[name]
            if t.shape != tuple(shape):
                raise ModelLoadError(f"{self.path}: tensor {t.gguf_name} has shape {list(t.shape)}, the file's "
                                     f"metadata implies {list(shape)}")
            if t.type in QUANT_TYPES or t.type in CONVERTED:
                if name not in quantized and name != "model.embed_tokens.weight":
                    raise UnsupportedModelError(f"{self.path}: {t.gguf_name} is {t.type.name}; norms and biases must "
                                                "be F32, F16 or BF16")
                if name not in quantized and not scheme:  # an embedding in a float model: dequantized, exactly
                    out[name] = self._dequantized(t).to(dtype=dtype or torch.float32, device=device)
                    continue
                read_by_linear = name.endswith("_proj.weight") or (name == "lm_head.weight" and name in quantized)
                offsets = None
                if t.type in QUANT_TYPES:
                    q, scales = self._blocks(t)
                elif t.type in AFFINE and (read_by_linear or AFFINE[t.type][1] == 0):
                    q, scales, offsets = self._affine(t)
                else:  # groups of 16, or offsets on a weight `rows` reads (the embedding): int8 of its values
                    q, scales = self._converted(t)
                out[name], out[name + "_s"] = q.to(device), scales.to(device)
                if offsets is not None:
                    out[name + "_o"] = offsets.to(device)
            elif t.type in FLOAT_TYPES:
                w = self._float(t)
                if name in quantized:
                    out[name], out[name + "_s"] = quant.quantize(w.to(device), scheme if scheme in quant.SCHEMES
                                                                 else "int8")
                else:
                    out[name] = w.to(device=device, dtype=dtype or w.dtype)
            else:
                raise UnsupportedModelError(self._unsupported(name))
        return out

    def _unpermute(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """llama.cpp's Q/K row permutation undone: within each head, its rows (2, D/2) interleaved
        as (D/2, 2) by the converter, put back."""
        if self.arch not in PERMUTED or not name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight",
                                                          "k_proj.bias")):
            return rows
        cfg = self.model_config
        heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
        n = rows.shape[0]
        return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)

    def _float(self, t: _Tensor) -> torch.Tensor:
        return self._unpermute(t.name, gguf_weights.float_tensor(t)).contiguous()

    def _dequantized(self, t: _Tensor) -> torch.Tensor:
        return gguf_weights.dequantized(t)  # an embedding's: never permuted

    def _affine(self, t: _Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        q, scale, offset = gguf_weights.affine(t, *AFFINE[t.type])
        return (self._unpermute(t.name, q).contiguous(), self._unpermute(t.name, scale).contiguous(),
                None if offset is None else self._unpermute(t.name, offset).contiguous())

    def _converted(self, t: _Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = gguf_weights.requantized(t, CONVERTED_GROUP)
        return self._unpermute(t.name, q).contiguous(), self._unpermute(t.name, scale).contiguous()

    def _blocks(self, t: _Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = gguf_weights.blocks(t)
        return self._unpermute(t.name, q).contiguous(), self._unpermute(t.name, scale).contiguous()


def open_model(path: str | Path, quantize: str | None = None) -> tuple[GGUFFile, ModelConfig, str | None]:
    """The file, its config and how it is served (`GGUFFile.scheme`): a quantized file in its own
    schemes (`quantize` None, or the same single scheme), a float file in `quantize`'s."""
    from lorafleet.model.loader import quantized_names

    f = GGUFFile(path)
    cfg = f.model_config
    scheme = f.scheme(quantized_names(cfg))
    if scheme and quantize and quantize != scheme:
        raise ModelLoadError(f"{path}: the GGUF file is quantized ({f.file_type or scheme}, served as {scheme}); it "
                             f"cannot be served in {quantize}")
    return f, cfg, scheme or (quant.check_scheme(quantize) if quantize else None)


# -- the store's layout --------------------------------------------------------------------------

def write_folder(path: str | Path, out: Path, quantize: str | None = None) -> tuple[list[str], str | None]:
    """The GGUF model at `path` as a lorafleet model folder in `out`: config.json; tokenizer.json and
    tokenizer_config.json (with the chat template) when the file has a tokenizer; the weights in
    safetensors as `loader.write_quantized` writes them (X.qweight + X.scales, `quant.QUANT_FILE`)
    for a quantized file (or a float one with `quantize`), else in the file's float dtypes. One
    tensor in memory at a time. Returns (the files written, the scheme)."""
    from lorafleet.model.gguf_tokenizer import tokenizer_parts
    from lorafleet.model.loader import expected_shapes, quantized_names, write_weights

    f, cfg, scheme = open_model(path, quantize)
    wanted = expected_shapes(cfg)
    quantized = quantized_names(cfg) if scheme else set()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(f.config, indent=2) + "\n")
    files = ["config.json"]
    parts = tokenizer_parts(f)
    if parts is not None:
        backend, tok_cfg = parts
        backend.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
        files += ["tokenizer.json", "tokenizer_config.json"]
    files += write_weights(out, (f.read({name: wanted[name]}, None, "cpu", quantized & {name}, scheme)
                                 for name in wanted), quantized, scheme,
                           {"gguf": f.file_type} if f.file_type and f.scheme(quantized) else None)
    return files, scheme
