"""An adapter's own embedding, LM head and norms: LoRA on `embed_tokens` and `lm_head`, and the full
copies PEFT saves of them (`modules_to_save`, and the `base_layer` it saves beside an embedding's
LoRA), parsed and checked here; `adapters/adapter.py` reads the projections and calls in.

PEFT semantics mirrored (peft 0.21 and 0.22, `tuners/lora/layer.py::Embedding`, `utils/other.py::
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
* Saved norms: modules_to_save entries are matched as the PEFT that saved the adapter matched
  them (`peft_version` in its config): from 0.22 a module whose full name is the entry or ends
  with "." + the entry (`norm` names the final norm only); before it, or with no version, any
  module whose full name ends with the entry (`norm` names every RMS norm). The trainer's rule
  decides because it decided what was trained, and the weights must hold it all. The input and
  post-attention norms are served saved in every layer or none ([layers, H] each), the final
  norm as [1, H]; a segment's rows are normalized again with the adapter's weight.

Each is a "part", one matrix laid out as rows in the adapter's pages (`adapters/layout.py`):
`PARTS` names them. Refusals follow `adapters/adapter.py`'s rule: they name tensor keys (structure)
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
IN_NORM, POST_NORM, FINAL_NORM = "input_layernorm", "post_attention_layernorm", "model.norm"  # saved norms' kinds
# a module kind -> the name users write (a layer norm's kind stands for every layer's)
HEAD_MODULES = {EMBED: "embed_tokens", LM_HEAD: "lm_head", IN_NORM: IN_NORM, POST_NORM: POST_NORM, FINAL_NORM: "norm"}
NORM_PARTS = {IN_NORM: "in_norm", POST_NORM: "post_norm", FINAL_NORM: "final_norm"}  # [layers or 1, H] each
COPY_PARTS = {EMBED: "embed", LM_HEAD: "lm_head", **NORM_PARTS}  # a module kind -> the part that holds its copy
# Each part is a [rows, width] matrix in the layout.
PARTS = ("embed", "embed_a", "embed_b", "lm_head", "lm_head_a", "lm_head_b", *NORM_PARTS.values())
HEAD_KEY_RE = re.compile(
    r"base_model\.model\.(?P<module>model\.embed_tokens|lm_head|model\.norm"
    r"|model\.layers\.(?P<nlayer>0|[1-9]\d{0,8})\.(?:input_layernorm|post_attention_layernorm))\."
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


def kind_of(module: str) -> str | None:
    """A base module's full name -> its kind in HEAD_MODULES (None: not one that may be saved)."""
    if module in (EMBED, LM_HEAD, FINAL_NORM):
        return module
    last = module.rsplit(".", 1)[-1]
    return last if last in (IN_NORM, POST_NORM) and module.startswith("model.layers.") else None


def _module_names(num_layers: int, qk_norm: bool):
    """The Llama modules (`named_modules()`) a modules_to_save entry may match (q_norm and k_norm
    where the family has them: Qwen3)."""
    yield from ("model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")
    for i in range(num_layers):
        p = f"model.layers.{i}"
        yield from (p, f"{p}.self_attn", f"{p}.mlp", f"{p}.mlp.act_fn", f"{p}.{IN_NORM}", f"{p}.{POST_NORM}",
                    *(f"{p}.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")),
                    *((f"{p}.self_attn.q_norm", f"{p}.self_attn.k_norm") if qk_norm else ()),
                    *(f"{p}.mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")))


PEFT_VERSION_RE = re.compile(r"(\d{1,6})\.(\d{1,6})")  # major.minor; the rest (patch, dev, @commit) unread
DOTTED_FROM = (0, 22)  # the first PEFT whose modules_to_save match is on a dotted suffix


def dotted_match(cfg: dict) -> bool:
    """Whether the PEFT that saved `cfg` matched modules_to_save on a dotted suffix (no version: older)."""
    v = cfg.get("peft_version")
    m = PEFT_VERSION_RE.match(v) if isinstance(v, str) else None
    return m is not None and (int(m.group(1)), int(m.group(2))) >= DOTTED_FROM


