"""Hostile input files (issue 62): a GGUF file, a config.json or `$LORAFLEET_HOME/config.toml`
that declares absurd counts, lengths or values fails its command alone, at once, with a
`LorafleetError` naming the file, the field and the bound; nothing is allocated for what it
declares. Each fixture is built here: GGUF headers by hand (`struct`) where no writer would
write them, whole tiny models with `gguf.GGUFWriter`."""

from __future__ import annotations

import json
import math
import struct
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest

from lorafleet.config import read_config_file
from lorafleet.errors import ConfigError, LorafleetError, ModelLoadError
from lorafleet.model import gguf_header, llama
from lorafleet.model.config import MAX_CONTEXT, MAX_LAYERS, ModelConfig
from lorafleet.model.gguf import GGUFFile
from lorafleet.model.gguf_tokenizer import tokenizer_parts

pytestmark = pytest.mark.unit

V = gguf.GGUFValueType
HP = {"block_count": 1, "context_length": 64, "embedding_length": 8, "feed_forward_length": 16,
      "attention.head_count": 2, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-5,
      "rope.freq_base": 10000.0, "vocab_size": 16}
TOKENS = ["a", "b", "c", "d", "ab", "cd", "abcd", *(f"t{i}" for i in range(9))]  # 16: HP's vocab_size
MERGES = ["a b", "c d", "ab cd"]


def write_model(path: Path, meta: dict | None = None, *, tokens=None, merges=None, types=None) -> Path:
    """A whole tiny llama (random F32 weights, tied head) as llama.cpp writes one; `meta` overrides
    hyperparameters (by key less "llama."); `tokens` adds a byte-level BPE tokenizer."""
    w = gguf.GGUFWriter(path, "llama")
    hp = {**HP, **(meta or {})}
    for key, value in hp.items():
        if isinstance(value, float):
            w.add_float32(f"llama.{key}", value)
        elif isinstance(value, str):
            w.add_string(f"llama.{key}", value)
        else:
            (w.add_uint64 if value >= 1 << 32 else w.add_uint32)(f"llama.{key}", value)
    if tokens is not None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        if types is not None:
            w.add_token_types(types)
        if merges:
            w.add_token_merges(merges)
    rng = np.random.default_rng(0)
    h, i, v = 8, 16, 16
    shapes = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
    for layer in range(HP["block_count"]):
        shapes.update({f"blk.{layer}.{n}": s for n, s in {
            "attn_norm.weight": (h,), "ffn_norm.weight": (h,), "attn_q.weight": (h, h), "attn_k.weight": (h, h),
            "attn_v.weight": (h, h), "attn_output.weight": (h, h), "ffn_gate.weight": (i, h),
            "ffn_up.weight": (i, h), "ffn_down.weight": (h, i)}.items()})
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def string(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def header(*kvs: bytes, tensors: int = 0, count: int | None = None) -> bytes:
    """A GGUF v3 header holding `kvs` (each key + type + value), declaring `count` keys."""
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, len(kvs) if count is None else count) + b"".join(kvs)


def array(key: str, itype: int, count: int, items: bytes = b"") -> bytes:
    return string(key.encode()) + struct.pack("<IIQ", V.ARRAY, itype, count) + items


@pytest.fixture
def no_reader(monkeypatch):
    """The gguf package's reader must not be reached: the header is refused before it."""
    def reader(*_a, **_k):
        raise AssertionError("gguf.GGUFReader read a file the header walk should have refused")
    monkeypatch.setattr(gguf, "GGUFReader", reader)


def refused(path: Path, *words: str, error=ModelLoadError, peak: int = 4 << 20) -> str:
    """GGUFFile(path) raises `error`, its message naming the file and `words`, within `peak` bytes
    of Python allocations (tracemalloc: numpy's included)."""
    tracemalloc.start()
    try:
        with pytest.raises(error) as e:
            GGUFFile(path).model_config
        used = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(e.value)
    assert str(path) in message and all(w in message for w in words), message
    assert used < peak, f"{used} bytes allocated before the refusal"
    return message


# -- (a) counts and lengths bounded by the bytes left, before the reader ----------------------------

