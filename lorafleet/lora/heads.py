"""An adapter's own embedding and LM head: LoRA on `embed_tokens` and `lm_head`, and the full
copies PEFT saves of them (`modules_to_save`, and the `base_layer` it saves beside an embedding's
LoRA), parsed and checked here; `lora/adapter.py` reads the projections and calls in.

PEFT semantics mirrored (peft 0.21, `tuners/lora/layer.py::Embedding`, `utils/other.py::
ModulesToSaveWrapper`, `utils/save_and_load.py`):

* LoRA on the embedding: `lora_embedding_A` [r, V] and `lora_embedding_B` [H, r]; a token t's
  row gains scale * B A[:, t]. Laid out as A^T (V rows of r: one row per token, looked up) and
  (scale B)^T (r rows of H).
* LoRA on the LM head (an `nn.Linear`): `lora_A` [r, H], `lora_B` [V, r]; the logits gain
  scale * B A h. Laid out as A (r rows of H) and scale B (V rows of r).
* A full copy: `<module>.weight` (modules_to_save: PEFT saves the trained copy under the
  module's own name; after a resized vocabulary it saves the wrapper whole too, the same copy as
  `.modules_to_save.weight` beside the resized base's `.original_module.weight`, which is not
  read) or `<module>.base_layer.weight` (PEFT saves the embedding layers whole beside a LoRA on
  them, `save_embedding_layers`, since the vocabulary may have been resized).
  Loading the adapter in PEFT replaces the base's weight with it: here the adapter's requests
  read it instead of the base's. A copy's rows are the adapter's vocabulary, which may be larger
  than the base's (added tokens: the adapter's tokenizer then comes with it, `engine`).

Each is a "part", one matrix laid out as rows in the adapter's pages (`memory/layout.py`):
`PARTS` names them. Refusals follow `lora/adapter.py`'s rule: they name tensor keys (structure)
and fields, never values read from the files.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from lorafleet.errors import AdapterError

EMBED, LM_HEAD = "model.embed_tokens", "lm_head"  # the modules' full names in the base
HEAD_MODULES = {EMBED: "embed_tokens", LM_HEAD: "lm_head"}  # full name -> the name users write
# A part: (module, what) -> its name in the layout. Each is a [rows, width] matrix.
PARTS = ("embed", "embed_a", "embed_b", "lm_head", "lm_head_a", "lm_head_b")
HEAD_KEY_RE = re.compile(
    r"base_model\.model\.(?P<module>model\.embed_tokens|lm_head)\."
    r"(?:(?P<base>base_layer\.|modules_to_save\.|original_module\.)?weight"
    r"|lora_embedding_(?P<eab>A|B)(?:\.(?P<ename>[^.]+))?"
    r"|lora_(?P<ab>A|B)(?:\.(?P<name>[^.]+))?\.(?P<kind>weight|bias)"
    r"|(?P<mag>lora_magnitude_vector)(?:\.(?P<mname>[^.]+))?(?:\.weight)?)")


@dataclass
class HeadWeights:
    """One of the two modules' weights in an adapter: its own copy [V', H] and/or a LoRA (`a`
    [r, in], `b` [out, r] as `nn.Linear` holds them: for the embedding in = V, out = H)."""

    copy: torch.Tensor | None = None
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    scale: float = 1.0

    @property
    def rank(self) -> int:
        return 0 if self.a is None else int(self.a.shape[0])


def saved_modules(cfg: dict) -> set[str]:
    """The full names of the modules `modules_to_save` names (as PEFT matches them: equal to the
    full name or its last part). Refuses other modules: only the embedding and LM head are served."""
    names = cfg.get("modules_to_save") or []
    out = set()
    for item in names:
        found = [full for full in HEAD_MODULES if full == item or full.endswith(f".{item}")]
        if not found:
            raise AdapterError("modules_to_save: only 'embed_tokens' and 'lm_head' are supported as saved "
                               "modules (other fully trained modules are not)")
        out.update(found)
    return out


def vocab_of(heads: dict[str, HeadWeights], base_vocab: int) -> int:
    """The vocabulary an adapter serves: its copies' rows, else the base's."""
    for w in heads.values():
        if w.copy is not None:
            return int(w.copy.shape[0])
    return base_vocab


def matrices(heads: dict[str, HeadWeights]) -> dict[str, torch.Tensor]:
    """Each part's matrix as the layout holds it (float32, scale folded in)."""
    out: dict[str, torch.Tensor] = {}
    for full, w in heads.items():
        part = "embed" if full == EMBED else "lm_head"
        if w.copy is not None:
            out[part] = w.copy
        if w.a is None:
            continue
        if full == EMBED:  # rows looked up by token: A^T [V, r]; then (scale B)^T [r, H]
            out["embed_a"], out["embed_b"] = w.a.t(), (w.b * w.scale).t()
        else:              # A [r, H], then scale B [V, r]
            out["lm_head_a"], out["lm_head_b"] = w.a, w.b * w.scale
    return {p: out[p] for p in PARTS if p in out}