def saved_modules(cfg: dict, num_layers: int = 1, qk_norm: bool = False) -> set[str]:
    """The kinds (HEAD_MODULES) of the modules `modules_to_save` names, matched as the PEFT that
    saved it matched them (`dotted_match`). Refuses an entry that matches no module, or one that
    is not served saved (only the embedding, the LM head and the norms are), and a layer norm
    saved in some layers only."""
    dotted = dotted_match(cfg)
    out: set[str] = set()
    for item in cfg.get("modules_to_save") or []:
        found = [m for m in _module_names(num_layers, qk_norm)
                 if m == item or m.endswith("." + item if dotted else item)]
        kinds = {kind_of(m) for m in found}
        if not found or None in kinds:
            raise AdapterError("modules_to_save: an entry names no module the base has, or one that is not supported "
                               "as a saved module (only embed_tokens, lm_head, input_layernorm, "
                               "post_attention_layernorm and norm are)")
        for kind in kinds & {IN_NORM, POST_NORM}:
            if sum(kind_of(m) == kind for m in found) != num_layers:
                raise AdapterError(f"modules_to_save: {kind} is supported saved in every layer or none")
        out |= {k for k in kinds if k is not None}  # None refused above
    return out


def vocab_of(heads: dict[str, HeadWeights], base_vocab: int) -> int:
    """The vocabulary an adapter serves: its copies' rows, else the base's."""
    for full in (EMBED, LM_HEAD):
        w = heads.get(full)
        if w is not None and w.copy is not None:
            return int(w.copy.shape[0])
    return base_vocab


def matrices(heads: dict[str, HeadWeights]) -> dict[str, torch.Tensor]:
    """Each part's matrix as the layout holds it (float32, scale folded in)."""
    out: dict[str, torch.Tensor] = {}
    for full, w in heads.items():
        if w.copy is not None:
            out[COPY_PARTS[full]] = w.copy
        if w.a is None:
            continue
        assert w.b is not None  # a LoRA has both
        if full == EMBED:  # rows looked up by token: A^T [V, r]; then (scale B)^T [r, H]
            out["embed_a"], out["embed_b"] = w.a.t(), (w.b * w.scale).t()
        else:              # A [r, H], then scale B [V, r]
            out["lm_head_a"], out["lm_head_b"] = w.a, w.b * w.scale
    return {p: out[p] for p in PARTS if p in out}


def _what(m) -> str:
    """What a head key (HEAD_KEY_RE's match) holds: "A" or "B" (a LoRA's), or a whole weight:
    "copy" (`.weight`), "wrapped" (`.modules_to_save.weight`), "base" (`.base_layer.weight`),
    "original" (`.original_module.weight`)."""
    ab = m.group("ab") or m.group("eab")
    return ab or {"base_layer.": "base", "modules_to_save.": "wrapped", "original_module.": "original",
                  None: "copy"}[m.group("base")]


