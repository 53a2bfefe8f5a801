"""GGUF tokenizers as llama.cpp writes them (issue 61): a byte-level BPE ("gpt2") vocabulary under
each pre-tokenizer name llama.cpp's converter writes for the families lorafleet serves, and a
SentencePiece ("llama") vocabulary, encode and decode as the model's Hugging Face tokenizer does
(transformers' PreTrainedTokenizerFast on tokenizer.json), id for id and character for character, on
a corpus of the hard cases; a pre-tokenizer lorafleet does not know is refused by name.

The references are built here, no download: tokenizer.json files whose normalizer, pre-tokenizer,
post-processor, decoder and BPE flags mirror the real models' (Llama 3, Qwen2.5, DeepSeek-R1-Distill-
Qwen, SmolLM2, GPT-2, TinyLlama), with vocabularies trained on the corpus; the GGUF files hold them
as convert_hf_to_gguf.py writes them (token types, merges, pre name, BOS flags)."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import gguf
import pytest

from lorafleet.errors import UnsupportedModelError
from lorafleet.model.tokenizer import Tokenizer

pytestmark = pytest.mark.unit

T = gguf.TokenType
NFD = "Ελληνικά Ťěšť Ünïcödé Ångström crème brûlée"
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "héllo wörld, ça va? naïve café résumé Ångström façade",
    "cafe\u0301 nai\u0308ve re\u0301sume\u0301 A\u030angstro\u0308m",  # decomposed: NFC differs
    NFD, unicodedata.normalize("NFD", NFD),
    "stacked marks: e\u0301\u0302 a\u0300\u0323 z\u0351\u0352a\u0353l\u0354g\u0355o \u0301lone mark",
    "emoji 😀👍🏽🇺🇸🇯🇵❤️ family 👨‍👩‍👧‍👦 rainbow 🏳️‍🌈 ✅ 🦙🦙 😶‍🌫️ (multiple emojis concatenated)",
    "日本語のテキスト、カタカナとひらがな。中文：我想在apple工作1314151天～ 한국어 텍스트입니다",
    "def foo(x):\n    if x > 0:\n        return x ** 2  # square\n\treturn -x\n\n\nclass A:\n    pass\n",
    "a  b   c    d     e      f       g        h",
    "line1\n\nline2\n\n\nline3\r\n\r\nend \n \n\n \t \t\t \t\n  \n   \n    \n     \n",
    "\t\ttabs\tand\t\tmore\t \t",
    "0 1 12 123 1234 12345 123456 1234567 12345678 123456789 1234567890 3.14159 1,000,000 3..3 3...3",
    "¾ ²³ ٣٤٥ ⅧⅫ ①② 12½",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL",
    "it's IT'S don't DON'T they're THEY'RE we've I'm I'M you'll he'd HE'D 'S 'T 're",
    "'REally 'Sure 'Tis 'LLama 'dunno o'clock",
    "mixed: ABC123def456 x=1;y=2 <tag attr=\"v\">text</tag> https://example.com/a?b=c&d=e ",
    "   leading and trailing spaces   ",
    "!!!???... ------======= '''''' ```````\"\"\"\" (normal) [brackets] {braces} ->> =>",
    "нещо на Български и Русский текст; العربية مرحبا; हिन्दी नमस्ते; ไทย; עברית",
    "an extraordinarily rare word",
    " ", "  ", "\n", "\n\n", "\t", "", "x",
]
WORD = "extraordinarily"  # a whole word the vocabulary holds but its merges do not build (ignore_merges)
DIGITS = ("1", "2")  # a merge of digits, which a split of single digits never reaches

# tokenizer.json pieces, as the real models' files spell them
LLAMA3 = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
          "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
QWEN2 = LLAMA3.replace("\\p{N}{1,3}", "\\p{N}")


def split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def byte_level(prefix: bool, trim: bool, regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": trim, "use_regex": regex}


def seq(kind: str, *items: dict) -> dict:
    return {"type": "Sequence", kind: list(items)}


QWEN_SPECIALS = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<tool_call>", False),
                 ("</tool_call>", False), ("<|fim_prefix|>", False)]
FAMILIES = {  # bos: the post-processor's; lead: special tokens trained in at ids 0.., else appended
    "llama3": dict(normalizer=None, pre=seq("pretokenizers", split(LLAMA3), byte_level(False, True, False)),
                   post=byte_level(True, False, True), decoder=byte_level(True, True, True), ignore_merges=True,
                   specials=[("<|begin_of_text|>", True), ("<|end_of_text|>", True), ("<|eot_id|>", True)],
                   bos="<|begin_of_text|>", eos="<|eot_id|>"),
    "qwen2": dict(normalizer={"type": "NFC"}, pre=seq("pretokenizers", split(QWEN2), byte_level(False, False, False)),
                  post=byte_level(False, False, False), decoder=byte_level(False, False, False), ignore_merges=False,
                  specials=QWEN_SPECIALS, bos=None, eos="<|im_end|>", pad=3),
    "r1qwen": dict(normalizer={"type": "NFC"}, pre=seq("pretokenizers", split(QWEN2), byte_level(False, False, False)),
                   post=byte_level(False, False, False), decoder=byte_level(False, False, False), ignore_merges=False,
                   specials=[("<｜begin▁of▁sentence｜>", True), ("<｜end▁of▁sentence｜>", True), ("<｜User｜>", False),
                             ("<think>", False)], bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>"),
    "smollm": dict(normalizer=None, pre=seq("pretokenizers", {"type": "Digits", "individual_digits": True},
                                            byte_level(False, True, True)),
                   post=byte_level(True, False, True), decoder=byte_level(False, True, True), ignore_merges=False,
                   lead=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], specials=[], bos=None, eos="<|im_end|>"),
    "gpt2": dict(normalizer=None, pre=byte_level(False, True, True), post=byte_level(True, False, True),
                 decoder=byte_level(False, True, True), ignore_merges=False, specials=[("<|endoftext|>", True)],
                 bos=None, eos="<|endoftext|>"),
}
# tokenizer.ggml.pre -> the family whose tokenizer.json llama.cpp's converter names so (and aliases llama.cpp reads)
PRE_NAMES = {"llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3", "qwen2": "qwen2",
             "deepseek-r1-qwen": "r1qwen", "smollm": "smollm", "gpt-2": "gpt2"}


def special_lines(fam: dict) -> list[str]:
    names = [t for t, _ in fam["specials"]] + fam.get("lead", [])
    return [f"{names[0]}Hi {names[-1]} there{names[0]}", f"  {names[-1]}\n\n{names[0]}x y"]


def build_hf(folder: Path, fam: dict) -> Path:
    """tokenizer.json of the family's pipeline with a byte-level BPE trained on the corpus (and WORD added
    whole), as the model's own file is laid out; returns its path."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import pre_tokenizers, trainers

    empty = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
             "ignore_merges": fam["ignore_merges"], "vocab": {}, "merges": []}
    raw = Raw.from_str(json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                                   "normalizer": fam["normalizer"], "pre_tokenizer": fam["pre"],
                                   "post_processor": None, "decoder": fam["decoder"], "model": empty}))
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=fam.get("lead", []), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator([line for line in CORPUS if WORD not in line] * 3, trainer)
    data = json.loads(raw.to_str())
    model = data["model"]
    model["ignore_merges"] = fam["ignore_merges"]
    vocab = model["vocab"]
    whole = "".join(pre_tokenizers.ByteLevel(use_regex=False).pre_tokenize_str(" " + WORD)[0][0])
    assert whole not in vocab
    vocab[whole] = len(vocab)
    if "".join(DIGITS) not in vocab:
        vocab["".join(DIGITS)] = len(vocab)
        model["merges"].append(list(DIGITS))
    for i, (content, special) in enumerate(fam["specials"]):  # after the vocabulary, as Llama 3's and Qwen's
        data["added_tokens"].append({"id": len(vocab) + i, "content": content, "single_word": False,
                                     "lstrip": False, "rstrip": False, "normalized": False, "special": special})
    if fam["bos"]:
        bos_id = next(a["id"] for a in data["added_tokens"] if a["content"] == fam["bos"])
        bos = {"SpecialToken": {"id": fam["bos"], "type_id": 0}}
        template = {"type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                    "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos,
                             {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {fam["bos"]: {"id": fam["bos"], "ids": [bos_id], "tokens": [fam["bos"]]}}}
        data["post_processor"] = seq("processors", fam["post"], template)
    else:
        data["post_processor"] = fam["post"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    return folder / "tokenizer.json"


def looks_special(token: str) -> bool:
    """convert_hf_to_gguf's `does_token_look_special` for the tokens used here."""
    return token.startswith(("<|", "<｜")) and token.endswith(("|>", "｜>"))


def write_gguf(path: Path, hf_json: Path, pre: str | None, fam: dict, add_bos: bool | None,
               model: str = "gpt2") -> Path:
    """The vocabulary as convert_hf_to_gguf.py's `_set_vocab_gpt2` writes it: every id up to the
    model's vocab size (ids past the tokenizer as UNUSED "[PADn]"), added tokens CONTROL when special
    or special-looking and USER_DEFINED otherwise, the merges, the pre-tokenizer name, bos/eos."""
    data = json.loads(hf_json.read_text())
    vocab = dict(data["model"]["vocab"])
    added = {a["content"]: a for a in data["added_tokens"]}
    vocab.update({c: a["id"] for c, a in added.items()})
    by_id = {i: t for t, i in vocab.items()}
    n = max(by_id) + 1 + fam.get("pad", 0)
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(n)]
    types = [T.UNUSED if i not in by_id else
             (T.CONTROL if added[t]["special"] or looks_special(t) else T.USER_DEFINED) if t in added else T.NORMAL
             for i, t in enumerate(tokens)]
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.context_length", 512)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]])
    if fam["bos"]:
        w.add_bos_token_id(vocab[fam["bos"]])
    w.add_eos_token_id(vocab[fam["eos"]])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    for x in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        x()
    return path


def hf_tokenizer(path: Path, fam: dict):
    from transformers import PreTrainedTokenizerFast

    # lorafleet never cleans up tokenization spaces (Tokenizer.decode), so the reference does not either
    return PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token=fam["bos"], eos_token=fam["eos"],
                                   clean_up_tokenization_spaces=False)