def header_parts(header: dict) -> dict[str, tuple[int, int]]:
    """Part -> (rows, width) from a safetensors header's shapes alone (the layout's plan before
    the data is read; loading checks the shapes). Keys that are not well-formed parts are left out."""
    shapes: dict[tuple[str, str], list[int]] = {}
    for key, info in header.items():
        m = HEAD_KEY_RE.fullmatch(key)
        if m is None or m.group("kind") == "bias" or m.group("mag") is not None or len(info["shape"]) != 2:
            continue  # not a part (loading refuses what is malformed)
        what = "copy" if m.group("ab") is None and m.group("eab") is None else (m.group("ab") or m.group("eab"))
        shapes[(m.group("module"), what)] = info["shape"]
    out: dict[str, tuple[int, int]] = {}
    for full, part in ((EMBED, "embed"), (LM_HEAD, "lm_head")):
        if (full, "copy") in shapes:
            out[part] = tuple(shapes[(full, "copy")])
        a, b = shapes.get((full, "A")), shapes.get((full, "B"))
        if a is None or b is None:
            continue
        if full == EMBED:
            out["embed_a"], out["embed_b"] = (a[1], a[0]), (b[1], b[0])
        else:
            out["lm_head_a"], out["lm_head_b"] = (a[0], a[1]), (b[0], b[1])
    return {p: out[p] for p in PARTS if p in out}