def header_parts(header: dict) -> dict[str, tuple[int, int]]:
    """Part -> (rows, width) from a safetensors header's shapes alone (the layout's plan before
    the data is read; loading checks the shapes). Keys that are not well-formed parts are left out."""
    shapes: dict[tuple[str, str], list[int]] = {}
    norms: dict[str, tuple[set, int]] = {}
    for key, info in header.items():
        m = HEAD_KEY_RE.fullmatch(key)
        if m is None or m.group("kind") == "bias" or m.group("mag") is not None:
            continue  # not a part (loading refuses what is malformed)
        kind = kind_of(m.group("module"))
        assert kind is not None  # HEAD_KEY_RE's modules are kinds
        if kind in NORM_PARTS:  # a vector [H] a layer: the part's rows are the layers found
            if len(info["shape"]) == 1 and m.group("base") != "original_module.":
                layers, width = norms.setdefault(kind, (set(), info["shape"][0]))
                layers.add(m.group("nlayer"))
            continue
        if len(info["shape"]) != 2:
            continue
        what = _what(m)
        shapes[(kind, what if what in ("A", "B") else "copy")] = info["shape"]
    out: dict[str, tuple[int, int]] = {NORM_PARTS[k]: (len(layers), width) for k, (layers, width) in norms.items()}
    for full, part in ((EMBED, "embed"), (LM_HEAD, "lm_head")):
        if (full, "copy") in shapes:
            rows, width = shapes[(full, "copy")]
            out[part] = (rows, width)
        a, b = shapes.get((full, "A")), shapes.get((full, "B"))
        if a is None or b is None:
            continue
        if full == EMBED:
            out["embed_a"], out["embed_b"] = (a[1], a[0]), (b[1], b[0])
        else:
            out["lm_head_a"], out["lm_head_b"] = (a[0], a[1]), (b[0], b[1])
    return {p: out[p] for p in PARTS if p in out}


_Found = dict[str, dict[str, tuple[str, torch.Tensor]]]  # kind -> what (`_what`) -> (the key quoted, tensor)
_Served = set[tuple[str, str | int]]  # (kind, what or layer) of each tensor served


def read_heads(tensors: dict[str, tuple[str, torch.Tensor]], cfg: dict, lora_targets: set[str], base,
               source, scale_of, rank_of, used: set[str] | None = None) -> dict[str, HeadWeights]:
    """The modules' weights from `tensors` (head key -> (its quoted form, tensor), already finite
    floating point), checked against the config: `lora_targets`, the full names target_modules
    selects; `saved_modules(cfg)`, those saved whole. `scale_of(full, r)` and `rank_of(full)` are
    the adapter's PEFT rules; `base` its `BaseShapes`. Returns kind -> HeadWeights (float32; a
    norm's copy [layers or 1, H]). `used` gains the keys of the tensors served (not the others:
    an `original_module` copy, a second copy of the same weight)."""
    saved = saved_modules(cfg, base.num_layers, base.qk_norm)
    found, norms, keys = _sort_tensors(tensors, saved, lora_targets, base.hidden_size, source)
    served = _served_copies(found)
    heads = _norm_heads(norms, saved, base.num_layers, source, served)
    for full in (EMBED, LM_HEAD):
        w = _matrix_head(full, found.get(full, {}), saved, lora_targets, base, source, scale_of, rank_of)
        if w is not None:
            heads[full] = w
    _check_vocabularies(heads, base.vocab_size, source)
    if used is not None:
        used.update(keys[s] for s in served if s in keys)
    return heads


def _sort_tensors(tensors: dict[str, tuple[str, torch.Tensor]], saved: set[str], lora_targets: set[str],
                  hidden: int, source) -> tuple[_Found, dict[str, dict[int, torch.Tensor]], dict[tuple, str]]:
    """Each tensor checked against the config and its shape, and sorted: (kind -> what -> (quoted,
    tensor)) for the embedding and the LM head, (kind -> layer -> vector) for the norms, and
    (kind, what or layer) -> the key it was read from (the first one: the one served)."""
    found: _Found = {}
    norms: dict[str, dict[int, torch.Tensor]] = {}
    keys: dict[tuple, str] = {}
    for key, (quoted, t) in tensors.items():
        m = HEAD_KEY_RE.fullmatch(key)
        assert m is not None  # `tensors` holds head keys
        full = kind_of(m.group("module"))
        assert full is not None  # HEAD_KEY_RE's modules are kinds
        what = _what(m)
        _check_declared(m, full, what, quoted, saved, lora_targets, source)
        if full in NORM_PARTS:
            if t.dim() != 1 or t.shape[0] != hidden:
                raise AdapterError(f"{source}: {quoted}: expected a vector of the base's hidden size ([{hidden}])")
            if what != "original":
                layer = int(m.group("nlayer") or 0)
                norms.setdefault(full, {}).setdefault(layer, t)
                keys.setdefault((full, layer), key)
            continue
        if t.dim() != 2:
            raise AdapterError(f"{source}: {quoted} is not a 2-D matrix")
        found.setdefault(full, {})[what] = (quoted, t)
        keys[(full, what)] = key
    return found, norms, keys