def assert_same(ours: Tokenizer, hf, texts: list[str]) -> None:
    """Equal ids and text; except that a token the HF file calls non-special but that looks special
    (<|fim_prefix|>) is CONTROL in the GGUF file, so it is dropped with the special ones, as llama.cpp
    drops it: the file no longer tells the two apart."""
    lost = {i for t, i in hf.get_added_vocab().items() if looks_special(t) and t not in hf.all_special_tokens}

    def hf_decode(ids: list[int], skip: bool) -> str:
        return hf.decode([i for i in ids if not (skip and i in lost)], skip_special_tokens=skip)

    for text in texts:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            assert ours.encode(text, special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip) == hf_decode(ids, skip), (text, skip)
    for i in range(len(hf)):  # every token alone: partial UTF-8, specials, the whole word
        for skip in (True, False):
            assert ours.decode([i], skip) == hf_decode([i], skip), (i, skip)


@pytest.mark.parametrize("pre", list(PRE_NAMES))
def test_a_byte_level_bpe_encodes_and_decodes_as_the_hf_tokenizer(tmp_path, pre):
    fam = FAMILIES[PRE_NAMES[pre]]
    hf_json = build_hf(tmp_path / "hf", fam)
    hf = hf_tokenizer(hf_json, fam)
    ours = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", hf_json, pre, fam, add_bos=bool(fam["bos"])))
    assert_same(ours, hf, [*CORPUS, "\n".join(CORPUS), *special_lines(fam)])
    # the corpus reaches what sets the families apart
    single_digits = PRE_NAMES[pre] in ("qwen2", "r1qwen", "smollm")
    for text, one in ((" " + WORD, fam["ignore_merges"]), ("".join(DIGITS), not single_digits)):
        assert (len(hf.encode(text, add_special_tokens=False)) == 1) == one, text
    nfd = CORPUS[2]
    assert (hf.encode(nfd) == hf.encode(unicodedata.normalize("NFC", nfd))) == (fam["normalizer"] is not None)
    assert ours.bos_token_id == (hf.bos_token_id if fam["bos"] else None)
    assert hf.convert_tokens_to_ids(fam["eos"]) in ours.eos_token_ids