def read_heads(tensors: dict[str, tuple[str, torch.Tensor]], cfg: dict, lora_targets: set[str], hidden: int,
               base_vocab: int, source, scale_of, rank_of) -> dict[str, HeadWeights]:
    """The modules' weights from `tensors` (head key -> (its quoted form, tensor), already finite
    floating point), checked against the config: `lora_targets`, the full names target_modules
    selects; `saved_modules(cfg)`, those saved whole. `scale_of(full, r)` and `rank_of(full)` are
    the adapter's PEFT rules. Returns full name -> HeadWeights (float32)."""
    saved = saved_modules(cfg)
    found: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for key, (quoted, t) in tensors.items():
        m = HEAD_KEY_RE.fullmatch(key)
        full = m.group("module")
        short = HEAD_MODULES[full]
        if m.group("mag") is not None:
            raise AdapterError(f"{source}: holds {quoted}: use_dora on {short} is not supported (DoRA is, on the projections)")
        if m.group("kind") == "bias":
            raise AdapterError(f"{source}: holds {quoted}: lora_bias on {short} is not supported (it is, on the projections)")
        if m.group("ab") is None and m.group("eab") is None:  # a whole weight
            what = {"base_layer.": "base", "modules_to_save.": "wrapped", "original_module.": "original",
                    None: "copy"}[m.group("base")]
            if what in ("copy", "wrapped", "original") and full not in saved:
                raise AdapterError(f"{source}: holds {quoted}, but modules_to_save does not name {short!r}")
            if what == "base" and full not in lora_targets:
                raise AdapterError(f"{source}: holds {quoted}, but target_modules does not target {short!r}")
        else:
            what = m.group("ab") or m.group("eab")
            if (m.group("eab") is not None) != (full == EMBED):
                raise AdapterError(f"{source}: holds {quoted}: the embedding's LoRA is lora_embedding_A/B, "
                                   "the LM head's lora_A/B.weight")
            if full not in lora_targets:
                raise AdapterError(f"{source}: holds {quoted}, but target_modules does not target {short!r}")
        if t.dim() != 2:
            raise AdapterError(f"{source}: {quoted} is not a 2-D matrix")
        found.setdefault(full, {})[what] = (quoted, t)
    for full, got in found.items():  # the copy served: .weight, else the wrapper's, else the base layer's
        copies = [got.pop(k) for k in ("copy", "wrapped", "base") if k in got]
        got.pop("original", None)
        if copies:
            got["copy"] = copies[0]

    heads: dict[str, HeadWeights] = {}
    for full in (EMBED, LM_HEAD):
        got, short = found.get(full, {}), HEAD_MODULES[full]
        if full in saved and "copy" not in got:
            raise AdapterError(f"{source}: modules_to_save names {short!r}, but the weights hold no "
                               f"'base_model.model.{full}.weight'")
        if full in lora_targets and ("A" not in got or "B" not in got):
            names = "lora_embedding_A/lora_embedding_B" if full == EMBED else "lora_A/lora_B"
            raise AdapterError(f"{source}: target_modules targets {short!r}, but the weights hold no {names} for it")
        if not got:
            continue
        w = HeadWeights()
        if "copy" in got:
            quoted, c = got["copy"]
            if c.shape[1] != hidden:
                raise AdapterError(f"{source}: {quoted}: its width does not match the base's hidden size "
                                   f"(expected shape [vocab, {hidden}])")
            w.copy = c.float()
        heads[full] = w
        if "A" in got:
            (qa, a), (qb, b) = got["A"], got["B"]
            r = int(a.shape[0])
            vocab = int(w.copy.shape[0]) if w.copy is not None else base_vocab
            ins, outs = (vocab, hidden) if full == EMBED else (hidden, vocab)
            if a.shape[1] != ins or b.shape[0] != outs or b.shape[1] != r:
                raise AdapterError(f"{source}: {qa} and {qb}: expected shapes [r, {ins}] and [{outs}, r] "
                                   f"({short}'s {'vocabulary' if full == EMBED else 'hidden size'} by its "
                                   f"{'hidden size' if full == EMBED else 'vocabulary'})")
            if r != rank_of(full):
                raise AdapterError(f"{source}: {qa}: its rank (rows) differs from the config's r (or rank_pattern entry)")
            w.a, w.b, w.scale = a.float(), b.float(), float(scale_of(full, r))
    vocabs = {HEAD_MODULES[f]: int(w.copy.shape[0]) for f, w in heads.items() if w.copy is not None}
    own = set(vocabs.values())
    if len(own) > 1:
        raise AdapterError(f"{source}: the saved embed_tokens has {vocabs['embed_tokens']} rows but lm_head "
                           f"{vocabs['lm_head']}: both must cover the adapter's vocabulary")
    if own and own != {base_vocab} and len(vocabs) < 2:
        kept = "lm_head" if "embed_tokens" in vocabs else "embed_tokens"
        raise AdapterError(f"{source}: the saved {next(iter(vocabs))} has {next(iter(own))} rows, the base's "
                           f"vocabulary {base_vocab}: an adapter with its own vocabulary saves {kept} too "
                           "(modules_to_save)")
    return heads


MAX_TOKENIZER_BYTES = 64 << 20  # a tokenizer.json of 150k tokens is ~10 MiB; parsing it holds a worker


def own_tokenizer(folder: Path, vocab: int, base_vocab: int):
    """The tokenizer of an adapter whose embedding / LM head has `vocab` rows, not the base's
    `base_vocab`: its folder's tokenizer files (`model.tokenizer.Tokenizer`), which must know at
    most `vocab` ids (a resized embedding may have padding rows, never missing ones). Read on a
    worker (`memory.residency.inspect`), bounded in size."""
    from lorafleet.errors import ModelLoadError
    from lorafleet.model.tokenizer import Tokenizer

    path = Path(folder) / "tokenizer.json"
    need = (f"its saved embedding / LM head has {vocab} rows, the base's vocabulary {base_vocab}: an adapter "
            "with its own vocabulary is served with its own tokenizer (tokenizer.json, tokenizer_config.json "
            "in its folder, as `tokenizer.save_pretrained` writes them)")
    if not os.path.isfile(path):
        raise AdapterError(f"{path}: missing; {need}")
    if os.path.getsize(path) > MAX_TOKENIZER_BYTES:
        raise AdapterError(f"{path}: over {MAX_TOKENIZER_BYTES >> 20} MiB (a tokenizer is a few MiB)")
    try:
        tok = Tokenizer.from_pretrained(folder)
    except ModelLoadError as e:
        raise AdapterError(str(e)) from None
    except Exception:  # the tokenizers library's own errors may quote the file
        raise AdapterError(f"{path}: not a valid tokenizer.json") from None
    if tok.vocab_size > vocab:
        raise AdapterError(f"{path}: the adapter's tokenizer has {tok.vocab_size} token ids but its saved "
                           f"embedding / LM head {vocab} rows: they must agree (resize the embeddings to "
                           "len(tokenizer) before training)")
    return tok
