"""A GGUF file's tokenizer (`tokenizer.ggml.*`) as a `tokenizers.Tokenizer` and a
tokenizer_config (`tokenizer_parts`), without transformers: "gpt2" (byte-level BPE: tokens and
merges, its pre-tokenizer named by `tokenizer.ggml.pre`) or "llama" (SentencePiece BPE: tokens and
scores, the merges ranked by the merged piece's score, byte fallback); control and user-defined
tokens as added tokens, the chat template from `tokenizer.chat_template` (else an Ollama model's Go
template beside the file, translated: `go_template.beside`). Each pre-tokenizer name
stands for its model's Hugging Face tokenizer.json (normalizer, split, BPE flags), so ids are that
tokenizer's. Other tokenizer models and pre-tokenizers, and a byte-level BPE naming none ("default"),
are refused, named. The file itself is `gguf.GGUFFile`'s."""

from __future__ import annotations

import reprlib
from typing import TYPE_CHECKING, Any

import gguf

from lorafleet.errors import ModelLoadError, UnsupportedModelError
from lorafleet.model import go_template
from lorafleet.model.gguf_header import MAX_MERGES

if TYPE_CHECKING:
    from lorafleet.model.gguf import GGUFFile

# The splits of the Hugging Face tokenizer.json files llama.cpp's pre-tokenizer names stand for.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre (llama.cpp's names and aliases for the families lorafleet serves) -> that model's
# pipeline. Llama 3: whole-word hits first (ignore_merges), a BOS unless the file says otherwise, as in
# llama.cpp. Qwen2/2.5/3 and DeepSeek-R1-Distill-Qwen (Qwen's tokenizer.json): NFC first. "gpt2" is
# lorafleet's own spelling of "gpt-2", kept for the files it wrote before.
_LLAMA3: dict[str, Any] = {"split": _LLAMA3_SPLIT, "ignore_merges": True, "add_bos": True}
_QWEN2: dict[str, Any] = {"split": _QWEN2_SPLIT, "nfc": True}
PRE_TOKENIZERS: dict[str, dict[str, Any]]
PRE_TOKENIZERS = {"llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "qwen2": _QWEN2,
                  "deepseek-r1-qwen": _QWEN2, "smollm": {"digits": True}, "gpt-2": {}, "gpt2": {}}
# llama.cpp's "default" split (and what a file without tokenizer.ggml.pre gets) is no model's own:
# such a file does not say how its model splits text, so it is refused rather than guessed.
_UNNAMED = "default"
TOKENIZER_MODELS = ("gpt2", "llama")
_CONTROL, _USER, _UNKNOWN, _BYTE = (int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED),
                                    int(gguf.TokenType.UNKNOWN), int(gguf.TokenType.BYTE))



