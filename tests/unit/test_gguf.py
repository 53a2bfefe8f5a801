"""GGUF bases (issue 51, model/gguf.py): a Q8_0 or Q4_0 file, written here as llama.cpp writes
one (its Q/K row permutation for the llama architecture, its block types, its tokenizer
metadata), serves what transformers computes on the same weights dequantized (the exact oracle:
`gguf.quants.dequantize` of the very blocks), token for token and within 1e-4 in logits; its
tokenizer encodes and decodes as the original does; `pull` stores it in the store's layout;
what lorafleet cannot serve exactly is refused, naming it. The heavy tier converts with
llama.cpp's own converter (and llama-quantize, where the build has it)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from lorafleet import Engine, SamplingParams
from lorafleet.errors import AdapterError, ModelLoadError, StoreError, UnsupportedModelError
from lorafleet.model import quant
from lorafleet.model.config import ModelConfig
from lorafleet.model.gguf import TENSOR_NAMES, GGUFFile
from lorafleet.model.llama import rope_inv_freq
from lorafleet.model.loader import load_model
from lorafleet.model.tokenizer import Tokenizer
from lorafleet.store.pull import pull
from lorafleet.store.store import Store
from tests.engine.test_parity import engine_prefill_logits, hf_greedy, prompts_of_lengths
from tests.fixtures import ALL7, FAMILIES, build_adapter, build_chat_model, build_model, load_hf
from tests.unit.test_gguf_quants import weight_blocks

Q = gguf.GGMLQuantizationType
GGUF_PY_QUANTIZES = {Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1}  # the rest: random blocks (`weight_blocks`)
ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3"}
GGUF_NAME = {}
for _g, _hf in TENSOR_NAMES.items():  # our table inverted, for the writer (the reader is what is tested)
    GGUF_NAME[_hf] = _g


def gguf_name(hf: str) -> str:
    parts = hf.split(".")
    if parts[:2] == ["model", "layers"]:
        return GGUF_NAME[".".join(["model", "layers", "{i}", *parts[3:]])].replace("{i}", parts[2])
    return GGUF_NAME[hf]


def llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order (its rope layout): each head's two halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope(cfg: dict) -> dict:
    """The rope settings of a config.json of transformers 4 (rope_theta, rope_scaling) or 5 (rope_parameters)."""
    return cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0),
                                          **(cfg.get("rope_scaling") or {})}


def llama3_rope_freqs(cfg: dict) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for a llama3 rope: each frequency's divisor."""
    rs, d = rope(cfg), cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rs["rope_theta"] ** (np.arange(0, d, 2) / d))
    old, factor = rs["original_max_position_embeddings"], rs["factor"]
    lo, hi = rs["low_freq_factor"], rs["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            s = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


def is_quantized_weight(name: str, cfg: dict) -> bool:
    return name.endswith("_proj.weight") or name == "lm_head.weight" or \
        (name == "model.embed_tokens.weight" and cfg.get("tie_word_embeddings", False))


def write_gguf(folder: Path, out: Path, qtype=Q.Q8_0, *, types: dict[str, Q] | None = None, embed_type=None,
               meta: dict | None = None, arch: str | None = None, tokenizer: bool = True) -> Path:
    """The HF model in `folder` as llama.cpp would write it: the projections and the LM head in
    `qtype`, an untied embedding in `embed_type` (default `qtype`, as `convert_hf_to_gguf.py
    --outtype q8_0` does), norms and biases F32; `types` overrides a tensor's type (by HF name),
    `meta` a hyperparameter; the tokenizer of `folder`'s tokenizer.json as llama.cpp's "gpt2"."""
    cfg = json.loads((folder / "config.json").read_text())
    arch = arch or ARCH[cfg["architectures"][0]]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(out, arch)
    hp = {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
          "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
          "attention.head_count": heads, "attention.head_count_kv": kv, "attention.key_length": head_dim,
          "attention.value_length": head_dim, "rope.dimension_count": head_dim,
          "rope.freq_base": float(rope(cfg)["rope_theta"]),
          "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]), "vocab_size": cfg["vocab_size"],
          **(meta or {})}
    for key, value in hp.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    ft = gguf.LlamaFileType
    w.add_file_type({Q.Q8_0: ft.MOSTLY_Q8_0, Q.Q4_0: ft.MOSTLY_Q4_0, Q.Q4_K: ft.MOSTLY_Q4_K_M}.get(qtype, ft.ALL_F32))
    if rope(cfg).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg))
    if tokenizer and (folder / "tokenizer.json").is_file():
        add_gpt2_tokenizer(w, folder)
    else:  # llama.cpp's converter writes the config's ids with any vocabulary
        w.add_bos_token_id(cfg["bos_token_id"])
        w.add_eos_token_id(cfg["eos_token_id"])
    for name, t in load_file(folder / "model.safetensors").items():
        a = t.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            a = llamacpp_permute(a, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            a = llamacpp_permute(a, kv)
        kind = (types or {})[name] if name in (types or {}) else (qtype if is_quantized_weight(name, cfg) else
                                          (embed_type or qtype) if name == "model.embed_tokens.weight" else Q.F32)
        if kind in (Q.F32, Q.F16):
            w.add_tensor(gguf_name(name), a.astype(np.float32 if kind == Q.F32 else np.float16))
        elif kind not in GGUF_PY_QUANTIZES:  # random blocks of a weight's size (the file's values are the oracle's)
            w.add_tensor(gguf_name(name), weight_blocks(kind, a.shape, seed=len(name)), raw_dtype=kind)
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(a, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def add_gpt2_tokenizer(w: gguf.GGUFWriter, folder: Path, pre: str = "gpt2") -> None:
    """tokenizer.json's byte-level BPE as llama.cpp's converter writes it: tokens, token types
    (special added tokens CONTROL), merges, bos/eos, the chat template."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = {**tok["model"]["vocab"], **{a["content"]: a["id"] for a in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(vocab[tcfg["bos_token"]])
    w.add_eos_token_id(vocab[tcfg["eos_token"]])
    w.add_pad_token_id(vocab[tcfg["pad_token"]])
    w.add_add_bos_token(True)
    w.add_chat_template(tcfg["chat_template"])


def dequantized_hf(folder: Path, gguf_path: Path):
    """transformers' model of `folder` with every weight replaced by the GGUF file's values: its
    blocks dequantized by gguf-py and, for the llama architecture, its Q/K rows put back in HF
    order (the oracle)."""
    model = load_hf(folder)
    cfg = json.loads((folder / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    reader = gguf.GGUFReader(gguf_path)
    permuted = reader.get_field("general.architecture").contents() == "llama"
    by_name = {t.name: t for t in reader.tensors}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
                continue
            t = by_name[gguf_name(name)]
            a = gguf.quants.dequantize(t.data, t.tensor_type).reshape(p.shape)
            if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
                h = heads if ".q_proj." in name else kv
                a = a.reshape(h, a.shape[0] // h // 2, 2, -1).swapaxes(1, 2).reshape(p.shape)
            p.copy_(torch.from_numpy(np.array(a)))
    return model


QTYPES = {"Q8_0": (Q.Q8_0, "int8"), "Q4_0": (Q.Q4_0, "int4")}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    return build_model(root / "hf", request.param), root


@pytest.mark.parametrize("qtype", QTYPES)
def test_a_gguf_base_serves_the_dequantized_weights_greedy_tokens_and_logits(family, qtype):
    folder, root = family
    path = write_gguf(folder, root / f"model-{qtype}.gguf", QTYPES[qtype][0])
    engine = Engine(path, pool_bytes=4 << 20)
    assert engine.model.quantization == QTYPES[qtype][1]
    hf = dequantized_hf(folder, path)
    for prompt in prompts_of_lengths([1, 7, 33], seed=2):
        ours = engine_prefill_logits(engine, prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert (ours - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
    prompts = prompts_of_lengths([4, 9, 17], seed=3)
    outs = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 10)


def test_the_blocks_are_the_codes_byte_for_byte_and_the_config_is_the_models(family):
    folder, root = family
    path = write_gguf(folder, root / "bytes.gguf", Q.Q4_0)
    f = GGUFFile(path)
    ours, ref = ModelConfig.from_dict(f.config), ModelConfig.from_folder(folder)
    assert ours.family == {"mistral": "llama"}.get(ref.family, ref.family)  # llama.cpp writes Mistral as llama
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "tie_word_embeddings", "qkv_bias",
                "qk_norm", "bos_token_id", "eos_token_ids"):
        assert getattr(ours, key) == getattr(ref, key), key
    # llama3's parameters recovered from rope_freqs: the same frequencies
    assert rope_inv_freq(ours).tolist() == pytest.approx(rope_inv_freq(ref).tolist(), rel=1e-5)
    model = load_model(path)
    w = load_file(folder / "model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    raw = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_down.weight")
    q, s = model.w["layers.1.down"], model.w["layers.1.down_s"]
    assert np.array_equal(q.numpy().reshape(-1, 16), raw.data.reshape(-1, 18)[:, 2:])
    assert torch.equal(quant.dequantize(q, s), torch.from_numpy(gguf.quants.dequantize(raw.data, Q.Q4_0)))
    assert (quant.dequantize(q, s) - w).abs().max() <= s.float().max() * 8  # the same weight, not another's


# -- the tokenizer ------------------------------------------------------------------------------

TEXTS = ["hello world", "héllo wörld 日本語 🙂 ça va?", "  leading spaces and trailing  ",
         "tabs\tand\nnew lines\n\n",
         "numbers 1234567 and 3.14", "it's we'll they're I'M", "<|im_start|>user\nhi<|im_end|>", "", "ÀÉÎõü ß",
         "the quick brown fox jumps over the lazy dog."]


def tokenizer_folder(folder: Path, pre: str) -> Path:
    """tokenizer.json and tokenizer_config.json of a byte-level BPE trained here, splitting as
    llama.cpp's pre-tokenizer `pre` does (a Hub model's files, as build_chat_model writes them)."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as Raw

    from lorafleet.model.gguf_tokenizer import _LLAMA3_SPLIT, _QWEN2_SPLIT
    from tests.fixtures import CHAT_TEMPLATE

    raw = Raw(models.BPE(ignore_merges=pre == "llama-bpe"))
    byte = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre == "gpt2")
    if pre != "gpt2":
        split = Regex(_LLAMA3_SPLIT if pre == "llama-bpe" else _QWEN2_SPLIT)
        raw.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(split, "isolated"), byte])
    else:
        raw.pre_tokenizer = byte
    if pre == "qwen2":
        raw.normalizer = normalizers.NFC()
    raw.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog. 123 4567",
                             "héllo wörld 日本語 ça va? naïve café it's we'll", "user assistant system"] * 4, trainer)
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir()
    raw.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}))
    return folder


