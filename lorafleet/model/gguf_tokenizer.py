"""A GGUF file's tokenizer (`tokenizer.ggml.*`) as a `tokenizers.Tokenizer` and a
tokenizer_config (`tokenizer_parts`), without transformers: "gpt2" (byte-level BPE: tokens and
merges, its pre-tokenizer named by `tokenizer.ggml.pre`) or "llama" (SentencePiece BPE: tokens and
scores, the merges ranked by the merged piece's score, byte fallback); control and user-defined
tokens as added tokens, the chat template from `tokenizer.chat_template`. Other tokenizer models
and pre-tokenizers are refused, named. The file itself is `gguf.GGUFFile`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

import gguf

from lorafleet.errors import UnsupportedModelError

if TYPE_CHECKING:
    from lorafleet.model.gguf import GGUFFile

# tokenizer.ggml.pre -> the pre-tokenizer of a byte-level BPE ("gpt2") vocabulary
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("gpt2", "gpt-2", "default", "llama-bpe", "llama3", "qwen2", "deepseek-r1-qwen", "smollm")
TOKENIZER_MODELS = ("gpt2", "llama")
_CONTROL, _USER, _UNKNOWN, _BYTE = (int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED),
                                    int(gguf.TokenType.UNKNOWN), int(gguf.TokenType.BYTE))



def tokenizer_parts(f: GGUFFile):
    """(tokenizers.Tokenizer, tokenizer_config dict) from the file's tokenizer.ggml.* metadata, or
    None when it has none. The config names bos/eos/unk/pad, add_bos_token/add_eos_token and the
    chat template, as a Hub model's tokenizer_config.json does."""
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

    kind = f.field("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind not in TOKENIZER_MODELS:
        raise UnsupportedModelError(f"{f.path}: GGUF tokenizer model {kind!r} is not supported; lorafleet reads "
                                    f"{', '.join(TOKENIZER_MODELS)}")
    tokens: list[str] = f.field("tokenizer.ggml.tokens") or []
    types: list[int] = f.field("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    ids = {k: f.field(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")}
    name = {k: tokens[i] if i is not None and 0 <= i < len(tokens) else None for k, i in ids.items()}
    if kind == "gpt2":
        pre = f.field("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise UnsupportedModelError(f"{f.path}: GGUF pre-tokenizer {pre!r} is not supported; lorafleet reads "
                                        f"{', '.join(PRE_TOKENIZERS)}")
        merges = [tuple(m.split(" ", 1)) for m in f.field("tokenizer.ggml.merges") or []]
        backend = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in ("llama-bpe", "llama3")))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        if pre in ("llama-bpe", "llama3", "qwen2", "deepseek-r1-qwen"):
            split = tokenizers.Regex(_LLAMA3_SPLIT if pre in ("llama-bpe", "llama3") else _QWEN2_SPLIT)
            backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(split, "isolated"), byte_level])
        elif pre == "smollm":
            backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                             pre_tokenizers.ByteLevel(add_prefix_space=False)])
        else:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        if pre in ("qwen2", "deepseek-r1-qwen"):
            backend.normalizer = normalizers.NFC()
        backend.decoder = decoders.ByteLevel()
        add_bos = f.field("tokenizer.ggml.add_bos_token", False)
        add_eos = f.field("tokenizer.ggml.add_eos_token", False)
    else:
        scores = f.field("tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = _merges_by_score(tokens, scores, vocab)
        backend = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token=name["unknown"], fuse_unk=True,
                                                  byte_fallback=True))
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
    added = [tokenizers.AddedToken(tokens[i], special=t != _USER, normalized=False)
             for i, t in enumerate(types) if t in (_CONTROL, _USER, _UNKNOWN) and vocab.get(tokens[i]) == i]
    backend.add_special_tokens([a for a in added if a.special])
    backend.add_tokens([a for a in added if not a.special])
    wrap = [t for t in (name["bos"] if add_bos else None, name["eos"] if add_eos else None) if t is not None]
    if wrap:
        def seq(x: str, type_id: int) -> str:
            pieces = (name["bos"] if add_bos else None, x, name["eos"] if add_eos else None)
            return " ".join(f"{p}:{type_id}" for p in pieces if p)
        backend.post_processor = processors.TemplateProcessing(
            single=seq("$A", 0), pair=seq("$A", 0) + " " + seq("$B", 1), special_tokens=[(t, vocab[t]) for t in wrap])
    cfg = {"bos_token": name["bos"], "eos_token": name["eos"], "unk_token": name["unknown"],
           "pad_token": name["padding"], "add_bos_token": bool(add_bos), "add_eos_token": bool(add_eos),
           "model_max_length": f.field(f"{f.arch}.context_length"), "tokenizer_class": "PreTrainedTokenizerFast"}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    template = f.field("tokenizer.chat_template")
    if isinstance(template, str):
        cfg["chat_template"] = template
    return backend, cfg


def _merges_by_score(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """A SentencePiece vocabulary's BPE merges: every split of a piece into two pieces of the
    vocabulary, ranked by the merged piece's score (higher first: SentencePiece merges the pair
    whose result scores highest), ties by the pieces' lengths and ids."""
    found = []
    for i, tok in enumerate(tokens):
        if vocab.get(tok) != i:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[i], -len(left), -len(right), vocab[left], vocab[right], left, right))
    found.sort()
    return [(m[5], m[6]) for m in found]