def test_an_array_of_a_trillion_bytes_in_a_162_byte_file_is_refused_before_the_reader(tmp_path, no_reader):
    data = header(array("general.junk", V.UINT8, 10 ** 12))
    path = tmp_path / "huge-array.gguf"
    path.write_bytes(data + bytes(162 - len(data)))
    assert path.stat().st_size == 162
    refused(path, "general.junk", str(10 ** 12), str(gguf_header.MAX_ARRAY))


def test_a_count_within_the_bound_but_past_the_files_end_is_refused(tmp_path, no_reader):
    path = tmp_path / "short.gguf"
    path.write_bytes(header(array("general.junk", V.UINT32, 1000), string(b"x")))
    refused(path, "general.junk", "1000 items", "bytes are left")


@pytest.mark.parametrize("where", ["key", "value", "item"])
def test_a_string_longer_than_the_file_is_refused(tmp_path, no_reader, where):
    long = struct.pack("<Q", 1 << 40)
    kv = {"key": long,
          "value": string(b"general.name") + struct.pack("<I", V.STRING) + long,
          "item": array("general.tags", V.STRING, 1, long)}[where]
    path = tmp_path / f"long-{where}.gguf"
    path.write_bytes(header(kv) + bytes(64))
    refused(path, "bytes")


@pytest.mark.parametrize("case, words", [
    ("keys", ["keys", str(gguf_header.MAX_KEYS)]),
    ("tensors", ["tensors", str(gguf_header.MAX_TENSORS)]),
    ("nested", ["general.nested", "array of arrays"]),
    ("type", ["general.odd", "unknown value type 99"]),
    ("magic", ["not a GGUF file"]),
])
def test_impossible_headers_are_refused_by_name(tmp_path, no_reader, case, words):
    data = {"keys": header(count=10 ** 9),
            "tensors": header(tensors=10 ** 9),
            "nested": header(array("general.nested", V.ARRAY, 1)),
            "type": header(string(b"general.odd") + struct.pack("<I", 99)),
            "magic": b"GGML" + bytes(60)}[case]
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(data + bytes(64))
    refused(path, *words)


def test_a_tensor_whose_data_runs_past_the_end_of_the_file_is_refused(tmp_path, no_reader):
    path = write_model(tmp_path / "m.gguf")
    path.write_bytes(path.read_bytes()[:-100])  # the last tensor's data cut short
    refused(path, "blk.0.ffn_down.weight", "runs past the end of the file")


def test_a_non_utf8_string_is_refused_naming_the_key_and_item(tmp_path, no_reader):
    path = write_model(tmp_path / "m.gguf", tokens=[*TOKENS[:-1], b"\xff\xfe"], merges=MERGES)
    refused(path, "tokenizer.ggml.tokens[15]", "not UTF-8")


# -- (b) layers, (c) context ------------------------------------------------------------------------

def test_a_block_count_past_the_layers_the_file_holds_is_refused_before_any_name_is_built(tmp_path):
    path = write_model(tmp_path / "m.gguf", {"block_count": 2 * 10 ** 9})
    refused(path, "llama.block_count", str(2 * 10 ** 9), "tensors of 1 layers")


def test_a_config_json_with_absurd_layers_is_refused_naming_the_bound(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 16,
           "intermediate_size": 16, "num_hidden_layers": 2 * 10 ** 9}
    with pytest.raises(ModelLoadError, match=f"num_hidden_layers.*1 to {MAX_LAYERS}"):
        ModelConfig.from_dict(cfg)


def test_an_absurd_context_length_is_served_at_the_bound_and_the_rope_cache_stays_bounded(tmp_path, monkeypatch):
    from lorafleet.model.loader import load_model

    path = write_model(tmp_path / "m.gguf", {"context_length": 4 * 10 ** 9})
    assert GGUFFile(path).model_config.max_model_len == MAX_CONTEXT
    rows = []
    real = llama.rope_cache

    def recorded(cfg, max_len, dtype, device):  # the rows asked for, built short: the test allocates nothing
        rows.append(max_len)
        return real(cfg, min(max_len, 64), dtype, device)

    monkeypatch.setattr(llama, "rope_cache", recorded)
    load_model(path, "cpu", kernels="torch")
    assert rows == [MAX_CONTEXT]
    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 16,
          "intermediate_size": 16, "num_hidden_layers": 1, "max_position_embeddings": 10 ** 12}
    assert ModelConfig.from_dict(hf).max_model_len == MAX_CONTEXT