@pytest.mark.parametrize(("pre", "bos"), [("llama-bpe", True), ("deepseek-r1-qwen", False), ("qwen2", False)])
def test_without_add_bos_token_the_bos_is_llama_cpps_default_for_the_pre_tokenizer(tmp_path, pre, bos):
    """A file without tokenizer.ggml.add_bos_token gets llama.cpp's default for its pre-tokenizer: the
    Llama 3 family adds the BOS, the other byte-level BPEs do not."""
    fam = FAMILIES[PRE_NAMES[pre]]
    ours = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", build_hf(tmp_path / "hf", fam), pre, fam, add_bos=None))
    ids = ours.encode("hello", add_special_tokens=False)
    assert ours.encode("hello") == ([ours.bos_token_id] if bos else []) + ids


def refused(tmp_path: Path, pre: str | None, model: str = "gpt2") -> str:
    fam = FAMILIES["gpt2"]
    path = write_gguf(tmp_path / "t.gguf", build_hf(tmp_path / "hf", fam), pre, fam, add_bos=False, model=model)
    with pytest.raises(UnsupportedModelError) as e:
        Tokenizer.from_gguf(path)
    return str(e.value)


@pytest.mark.parametrize("pre", ["tekken", "falcon", "qwen35", "deepseek-v3", "llama4", "made-up"])
def test_a_pre_tokenizer_lorafleet_does_not_know_is_refused_by_name(tmp_path, pre):
    message = refused(tmp_path, pre)
    assert repr(pre) in message and all(name in message for name in PRE_NAMES)