def _check_declared(m: re.Match[str], full: str, what: str, quoted: str, saved: set[str], lora_targets: set[str],
                    source) -> None:
    """Refuses a tensor (`m`: HEAD_KEY_RE's match of its key) of a kind not served on these modules
    (DoRA, lora_bias, a LoRA on a norm, one module's LoRA under the other's names) or that the config
    does not declare."""
    short = HEAD_MODULES[full]
    if m.group("mag") is not None:
        raise AdapterError(f"{source}: holds {quoted}: use_dora on {short} is not supported "
                           "(DoRA is, on the projections)")
    if m.group("kind") == "bias":
        raise AdapterError(f"{source}: holds {quoted}: lora_bias on {short} is not supported "
                           "(it is, on the projections)")
    if what not in ("A", "B"):  # a whole weight
        if what in ("copy", "wrapped", "original") and full not in saved:
            raise AdapterError(f"{source}: holds {quoted}, but modules_to_save does not name {short!r}")
        if what == "base" and full not in lora_targets:
            raise AdapterError(f"{source}: holds {quoted}, but target_modules does not target {short!r}")
        return
    if full in NORM_PARTS:
        raise AdapterError(f"{source}: holds {quoted}: LoRA on {short} is not supported (saving it whole is)")
    if (m.group("eab") is not None) != (full == EMBED):
        raise AdapterError(f"{source}: holds {quoted}: the embedding's LoRA is lora_embedding_A/B, "
                           "the LM head's lora_A/B.weight")
    if full not in lora_targets:
        raise AdapterError(f"{source}: holds {quoted}, but target_modules does not target {short!r}")


def _served_copies(found: _Found) -> _Served:
    """Keeps one copy of each module in `found`, as "copy" (.weight, else the wrapper's, else the
    base layer's; never `original_module`'s); returns the LoRA matrices and copies served."""
    served: _Served = {(full, what) for full, got in found.items() for what in got if what in ("A", "B")}
    for full, got in found.items():
        copies = [k for k in ("copy", "wrapped", "base") if k in got]
        served |= {(full, copies[0])} if copies else set()
        popped = [got.pop(k) for k in copies]
        got.pop("original", None)
        if popped:
            got["copy"] = popped[0]
    return served


def _norm_heads(norms: dict[str, dict[int, torch.Tensor]], saved: set[str], num_layers: int, source,
                served: _Served) -> dict[str, HeadWeights]:
    """The saved norms, each whole (every layer's, or the final one), stacked; `served` gains their layers."""
    heads: dict[str, HeadWeights] = {}
    for kind in saved & NORM_PARTS.keys():
        layers = norms.get(kind, {})
        want = 1 if kind == FINAL_NORM else num_layers
        if sorted(layers) != list(range(want)):
            raise AdapterError(f"{source}: modules_to_save names {HEAD_MODULES[kind]!r}, but the weights hold it "
                               f"for {len(layers)} of the base's {want} {'layers' if want > 1 else 'norm'}")
        heads[kind] = HeadWeights(copy=torch.stack([layers[i] for i in range(want)]).float())
        served |= {(kind, i) for i in range(want)}
    return heads