# -- (d) the tokenizer's counts -----------------------------------------------------------------------

def test_two_million_merges_are_refused_before_any_is_read(tmp_path, no_reader):
    n = 2_000_000
    path = tmp_path / "merges.gguf"
    path.write_bytes(header(array("tokenizer.ggml.merges", V.STRING, n, string(b"a b") * n)))
    message = refused(path, "tokenizer.ggml.merges", str(n), str(gguf_header.MAX_MERGES))
    assert "merges a tokenizer holds" in message


@pytest.mark.parametrize("key", gguf_header.TOKEN_KEYS)
def test_a_vocabulary_past_the_bound_is_refused(tmp_path, no_reader, key):
    n = gguf_header.MAX_TOKENS + 1
    path = tmp_path / "tokens.gguf"
    path.write_bytes(header(array(key, V.UINT32, n)) + bytes(4 * n))
    refused(path, key, str(n), str(gguf_header.MAX_TOKENS))


def test_a_token_too_long_or_a_vocabulary_too_large_in_text_is_refused(tmp_path, no_reader):
    path = tmp_path / "long-token.gguf"
    path.write_bytes(header(array("tokenizer.ggml.tokens", V.STRING, 1, string(b"x" * 5000))))
    refused(path, "tokenizer.ggml.tokens[0]", str(gguf_header.MAX_TOKEN_BYTES))
    n = gguf_header.MAX_VOCAB_BYTES // gguf_header.MAX_TOKEN_BYTES + 1
    path.write_bytes(header(array("tokenizer.ggml.tokens", V.STRING, n,
                                  string(b"y" * gguf_header.MAX_TOKEN_BYTES) * n)))
    refused(path, "tokenizer.ggml.tokens", str(gguf_header.MAX_VOCAB_BYTES), peak=64 << 20)


def test_a_sentencepiece_vocabulary_splitting_into_too_many_merges_is_refused(tmp_path, monkeypatch):
    from itertools import product

    from lorafleet.model import gguf_tokenizer

    monkeypatch.setattr(gguf_tokenizer, "MAX_MERGES", 10)  # the bound is counted as found, whatever it is
    pieces = ["".join(p) for n in range(1, 5) for p in product("ab", repeat=n)]  # every split of each a piece
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([0.0] * len(pieces))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    f = GGUFFile.__new__(GGUFFile)  # the tokenizer alone: this file has no model
    f.path, f.arch, f.reader = path, "llama", gguf.GGUFReader(path)
    with pytest.raises(ModelLoadError, match=f"{path}: .*tokenizer.ggml.tokens split into over 10 merges"):
        tokenizer_parts(f)


# -- (e) zero heads, bad merges ------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["attention.head_count", "embedding_length", "block_count"])
@pytest.mark.parametrize("value", [0, "8"])
def test_a_zero_or_text_size_is_refused_by_name_not_a_zero_division(tmp_path, key, value):
    refused(write_model(tmp_path / "m.gguf", {key: value}), f"llama.{key}", "positive integer")


@pytest.mark.parametrize("merge, problem", [
    ("abcd", "not two pieces"),
    ("a zz", "not a token"),
    ("a c", "into one that is not a token"),
])
def test_a_bad_merge_is_refused_naming_it(tmp_path, merge, problem):
    f = GGUFFile(write_model(tmp_path / "m.gguf", tokens=TOKENS, merges=[*MERGES, merge]))
    with pytest.raises(ModelLoadError, match=rf"tokenizer\.ggml\.merges\[3\] '{merge}' .*{problem}") as e:
        tokenizer_parts(f)
    assert str(f.path) in str(e.value)


def test_token_types_of_another_length_are_refused(tmp_path):
    f = GGUFFile(write_model(tmp_path / "m.gguf", tokens=TOKENS, merges=MERGES, types=[1] * 3))
    with pytest.raises(ModelLoadError, match=r"tokenizer\.ggml\.token_type has 3 items for 16 tokens"):
        tokenizer_parts(f)