def tokenizer_parts(f: GGUFFile):
    """(tokenizers.Tokenizer, tokenizer_config dict) from the file's tokenizer.ggml.* metadata, or
    None when it has none. The config names bos/eos/unk/pad, add_bos_token/add_eos_token and the
    chat template, as a Hub model's tokenizer_config.json does."""
    kind = f.field("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind not in TOKENIZER_MODELS:
        raise UnsupportedModelError(f"{f.path}: GGUF tokenizer model {kind!r} is not supported; lorafleet reads "
                                    f"{', '.join(TOKENIZER_MODELS)}")
    tokens, types, vocab, name = _vocabulary(f)
    if kind == "gpt2":
        backend, add_bos, add_eos = _byte_level_bpe(f, vocab)
    else:
        backend, add_bos, add_eos = _sentencepiece_bpe(f, tokens, vocab, name["unknown"])
    _add_tokens(backend, tokens, types, vocab)
    _wrap_specials(backend, name, vocab, add_bos, add_eos)
    return backend, _tokenizer_config(f, name, add_bos, add_eos)


def _vocabulary(f: GGUFFile) -> tuple[list[str], list[int], dict[str, int], dict[str, str | None]]:
    """The tokens, their types, token -> id (a repeated token's first) and the special tokens'
    names (bos, eos, unknown, padding: None where the file names none, or an id past the tokens)."""
    tokens: list[str] = _array(f, "tokens", str) or []
    types: list[int] = _array(f, "token_type", int, len(tokens)) or [1] * len(tokens)
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    ids = {k: f.field(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")}
    for k, i in ids.items():
        if i is not None and (isinstance(i, bool) or not isinstance(i, int)):
            raise ModelLoadError(f"{f.path}: GGUF metadata tokenizer.ggml.{k}_token_id is {reprlib.repr(i)}, "
                                 "not a token id")
    name = {k: tokens[i] if i is not None and 0 <= i < len(tokens) else None for k, i in ids.items()}
    return tokens, types, vocab, name


def _byte_level_bpe(f: GGUFFile, vocab: dict[str, int]):
    """(backend, add_bos, add_eos) of a "gpt2" tokenizer: the merges, and the pipeline of the model
    its pre-tokenizer names (PRE_TOKENIZERS; refused where it names none lorafleet knows)."""
    import tokenizers
    from tokenizers import decoders, normalizers, pre_tokenizers

    pre = f.field("tokenizer.ggml.pre", _UNNAMED)
    known = ", ".join(PRE_TOKENIZERS)
    if pre == _UNNAMED:
        raise UnsupportedModelError(f"{f.path}: GGUF byte-level BPE tokenizer names no pre-tokenizer "
                                    f"(tokenizer.ggml.pre {pre!r}, llama.cpp's fallback split, no model's own); "
                                    f"re-convert the model with a current llama.cpp; lorafleet reads {known}")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedModelError(f"{f.path}: GGUF pre-tokenizer {pre!r} is not supported; "
                                    f"lorafleet reads {known}")
    spec = PRE_TOKENIZERS[pre]
    merges = _merges(f, vocab)
    backend = _bpe(f, vocab, merges, ignore_merges=spec.get("ignore_merges", False))
    if "split" in spec:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(spec["split"]), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif spec.get("digits"):
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if spec.get("nfc"):
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    add_bos = f.field("tokenizer.ggml.add_bos_token", spec.get("add_bos", False))
    add_eos = f.field("tokenizer.ggml.add_eos_token", False)
    return backend, add_bos, add_eos


def _sentencepiece_bpe(f: GGUFFile, tokens: list[str], vocab: dict[str, int], unk: str | None):
    """(backend, add_bos, add_eos) of a "llama" tokenizer: merges ranked by score, byte fallback, a
    space marker before each piece of text unless the file says otherwise."""
    from tokenizers import decoders, normalizers

    scores = _array(f, "scores", float, len(tokens)) or [0.0] * len(tokens)
    merges = _merges_by_score(tokens, scores, vocab, str(f.path))
    backend = _bpe(f, vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    if f.field("tokenizer.ggml.add_space_prefix", True):  # before each piece of text, as llama.cpp does
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                   normalizers.Replace(" ", "\u2581")])
        strip = [decoders.Strip(" ", 1, 0)]
    else:
        backend.normalizer = normalizers.Replace(" ", "\u2581")
        strip = []
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *strip])
    add_bos, add_eos = f.field("tokenizer.ggml.add_bos_token", True), f.field("tokenizer.ggml.add_eos_token", False)
    return backend, add_bos, add_eos


def _add_tokens(backend, tokens: list[str], types: list[int], vocab: dict[str, int]) -> None:
    """Control and unknown tokens as special added tokens, user-defined ones as plain added tokens."""
    import tokenizers

    added = [tokenizers.AddedToken(tokens[i], special=t != _USER, normalized=False)
             for i, t in enumerate(types) if t in (_CONTROL, _USER, _UNKNOWN) and vocab.get(tokens[i]) == i]
    backend.add_special_tokens([a for a in added if a.special])
    backend.add_tokens([a for a in added if not a.special])


def _wrap_specials(backend, name: dict[str, str | None], vocab: dict[str, int], add_bos, add_eos) -> None:
    """The post-processor that adds the BOS and / or EOS the file asks for (none where it asks for neither)."""
    from tokenizers import processors

    wrap = [t for t in (name["bos"] if add_bos else None, name["eos"] if add_eos else None) if t is not None]
    if wrap:
        def seq(x: str, type_id: int) -> str:
            pieces = (name["bos"] if add_bos else None, x, name["eos"] if add_eos else None)
            return " ".join(f"{p}:{type_id}" for p in pieces if p)
        backend.post_processor = processors.TemplateProcessing(
            single=seq("$A", 0), pair=seq("$A", 0) + " " + seq("$B", 1), special_tokens=[(t, vocab[t]) for t in wrap])