@pytest.mark.parametrize("pre", ["default", None])
def test_a_byte_level_bpe_that_does_not_name_its_pre_tokenizer_is_refused(tmp_path, pre):
    """llama.cpp's "default" (what a file without the key gets) is its own split, no model's: the
    file does not say how the model splits text, so lorafleet does not guess."""
    message = refused(tmp_path, pre)
    assert "'default'" in message and "re-convert" in message


def test_a_tokenizer_model_lorafleet_does_not_read_is_refused_by_name(tmp_path):
    message = refused(tmp_path, "gpt-2", model="bert")
    assert "'bert'" in message and "gpt2" in message and "llama" in message


def test_a_sentencepiece_vocabulary_encodes_and_decodes_as_the_hf_tokenizer(tmp_path):
    """tokenizer.ggml.model "llama" (TinyLlama, Mistral): a SentencePiece BPE model trained with Llama 2's
    settings, against a tokenizer.json laid out as TinyLlama's and Mistral's (transformers' legacy Llama
    conversion: merges by score, byte fallback, a space before each piece of text; the merges from
    transformers' `generate_merges`), which encodes as sentencepiece itself does. The GGUF file as
    `_set_vocab_sentencepiece` writes it, pre-tokenizer "default" included (no refusal for this model)."""
    import sentencepiece as spm
    from transformers.convert_slow_tokenizer import generate_merges

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in CORPUS if line.strip()] * 3), model_prefix=str(tmp_path / "sp"),
        vocab_size=600, model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True, unk_id=0, bos_id=1,
        eos_id=2, character_coverage=0.995, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    n = sp.get_piece_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = generate_merges(vocab, {p: sp.get_score(i) for i, p in enumerate(pieces)})
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    data = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in enumerate(pieces[:3])],
        "normalizer": seq("normalizers", {"type": "Prepend", "prepend": "\u2581"},
                          {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}),
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos,
                                    {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": seq("decoders", {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                       {"type": "ByteFallback"}, {"type": "Fuse"},
                       {"type": "Strip", "content": " ", "start": 1, "stop": 0}),
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [list(m) for m in merges]},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    fam = {"bos": "<s>", "eos": "</s>"}
    hf = hf_tokenizer(tmp_path / "tokenizer.json", fam)

    w = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    w.add_uint32("llama.context_length", 512)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(pieces)
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([int(T.UNKNOWN if sp.is_unknown(i) else T.CONTROL if sp.is_control(i) else
                           T.UNUSED if sp.is_unused(i) else T.BYTE if sp.is_byte(i) else T.NORMAL) for i in range(n)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    for x in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        x()
    ours = Tokenizer.from_gguf(tmp_path / "t.gguf")

    texts = [*CORPUS, "\n".join(CORPUS), "\u2581already marked"]
    for text in texts:  # the reference is sound: it is sentencepiece's own tokenization (which reads no specials)
        assert hf.encode(text, add_special_tokens=False) == sp.encode(text), text
    texts += ["<s>Hi </s> there<s>", "  </s>\n\n<s>x y"]
    assert any(sp.is_byte(i) for i in sp.encode("\n".join(CORPUS)))  # byte fallback reached
    assert_same(ours, hf, texts)
    assert ours.bos_token_id == 1 and ours.eos_token_ids == {2}