def test_a_well_formed_tokenizer_still_reads(tmp_path):
    backend, _ = tokenizer_parts(GGUFFile(write_model(tmp_path / "m.gguf", tokens=TOKENS, merges=MERGES)))
    assert backend.get_vocab_size() == len(TOKENS)


# -- (f) float hyperparameters ----------------------------------------------------------------------

@pytest.mark.parametrize("key", ["attention.layer_norm_rms_epsilon", "rope.freq_base"])
@pytest.mark.parametrize("value", [math.nan, 0.0, -1e-5, math.inf])
def test_a_gguf_float_hyperparameter_that_is_not_finite_and_positive_is_refused(tmp_path, key, value):
    refused(write_model(tmp_path / "m.gguf", {key: value}), f"llama.{key}", "finite number > 0")


@pytest.mark.parametrize("field, value", [
    ("rms_norm_eps", math.nan), ("rms_norm_eps", 0), ("rms_norm_eps", "small"), ("rope_theta", -1.0),
    ("rope_scaling", {"rope_type": "linear", "factor": 0}),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192}),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
    ("num_attention_heads", 0), ("head_dim", -4), ("vocab_size", math.inf), ("sliding_window", -5),
])
def test_a_config_json_value_that_cannot_be_served_is_refused_naming_it(tmp_path, field, value):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 16,
           "intermediate_size": 16, "num_hidden_layers": 1, field: value}
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))  # NaN and Infinity as Python's json writes them
    with pytest.raises(ModelLoadError) as e:
        ModelConfig.from_folder(folder)
    named = field if field != "rope_scaling" else "rope_scaling."
    assert str(folder / "config.json") in str(e.value) and named in str(e.value)


def test_a_config_json_nested_too_deeply_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ModelLoadError, match="config.json: not a config.json"):
        ModelConfig.from_folder(tmp_path)


# -- pull applies the same bounds ---------------------------------------------------------------------

def test_pull_refuses_a_hostile_gguf_with_the_same_error(tmp_path):
    from lorafleet.store.pull import pull
    from lorafleet.store.store import Store

    path = write_model(tmp_path / "m.gguf", {"attention.layer_norm_rms_epsilon": math.nan})
    with pytest.raises(LorafleetError, match="llama.attention.layer_norm_rms_epsilon"):
        pull(str(path), base=True, store=Store(tmp_path / "store"))


# -- $LORAFLEET_HOME/config.toml -----------------------------------------------------------------------

def test_a_config_toml_nested_three_thousand_deep_is_a_config_error_naming_the_file(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("[serve]\nx = " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(ConfigError, match="nest too deeply") as e:
        read_config_file(path)
    assert str(path) in str(e.value)


def test_a_config_toml_too_large_is_refused_unread(tmp_path):
    from lorafleet.config import MAX_CONFIG_BYTES

    path = tmp_path / "config.toml"
    path.write_text("#" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match=f"{path}: over {MAX_CONFIG_BYTES} bytes"):
        read_config_file(path)


@pytest.mark.parametrize("line, words", [
    ('device = "tpu"', "device must be"),
    ('pool-bytes = "lots"', "is not a size"),
    ('dtype = "float8"', "dtype must be"),
    ('async-decode = "maybe"', "async_decode must be"),
    ("port = 70000", "port must be"),
    ('adapter = "noequals"', "NAME=PATH"),
    ('max-body-bytes = "10"', "max_body_bytes must be"),
])
def test_a_config_toml_value_the_daemon_would_refuse_names_the_file_and_the_key(tmp_path, monkeypatch, line, words):
    from typer.testing import CliRunner

    from lorafleet.cli.main import app

    monkeypatch.setenv("LORAFLEET_HOME", str(tmp_path))
    (tmp_path / "config.toml").write_text(f"[serve]\n{line}\n")
    result = CliRunner().invoke(app, ["serve", str(tmp_path)])
    key = line.split(" ")[0]
    assert result.exit_code == 2, result.output
    assert f"{tmp_path / 'config.toml'}: [serve] {key}: " in result.output and words in result.output, result.output