def _tokenizer_config(f: GGUFFile, name: dict[str, str | None], add_bos, add_eos) -> dict:
    """The tokenizer_config a Hub model holds: the special tokens, the BOS / EOS flags, the context
    length and the chat template, each where the file has it."""
    cfg = {"bos_token": name["bos"], "eos_token": name["eos"], "unk_token": name["unknown"],
           "pad_token": name["padding"], "add_bos_token": bool(add_bos), "add_eos_token": bool(add_eos),
           "model_max_length": f.field(f"{f.arch}.context_length"), "tokenizer_class": "PreTrainedTokenizerFast"}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    template = f.field("tokenizer.chat_template")
    if not isinstance(template, str):  # the file's own Jinja wins: llama.cpp and Hugging Face read that one
        template = go_template.beside(f.path)  # an Ollama model's Go template, translated
    if template is not None:
        cfg["chat_template"] = template
    return cfg


def _array(f: GGUFFile, key: str, kind: type, count: int | None = None) -> list | None:
    """tokenizer.ggml.`key`: a list of `kind` (float: any number), `count` long where given (one
    item per token), None where absent; else refused, naming it. Its length is bounded by
    `gguf_header` before the file is read."""
    value = f.field(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    kinds = (int, float) if kind is float else kind
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, kinds) for v in value):
        raise ModelLoadError(f"{f.path}: GGUF metadata tokenizer.ggml.{key} must be an array of "
                             f"{'numbers' if kind is float else kind.__name__}")
    if count is not None and len(value) != count:
        raise ModelLoadError(f"{f.path}: GGUF metadata tokenizer.ggml.{key} has {len(value)} items for "
                             f"{count} tokens")
    return value


def _merges(f: GGUFFile, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """tokenizer.ggml.merges as pairs, each two tokens of the vocabulary whose join is one too,
    else refused, naming the first that is not."""
    merges = []
    for i, m in enumerate(_array(f, "merges", str) or []):
        left, sep, right = m.partition(" ")
        problem = ("is not two pieces separated by a space" if not (sep and left and right) else
                   "names a piece that is not a token" if left not in vocab or right not in vocab else
                   "joins two tokens into one that is not a token" if left + right not in vocab else None)
        if problem:
            raise ModelLoadError(f"{f.path}: GGUF metadata tokenizer.ggml.merges[{i}] {reprlib.repr(m)} "
                                 f"{problem}")
        merges.append((left, right))
    return merges


def _bpe(f: GGUFFile, vocab: dict[str, int], merges: list[tuple[str, str]], **options):
    import tokenizers
    from tokenizers import models

    try:
        return tokenizers.Tokenizer(models.BPE(vocab, merges, **options))
    except Exception as e:  # the tokenizers library raises plain Exceptions; what it refuses, it names
        raise ModelLoadError(f"{f.path}: GGUF tokenizer not readable as BPE ({e})") from None


def _merges_by_score(tokens: list[str], scores: list[float], vocab: dict[str, int],
                     source: str = "") -> list[tuple[str, str]]:
    """A SentencePiece vocabulary's BPE merges: every split of a piece into two pieces of the
    vocabulary, ranked by the merged piece's score (higher first: SentencePiece merges the pair
    whose result scores highest), ties by the pieces' lengths and ids. At most MAX_MERGES, as a
    byte-level BPE's list is bounded (`gguf_header`), else refused."""
    found = []
    for i, tok in enumerate(tokens):
        if vocab.get(tok) != i:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[i], -len(left), -len(right), vocab[left], vocab[right], left, right))
        if len(found) > MAX_MERGES:
            raise ModelLoadError(f"{source}: the GGUF tokenizer.ggml.tokens split into over {MAX_MERGES} merges "
                                 f"(at token {i}), more than a tokenizer holds")
    found.sort()
    return [(m[5], m[6]) for m in found]
