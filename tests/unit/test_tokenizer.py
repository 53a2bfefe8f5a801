"""Tokenizer: parity with transformers.AutoTokenizer on a tiny byte-level BPE built here, streaming
decode, chat templates and load errors. No hub downloads: every tokenizer is trained in tmp_path."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from lorafleet.errors import InvalidRequestError, ModelLoadError
from lorafleet.model.tokenizer import IncrementalDecoder, Tokenizer

pytestmark = pytest.mark.unit

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "hello world, this is a tiny corpus for a tiny tokenizer.",
    "héllo wörld 日本語 🙂 ça va? naïve café, Grüße aus Köln.",
    "The quick brown fox jumps over the lazy dog. 1234567890",
    "system user assistant: answer the question politely.",
] * 3

TEXTS = [
    "hello world",
    "héllo wörld 日本語 🙂",
    "  leading spaces and trailing  ",
    "emoji 🙂🙂 and CJK 日本語 mixed with ascii",
    "special <|im_start|> inside text </s>",
    "",
]

# ChatML with block tags on their own lines, so trim_blocks/lstrip_blocks shape the output; uses
# loop controls, tojson, bos_token and raise_exception like real templates do.
CHATML = """{{ bos_token }}
{% for message in messages %}
  {% if message['role'] == 'system' and not loop.first %}
    {{ raise_exception('System message must come first') }}
  {% endif %}
  {% if message['content'] == '' %}
    {% continue %}
  {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if tools %}
<|im_start|>tools
{{ tools | tojson }}<|im_end|>
{% endif %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

CONVERSATIONS = [
    [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "hello world"}],
    [
        {"role": "system", "content": "Réponds en français <b> & 'quotes'."},
        {"role": "user", "content": "héllo wörld 日本語 🙂"},
        {"role": "assistant", "content": "Bonjour! ça va?"},
        {"role": "user", "content": "And then?"},
    ],
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": ""},  # skipped by the template's {% continue %}
        {"role": "user", "content": "x"},
    ],
]

TOOLS = [{"type": "function", "function": {"name": "météo", "description": "<b>weather</b> & more"}}]


def _train_bpe(vocab_size: int = 300) -> RawTokenizer:
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS, trainer)
    bos = raw.token_to_id("<s>")
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return raw


def _write_folder(folder, raw: RawTokenizer, **config_overrides):
    """A model folder: tokenizer.json, tokenizer_config.json (ChatML, AddedToken-dict eos) and
    config.json whose eos_token_id is `</s>`."""
    folder.mkdir(parents=True, exist_ok=True)
    raw.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": {  # AddedToken serialization, as transformers 4 wrote it
            "__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "rstrip": False,
            "normalized": False, "single_word": False, "special": True,
        },
        "chat_template": CHATML,
        **config_overrides,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    model_config = {"eos_token_id": raw.token_to_id("</s>")}
    (folder / "config.json").write_text(json.dumps(model_config), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def raw() -> RawTokenizer:
    return _train_bpe()


@pytest.fixture(scope="module")
def folder(tmp_path_factory, raw):
    return _write_folder(tmp_path_factory.mktemp("model"), raw)


@pytest.fixture(scope="module")
def tok(folder) -> Tokenizer:
    return Tokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def hf(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


# -- parity with transformers ---------------------------------------------------------------------


def test_the_tiny_tokenizer_splits_multibyte_characters(tok):
    # Guards the streaming tests: they only mean something if characters span several tokens.
    ids = tok.encode("日本語 🙂", add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, hf, text):
    assert tok.encode(text) == hf(text)["input_ids"]
    assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]


def test_encode_adds_bos_once(tok):
    ids = tok.encode("hello world")
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(tok, hf, text, skip):
    ids = hf(text)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_properties(tok, hf, raw):
    assert tok.bos_token == "<s>" and tok.bos_token_id == raw.token_to_id("<s>") == hf.bos_token_id
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token_id is None
    assert tok.vocab_size == len(hf)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf, conversation, add_generation_prompt):
    gen = add_generation_prompt
    text = tok.apply_chat_template(conversation, add_generation_prompt=gen)
    assert text == hf.apply_chat_template(conversation, add_generation_prompt=gen, tokenize=False)
    ids = tok.apply_chat_template(conversation, add_generation_prompt=gen, tokenize=True)
    expected = hf.apply_chat_template(
        conversation, add_generation_prompt=gen, tokenize=True, return_dict=False
    )
    assert ids == list(expected)
    assert ids.count(tok.bos_token_id) == 1  # the template's BOS, not a second one from encode