@pytest.mark.unit
@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_a_byte_level_bpe_tokenizer_encodes_and_decodes_as_the_original(tmp_path, pre):
    folder = tokenizer_folder(tmp_path / "tok", pre)
    w = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    add_gpt2_tokenizer(w, folder, pre)
    w.add_uint32("llama.context_length", 512)
    for x in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        x()
    ours, ref = Tokenizer.from_gguf(tmp_path / "t.gguf"), Tokenizer.from_pretrained(folder)
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, special) == ref.encode(text, special), (text, special)
        ids = ref.encode(text)
        assert ours.decode(ids) == ref.decode(ids) and ours.decode(ids, False) == ref.decode(ids, False)
    assert ours.bos_token_id == ref.bos_token_id == 1 and ours.eos_token_ids == {2}
    chat = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(chat, tokenize=True) == ref.apply_chat_template(chat, tokenize=True)


@pytest.mark.unit
def test_a_sentencepiece_tokenizer_encodes_and_decodes_as_sentencepiece(tmp_path):
    """tokenizer.ggml.model "llama" (Llama 2, Mistral): pieces and scores, merges ranked by score,
    byte fallback, a space before the text; checked against sentencepiece itself."""
    import sentencepiece as spm

    corpus = ["hello world, the quick brown fox jumps over the lazy dog.", "héllo wörld ça va? naïve café",
              "user assistant system 12345", "Once upon a time there was a tokenizer."] * 20
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=300,
                                   model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, split_digits=True, bos_id=1, eos_id=2, unk_id=0,
                                   character_coverage=1.0, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    w = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    w.add_uint32("llama.context_length", 512)
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    w.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    w.add_token_types([2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
                       for i in range(sp.get_piece_size())])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    for x in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        x()
    ours = Tokenizer.from_gguf(tmp_path / "t.gguf")
    for text in [t for t in TEXTS if "<|" not in t] + ["Once upon a time", "fox🙂 jumps"]:
        assert ours.encode(text) == [1, *sp.encode(text)], text
        assert ours.decode(sp.encode(text)) == sp.decode(sp.encode(text)), text
    assert ours.bos_token_id == 1 and ours.eos_token_ids == {2}


