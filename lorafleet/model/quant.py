"""Weight-only quantized projections: the schemes, their one canonical layout, and the quantizer.

A quantized weight is two tensors, both self-describing, so every kernel and the C++ decode
driver take it as they take any weight (`Kernels.linear(x, q, bias, scales, offsets)`):
- `q`: int8 [N, K] (scheme int8) or uint8 [N, K / 2] (scheme int4, two values a byte);
- `scales`: float16 [N, K / G], one per group of G input elements of each output row;
- and a GGUF file's affine types a third, `offsets`: float32 [N, K / G], w = d * c + o (`from_affine`).
The scheme is `q`'s dtype, the group is K / scales.shape[1]. A weight is w = d * q for int8
(q in -127..127) and w = d * (q - 8) for int4 (q in 0..15), d the group's scale.

Decisions, each with its reason:
- **Symmetric, no zero point.** Trained projections are centred on zero; a zero point costs a
  second number per group, an FMA per group in the kernels, and would not map GGUF's Q4_0, which
  is exactly this form (d * (q - 8)), block for block: a Q4_0 or Q8_0 file loads losslessly.
- **int4's scale rounds the value of largest magnitude to -8** (d = that value / -8, as Q4_0):
  the 16 codes are used, one more step than a clamp at +-7.
- **int8: one scale per output channel** (G = K) when lorafleet quantizes, the best accuracy
  for no more bytes; Q8_0 files keep their groups of 32 (the same kernels: any G that is a
  multiple of 32 and divides K).
- **int4: groups of 32** (`INT4_GROUP`): Q4_0's, so the same model in lorafleet and in
  llama.cpp reads the same bytes.
- **float16 scales**: GGUF's, and 0.0625 bytes a weight at G = 32, against 0.125 in fp32
  (int4 with fp32 scales could not meet 0.15x of fp32's bytes).
- **The int4 nibble order within each run of 32 elements along K**: byte i (0..15) holds element
  i in its low nibble and element i + 16 in its high nibble (Q4_0's): one 16-byte load, masked
  and shifted, is 32 consecutive elements, which is how SIMD kernels unpack it.
- **What is quantized**: the projections (qkv, o, gate_up, down) and the LM head, the bytes a
  decode step reads, and the embedding, its rows dequantized as they are looked up (a step reads
  only its rows, but in full precision an untied embedding of a large vocabulary is a fifth of
  an 8B model's int4 bytes). The embedding's codes may be of either scheme (a GGUF file's
  embedding keeps its own type: only `rows` reads it). Norms, attention, the KV cache and
  adapters stay in the compute dtype, and LoRA reads the full-precision activations
  (W_q dequantized . x + B . A . x).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lorafleet.errors import ModelLoadError
from lorafleet.kernels.reference import codes, dequantize  # noqa: F401 (the layout's oracle, with the kernels)

SCHEMES = ("int8", "int4")
MIXED = "mixed"  # a stored model whose weights each keep their own scheme (a GGUF file's mix)
INT4_GROUP = 32
QUANT_ALIGN = 32  # every group (and so K) is a multiple of this: one SIMD run of int4 codes
# a quantized folder's record: {"scheme": "int8" | "int4" | "mixed"}, and a GGUF file's mix ("gguf": "Q4_K_M")
QUANT_FILE = "lorafleet-quantization.json"


def stored_scheme(folder: Path) -> str | None:
    """The scheme a model folder's weights are stored in (`QUANT_FILE`), None for full precision."""
    path = Path(folder) / QUANT_FILE
    if not path.is_file():
        return None
    try:
        scheme = json.loads(path.read_text())["scheme"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ModelLoadError(f"{path}: expected {{\"scheme\": \"int8\" | \"int4\" | \"mixed\"}}") from None
    if scheme not in (*SCHEMES, MIXED):
        raise ModelLoadError(f"{path}: scheme {scheme!r} is not one lorafleet serves ({', '.join(SCHEMES)}, {MIXED})")
    return scheme


def stored_label(folder: Path) -> str | None:
    """How a stored model is quantized, for people: a GGUF file's mix (Q4_K_M) where it came from
    one, else its scheme (`stored_scheme`)."""
    scheme = stored_scheme(folder)
    if scheme is None:
        return None
    gguf_type = json.loads((Path(folder) / QUANT_FILE).read_text()).get("gguf")
    return gguf_type if isinstance(gguf_type, str) and gguf_type.isprintable() and len(gguf_type) <= 32 else scheme


def scheme_of(q: torch.Tensor) -> str:
    """The scheme a code tensor holds: its dtype says it."""
    if q.dtype == torch.int8:
        return "int8"
    if q.dtype == torch.uint8:
        return "int4"
    raise ValueError(f"not a quantized weight's codes: dtype {q.dtype}")


def in_features(q: torch.Tensor) -> int:
    """K, the input features of a weight whose codes are `q`."""
    return q.shape[1] * (2 if q.dtype == torch.uint8 else 1)


def group_of(q: torch.Tensor, scales: torch.Tensor) -> int:
    return in_features(q) // scales.shape[1]


def check_scheme(name: str) -> str:
    if name not in SCHEMES:
        raise ModelLoadError(f"quantization {name!r} is not supported (choose {' or '.join(SCHEMES)})")
    return name


def check(q: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    """A quantized weight's tensors agree with each other and with the full weight's `shape`
    [N, K]; a clear error naming the tensor otherwise."""
    n, k = shape
    if q.dim() != 2 or q.dtype not in (torch.int8, torch.uint8):
        raise ModelLoadError(f"{name}: quantized codes must be int8 or uint8 [N, K(/2)], not {q.dtype} "
                             f"{tuple(q.shape)}")
    want_q = (n, k if q.dtype == torch.int8 else k // 2)
    if tuple(q.shape) != want_q or scales.dim() != 2 or scales.shape[0] != n or not scales.shape[1] \
            or k % scales.shape[1] or (k // scales.shape[1]) % QUANT_ALIGN:
        raise ModelLoadError(f"{name}: quantized shapes codes {tuple(q.shape)}, scales {tuple(scales.shape)} do not "
                             f"fit the weight [{n}, {k}] (codes {want_q}, scales [{n}, K / group], the group "
                             f"a multiple of {QUANT_ALIGN})")


def quantizable(k: int, group: int) -> bool:
    return k % group == 0 and group % QUANT_ALIGN == 0


def quantize(w: torch.Tensor, scheme: str, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (codes, float16 scales) in the canonical layout (the module
    doc). `group`: int8's default is K (a scale per output channel), int4's `INT4_GROUP`.
    Computed in fp32 by blocks of rows, so a large weight never has a second fp32 copy."""
    n, k = w.shape
    group = group or (k if scheme == "int8" else INT4_GROUP)
    if not quantizable(k, group):
        raise ModelLoadError(f"a weight with {k} input features cannot be quantized in groups of {group} "
                             f"(both must be multiples of {QUANT_ALIGN})")
    q = torch.empty(n, k if scheme == "int8" else k // 2, dtype=torch.int8 if scheme == "int8" else torch.uint8,
                    device=w.device)
    scales = torch.empty(n, k // group, dtype=torch.float16, device=w.device)
    rows = max(1, (1 << 22) // k)
    for r in range(0, n, rows):
        wf = w[r:r + rows].float().view(-1, k // group, group)
        if scheme == "int8":
            d = (wf.abs().amax(-1) / 127).half()
            inv = torch.where(d == 0, 0.0, 1.0 / d.float())
            q[r:r + rows] = (wf * inv[..., None]).round_().clamp_(-127, 127).to(torch.int8).view(-1, k)
        else:
            idx = wf.abs().argmax(-1, keepdim=True)
            d = (wf.gather(-1, idx).squeeze(-1) / -8).half()
            inv = torch.where(d == 0, 0.0, 1.0 / d.float())
            c = (wf * inv[..., None] + 8).round_().clamp_(0, 15).to(torch.uint8).view(-1, k // 32, 2, 16)
            q[r:r + rows] = (c[:, :, 0] | (c[:, :, 1] << 4)).view(-1, k // 2)
        scales[r:r + rows] = d
    return q, scales


def pack_int4(c: torch.Tensor) -> torch.Tensor:
    """int4 codes as integers 0..15 [N, K] -> the layout's bytes uint8 [N, K / 2] (in each run of
    32, byte i: element i low, element i + 16 high)."""
    n = c.shape[0]
    runs = c.to(torch.uint8).view(n, -1, 2, 16)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).view(n, -1)


def from_affine(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, scheme: str,
                shift: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Groups of 32 values scale * q + offset (q integers, `gguf_quants.affine`) as the layout's
    codes c = q - shift (int4: -8..7, int8: -128..127), float16 scales and float32 offsets
    offset + shift * scale (None where both are 0): scale * c + those offsets. Exact but for the
    scale's rounding to float16."""
    s16 = scale.to(torch.float16)
    c = q - shift
    if scheme == "int4":
        codes = pack_int4(c + 8)
    else:
        codes = c.to(torch.int8)
    if offset is None and shift == 0:
        return codes, s16, None
    extra = shift * s16.float()
    return codes, s16, extra if offset is None else offset + extra


def as_int8(q: torch.Tensor, scales: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized weight as int8 codes with groups of `group` (dividing its own), exactly: int4's
    codes q become q - 8 with the same scale, a scale repeated for each smaller group."""
    if q.dtype == torch.uint8:
        n = q.shape[0]
        runs = q.view(n, -1, 16)
        q = (torch.cat([runs & 0x0F, runs >> 4], -1).view(n, -1).to(torch.int16) - 8).to(torch.int8)
    own = group_of(q, scales)
    return q, scales.repeat_interleave(own // group, dim=1) if own != group else scales


def fusable(parts: list[tuple]) -> list[tuple]:
    """Quantized weights (codes, scales, offsets or None) stacked along N into one (qkv, gate_up)
    in one scheme and group: as they are where they agree, else each as int8 with the smallest
    group (a GGUF mix: Q4_0 q beside Q6_K v), exactly; where any has offsets, all have (zeros)."""
    kinds = {(q.dtype, group_of(q, s)) for q, s, _ in parts}
    if len(kinds) > 1:
        group = min(g for _, g in kinds)
        parts = [(*as_int8(q, s, group), o) for q, s, o in parts]
    if any(o is not None for *_, o in parts) and not all(o is not None for *_, o in parts):
        parts = [(q, s, torch.zeros(s.shape, dtype=torch.float32, device=s.device) if o is None else o)
                 for q, s, o in parts]
    return parts


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