def _matrix_head(full: str, got: dict[str, tuple[str, torch.Tensor]], saved: set[str], lora_targets: set[str],
                 base, source, scale_of, rank_of) -> HeadWeights | None:
    """The embedding's or LM head's weights (`got`: what -> (quoted, tensor), one copy at most):
    those the config declares must be there, in the base's shapes. None: it has none."""
    short, hidden = HEAD_MODULES[full], base.hidden_size
    if full in saved and "copy" not in got:
        raise AdapterError(f"{source}: modules_to_save names {short!r}, but the weights hold no "
                           f"'base_model.model.{full}.weight'")
    if full in lora_targets and ("A" not in got or "B" not in got):
        names = "lora_embedding_A/lora_embedding_B" if full == EMBED else "lora_A/lora_B"
        raise AdapterError(f"{source}: target_modules targets {short!r}, but the weights hold no {names} for it")
    if not got:
        return None
    w = HeadWeights()
    if "copy" in got:
        quoted, c = got["copy"]
        if c.shape[1] != hidden:
            raise AdapterError(f"{source}: {quoted}: its width does not match the base's hidden size "
                               f"(its shape is {list(c.shape)}, expected [vocab, {hidden}])")
        w.copy = c.float()
    if "A" in got:
        (qa, a), (qb, b) = got["A"], got["B"]
        r = int(a.shape[0])
        vocab = int(w.copy.shape[0]) if w.copy is not None else base.vocab_size
        ins, outs = (vocab, hidden) if full == EMBED else (hidden, vocab)
        if a.shape[1] != ins or b.shape[0] != outs or b.shape[1] != r:
            raise AdapterError(f"{source}: {qa} and {qb}: shapes {list(a.shape)} and {list(b.shape)}, "
                               f"expected [r, {ins}] and [{outs}, r] "
                               f"({short}'s {'vocabulary' if full == EMBED else 'hidden size'} by its "
                               f"{'hidden size' if full == EMBED else 'vocabulary'})")
        if r != rank_of(full):
            raise AdapterError(f"{source}: {qa}: its rank (rows) differs from the config's r (or rank_pattern entry)")
        w.a, w.b, w.scale = a.float(), b.float(), float(scale_of(full, r))
    return w


def _check_vocabularies(heads: dict[str, HeadWeights], base_vocab: int, source) -> None:
    """The saved embedding and LM head cover one vocabulary; one other than the base's is saved in both."""
    vocabs = {HEAD_MODULES[f]: int(h.copy.shape[0]) for f, h in heads.items()  # EMBED's first, as added
              if f in (EMBED, LM_HEAD) and h.copy is not None}
    own = set(vocabs.values())
    if len(own) > 1:
        raise AdapterError(f"{source}: the saved embed_tokens has {vocabs['embed_tokens']} rows but lm_head "
                           f"{vocabs['lm_head']}: both must cover the adapter's vocabulary")
    if own and own != {base_vocab} and len(vocabs) < 2:
        kept = "lm_head" if "embed_tokens" in vocabs else "embed_tokens"
        raise AdapterError(f"{source}: the saved {next(iter(vocabs))} has {next(iter(own))} rows, the base's "
                           f"vocabulary {base_vocab}: an adapter with its own vocabulary saves {kept} too "
                           "(modules_to_save)")


# An adapter's tokenizer.json is parsed while the daemon serves, and the parse holds the interpreter's
# lock (every thread waits): capped at what the largest real vocabularies need
MAX_TOKENIZER_BYTES = 36 << 20
MAX_SIDE_FILE_BYTES = 4 << 20  # the files `Tokenizer.from_pretrained` reads beside it (a few KiB each)


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
        raise AdapterError(f"{path}: {os.path.getsize(path):,} bytes, over the {MAX_TOKENIZER_BYTES >> 20} MiB an "
                           "adapter's tokenizer.json may take (the largest real vocabularies need less)")
    for name in ("tokenizer_config.json", "chat_template.jinja", "chat_template.json", "config.json",
                 "generation_config.json"):  # what `Tokenizer.from_pretrained` reads beside it: parsed holding the GIL
        other = Path(folder) / name
        if os.path.isfile(other) and os.path.getsize(other) > MAX_SIDE_FILE_BYTES:
            raise AdapterError(f"{other}: over {MAX_SIDE_FILE_BYTES >> 20} MiB (a tokenizer's files are a few KiB)")
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