def test_the_engine_reads_the_gguf_tokenizer_and_chat_template(tmp_path):
    folder = build_chat_model(tmp_path / "chat")
    path = write_gguf(folder, tmp_path / "chat.gguf", Q.Q8_0)
    engine, ref = Engine(path, pool_bytes=4 << 20), Tokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": "héllo wörld"}]
    assert engine.tokenizer.apply_chat_template(chat) == ref.apply_chat_template(chat)
    out = engine.generate([engine.tokenizer.apply_chat_template(chat)], SamplingParams(max_tokens=4, temperature=0.0))
    assert out[0].token_ids and isinstance(out[0].text, str)


# -- the store and the command line ---------------------------------------------------------------

@pytest.mark.parametrize("qtype", QTYPES)
def test_pull_stores_the_gguf_in_the_stores_layout_and_serves_the_same_tokens(tmp_path, qtype):
    folder = build_chat_model(tmp_path / "chat", "qwen3")
    path = write_gguf(folder, tmp_path / "chat.gguf", QTYPES[qtype][0])
    store = Store(tmp_path / "store")
    m = pull(str(path), base=True, store=store)
    assert m["name"] == "chat" and m["quantization"] == qtype and m["format"] == "gguf"  # the file's mix
    stored = store.folder(m)
    assert quant.stored_scheme(stored) == QTYPES[qtype][1]
    names = load_file(stored / "model.safetensors").keys()
    assert "model.layers.0.self_attn.q_proj.qweight" in names and "model.layers.0.self_attn.q_proj.scales" in names
    assert "chat_template" in json.loads((stored / "tokenizer_config.json").read_text())
    prompts = prompts_of_lengths([5, 12], vocab=200, seed=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    direct, from_store = Engine(path, pool_bytes=4 << 20), Engine(stored, pool_bytes=4 << 20)
    assert [o.token_ids for o in direct.generate(prompts, params)] == \
        [o.token_ids for o in from_store.generate(prompts, params)]
    chat = [{"role": "user", "content": "hello"}]
    assert direct.tokenizer.encode(direct.tokenizer.apply_chat_template(chat)) == \
        from_store.tokenizer.encode(from_store.tokenizer.apply_chat_template(chat))
    # an adapter validates against the stored GGUF base; one for another base is refused
    adapter = build_adapter(folder, tmp_path / "a", r=4, target_modules=ALL7)
    assert pull(str(adapter), store=store)["base"]["name"] == "chat"
    other = build_model(tmp_path / "other", "qwen3", hidden_size=96)
    with pytest.raises(AdapterError):
        pull(str(build_adapter(other, tmp_path / "b", r=4, target_modules=ALL7)), name="b", store=store)
    with pytest.raises(StoreError, match="quantized already"):
        pull(str(path), name="again", base=True, quantize="int8", store=store)


def test_the_command_line_serves_a_gguf_file_and_refuses_another_file(tmp_path, capsys):
    import typer

    from lorafleet.cli.serve import model_folder

    folder = build_model(tmp_path / "hf", "llama")
    path = write_gguf(folder, tmp_path / "m.gguf")
    assert model_folder(path) == (path.resolve(), "m", [], {})
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(typer.Exit):
        model_folder(tmp_path / "notes.txt")
    assert "not a GGUF model (*.gguf)" in capsys.readouterr().err
    from typer.testing import CliRunner

    from lorafleet.cli.main import app

    out = CliRunner().invoke(app, ["pull", str(path), "--base", "--quantize", "int4"],
                             env={"LORAFLEET_HOME": str(tmp_path / "home")})
    assert out.exit_code != 0 and "quantized already" in out.output
    # an adapter pulled beside a daemon that serves the file is validated against the file
    adapter = build_adapter(folder, tmp_path / "a", r=4, target_modules=["q_proj", "down_proj"])
    m = pull(str(adapter), store=Store(tmp_path / "store"), served=("m", path))
    assert m["base"] == {"name": "m", "snapshot": None, "folder": str(path.resolve())}


# -- the refusals --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-refusals")
    return build_model(root / "hf", "llama"), root


@pytest.mark.unit
def test_an_unsupported_type_is_refused_naming_it_and_the_supported_ones(llama):
    folder, root = llama
    path = write_gguf(folder, root / "iq4.gguf", types={"model.layers.1.mlp.up_proj.weight": Q.IQ4_NL})
    with pytest.raises(UnsupportedModelError, match=r"blk\.1\.ffn_up\.weight is of GGUF type IQ4_NL.*Q8_0, Q4_0.*Q4_K"):
        load_model(path)


def test_an_untied_embedding_may_be_float_or_quantized(llama):
    folder, root = llama
    # quantized with the model (a float one, in its scheme) or kept in its own type: only rows read it
    for embed, codes in ((Q.F16, torch.int8), (Q.Q4_0, torch.uint8)):
        path = write_gguf(folder, root / f"embed-{embed.name}.gguf", Q.Q8_0, embed_type=embed)
        model = load_model(path)
        assert model.quantization == "int8" and model.w["embed"].dtype == codes
        assert model.w["embed_s"].dtype == torch.float16


@pytest.mark.unit
def test_a_norm_in_a_quantized_type_is_refused(llama):
    folder, root = llama
    path = write_gguf(folder, root / "qnorm.gguf", types={"model.layers.0.input_layernorm.weight": Q.Q8_0})
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.attn_norm\.weight is Q8_0; norms and biases"):
        load_model(path)


@pytest.mark.unit
def test_an_unsupported_architecture_is_refused_naming_it(llama):
    folder, root = llama
    path = write_gguf(folder, root / "gemma.gguf", arch="gemma")
    with pytest.raises(UnsupportedModelError, match="architecture 'gemma' is not supported.*llama, qwen2, qwen3"):
        load_model(path)


@pytest.mark.unit
def test_shapes_that_do_not_match_the_metadata_are_refused(llama):
    folder, root = llama
    path = write_gguf(folder, root / "shapes.gguf", meta={"feed_forward_length": 256})
    with pytest.raises(ModelLoadError, match=r"ffn_gate\.weight has shape \[128, 64\].*\[256, 64\]"):
        load_model(path)


def test_another_scheme_than_the_files_is_refused_and_a_float_file_quantizes_at_load(llama):
    folder, root = llama
    with pytest.raises(ModelLoadError, match=r"quantized \(Q8_0, served as int8\); it cannot be served in int4"):
        load_model(write_gguf(folder, root / "q8.gguf"), quantize="int4")
    f32 = write_gguf(folder, root / "f32.gguf", Q.F32)
    assert load_model(f32).quantization is None
    assert load_model(f32, quantize="int4").quantization == "int4"


@pytest.mark.unit
def test_an_unsupported_tokenizer_is_refused_naming_it(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    w.add_uint32("llama.context_length", 512)
    w.add_tokenizer_model("t5")
    for x in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        x()
    with pytest.raises(UnsupportedModelError, match="tokenizer model 't5' is not supported.*gpt2, llama"):
        Tokenizer.from_gguf(tmp_path / "t.gguf")


# -- llama.cpp's own conversions (heavy) ----------------------------------------------------------

@pytest.mark.heavy
@pytest.mark.parametrize("qtype", QTYPES)
def test_llama_cpps_conversion_serves_transformers_greedy_tokens_on_its_dequantized_weights(tmp_path, qtype):
    """convert_hf_to_gguf.py --outtype q8_0 (its real Q/K permutation, its real metadata); Q4_0 by
    llama-quantize --pure from its f32 conversion, where the build has the tool."""
    from lorafleet.bench import llamacpp_build as lb, llamacpp_convert as lc

    folder = build_model(tmp_path / "hf", "llama")  # the bench's stand-in tokenizer fits its special tokens
    try:
        conv = lb.converters()
    except lb.LlamaCppUnavailable as e:
        pytest.skip(f"llama.cpp's converters: {e}")
    stage = lc._stage(folder, tmp_path / "stage")
    out = tmp_path / f"model-{qtype}.gguf"
    outtype = "q8_0" if qtype == "Q8_0" else "f32"
    lc._convert([conv / "convert_hf_to_gguf.py", stage, "--outtype", outtype, "--outfile", tmp_path / "conv.gguf"],
                "converting")
    if qtype == "Q8_0":
        (tmp_path / "conv.gguf").rename(out)
    else:
        tool = getattr(lb, "quantize_binary", None)
        if tool is None:
            pytest.skip("this build of the bench has no llama-quantize")
        try:
            binary = tool()
        except lb.LlamaCppUnavailable as e:
            pytest.skip(f"llama-quantize: {e}")
        import subprocess

        subprocess.run([str(binary), "--pure", str(tmp_path / "conv.gguf"), str(out), "Q4_0"], check=True,
                       capture_output=True)
    hf = dequantized_hf(folder, out)
    original = load_file(folder / "model.safetensors")
    for name, p in hf.named_parameters():  # the oracle is the model's own weights, rows in place
        ref = original[name]
        assert (p.detach() - ref).abs().max() <= (0.01 if qtype == "Q8_0" else 0.15) * ref.abs().max(), name
    engine = Engine(out, pool_bytes=4 << 20)
    assert engine.model.quantization == QTYPES[qtype][1]
    for prompt in prompts_of_lengths([3, 11, 20], seed=5):
        assert engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids \
            == hf_greedy(hf, prompt, 12)