def test_chat_template_extra_variables_and_tojson(tok, hf):
    conversation = CONVERSATIONS[0]
    text = tok.apply_chat_template(conversation, tools=TOOLS)
    expected = hf.apply_chat_template(conversation, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text == expected
    assert '"météo"' in text and "<b>weather</b> & more" in text  # no ASCII or HTML escaping


# -- streaming ------------------------------------------------------------------------------------


def _stream(decoder: IncrementalDecoder, ids) -> list[str]:
    return [decoder.step(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_decode_concatenates_to_decode(tok, text, skip):
    ids = tok.encode(text)
    deltas = _stream(tok.incremental_decoder(skip_special_tokens=skip), ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_decode_of_a_chat_stays_in_a_small_window(tok):
    ids = tok.apply_chat_template(CONVERSATIONS[1], tokenize=True) * 20
    decoder = IncrementalDecoder(tok, skip_special_tokens=False)
    widest = 0
    deltas = []
    for i in ids:
        deltas.append(decoder.step(i))
        widest = max(widest, len(decoder._ids))
    deltas.append(decoder.flush())
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=False)
    assert widest <= 12  # the window, not the whole sequence, is decoded each step


def test_incremental_decode_of_invalid_bytes(tok):
    # A lone UTF-8 continuation byte never completes: the text still comes out, and the window
    # is bounded.
    pieces = tok.encode("日", add_special_tokens=False)
    continuation = next(i for i in reversed(pieces) if tok.decode([i]) == "\ufffd")
    ids = [continuation] * 100 + tok.encode(" ok", add_special_tokens=False)
    decoder = IncrementalDecoder(tok)
    deltas = _stream(decoder, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert len(decoder._ids) <= IncrementalDecoder._MAX_WINDOW


def _spm_folder(folder, tokenizer_config: dict | None = None):
    """A Llama-2-style folder: Metaspace BPE with byte fallback and no post-processor."""
    raw = RawTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    raw.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False)
    raw.train_from_iterator(CORPUS, trainer)
    folder.mkdir()
    raw.save(str(folder / "tokenizer.json"))
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    return folder


def test_add_bos_token_without_post_processor(tmp_path):
    tok = Tokenizer.from_pretrained(_spm_folder(tmp_path / "m", {"bos_token": "<s>", "add_bos_token": True}))
    ids = tok.encode("hello world")
    assert ids[0] == tok.bos_token_id == tok.token_to_id("<s>") and tok.bos_token_id not in ids[1:]
    assert tok.encode("hello world", add_special_tokens=False) == ids[1:]


def test_incremental_decode_keeps_leading_spaces_with_metaspace(tmp_path):
    # SentencePiece-style decoders drop the leading space of the first token they decode; the
    # window's context must keep every later token's space.
    tok = Tokenizer.from_pretrained(_spm_folder(tmp_path / "spm"))

    text = "the quick brown fox jumps ça va 日本語"
    ids = tok.encode(text)
    assert "".join(_stream(tok.incremental_decoder(), ids)) == tok.decode(ids) == text

    # A skipped special token between words must not eat the next word's space.
    eos = tok.token_to_id("</s>")
    ids_with_eos = tok.encode("the quick") + [eos] + tok.encode("the brown fox")[1:]  # no "the"
    assert tok.decode(ids_with_eos) == "the quick brown fox"
    for skip in (True, False):
        streamed = "".join(_stream(tok.incremental_decoder(skip_special_tokens=skip), ids_with_eos))
        assert streamed == tok.decode(ids_with_eos, skip_special_tokens=skip)

    # With the prompt as context, the generated text starts with its space, as it reads after it.
    prompt, generated = ids[:3], ids[3:]
    streamed = "".join(_stream(tok.incremental_decoder(context_ids=prompt), generated))
    assert streamed == tok.decode(ids)[len(tok.decode(prompt)):]
    assert streamed.startswith(" ")


# -- chat template sources and errors -------------------------------------------------------------


def test_raise_exception_in_template_is_an_invalid_request(tok):
    bad = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(InvalidRequestError, match="System message must come first"):
        tok.apply_chat_template(bad)


def test_chat_template_jinja_file_wins_and_matches_transformers(tmp_path, raw):
    folder = _write_folder(tmp_path / "m", raw)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}",
        encoding="utf-8",
    )
    tok = Tokenizer.from_pretrained(folder)
    conv = CONVERSATIONS[0]
    assert tok.apply_chat_template(conv) == "[system] You are helpful.\n[user] hello world\n[assistant] "
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    expected = hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(conv) == expected


def test_named_template_list_and_chat_template_json(tmp_path, raw):
    listed = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "default!"}]
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path / "a", raw, chat_template=listed))
    assert tok.apply_chat_template(CONVERSATIONS[0]) == "default!"

    folder = _write_folder(tmp_path / "b", raw, chat_template=None)
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "from json"}), encoding="utf-8")
    assert Tokenizer.from_pretrained(folder).apply_chat_template(CONVERSATIONS[0]) == "from json"


def test_no_chat_template(tmp_path, raw):
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path / "m", raw, chat_template=None))
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.apply_chat_template(CONVERSATIONS[0])


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        ["hello"],
        [{"role": 1, "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": 5}],
    ],
)
def test_invalid_messages(tok, messages):
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template(messages)


def test_eos_ids_are_the_union_of_the_configs(tmp_path, raw):
    folder = _write_folder(tmp_path / "m", raw)
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [raw.token_to_id("</s>"), raw.token_to_id("<|im_start|>")]}),
        encoding="utf-8",
    )
    tok = Tokenizer.from_pretrained(folder)
    assert tok.eos_token_ids == {raw.token_to_id(t) for t in ("</s>", "<|im_end|>", "<|im_start|>")}


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json") as info:
        Tokenizer.from_pretrained(tmp_path)
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_malformed_files(tmp_path, raw, name):
    folder = _write_folder(tmp_path / "m", raw)
    (folder / name).write_text('{"model": ', encoding="utf-8")
    with pytest.raises(ModelLoadError, match=name) as info:
        Tokenizer.from_pretrained(folder)
    assert str(folder / name) in str(info.value)


def test_template_syntax_error_is_a_load_error(tmp_path, raw):
    with pytest.raises(ModelLoadError, match="tokenizer_config.json"):
        Tokenizer.from_pretrained(_write_folder(tmp_path / "m", raw, chat_template="{% for %}"))
