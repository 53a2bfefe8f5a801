"""The placeholder base: a tiny random Llama with a byte-level tokenizer and a ChatML template,
built locally (no download) so that `lorafleet serve` works offline before the bundled demo
fleet exists. Its answers are noise: printable ASCII noise, because only those tokens get
non-zero output weights.

Built once into `folder` (written to a temporary folder, then renamed, so a build cut short
leaves nothing half-made behind).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

VERSION = 1  # bump when the recipe changes: a new folder is built
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048)


def ensure_placeholder(models_dir: Path) -> Path:
    """The placeholder model's folder under `models_dir`, built on first use."""
    folder = models_dir / f"placeholder-random-llama-v{VERSION}"
    if (folder / "config.json").is_file():
        return folder
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = models_dir / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        vocab = _write_tokenizer(tmp)
        _write_model(tmp, vocab)
        try:
            tmp.rename(folder)
        except OSError:  # another process built it first
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _write_tokenizer(folder: Path) -> dict[str, int]:
    """A byte-level BPE without merges: one token per byte, plus the special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    specials = {s: i for i, s in enumerate(SPECIALS)}
    vocab = dict(specials)
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: ord(c)):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE,
         "model_max_length": SHAPE["max_position_embeddings"]}, indent=2))
    return vocab


def _write_model(folder: Path, vocab: dict[str, int]) -> None:
    import torch
    from safetensors.torch import save_file

    h, inter, layers = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_hidden_layers"]
    heads, kv_heads = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    head_dim, v = h // heads, len(vocab)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": v,
              "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": [2, 4],
              "torch_dtype": "float32", "lorafleet_placeholder": True, **SHAPE}
    g = torch.Generator().manual_seed(0)

    def randn(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    t = {"model.embed_tokens.weight": randn(v, h, std=1.0), "model.norm.weight": torch.ones(h)}
    # Only printable ASCII bytes get output weights, so the noise it writes is readable.
    to_byte = _byte_level_map()
    lm_head = torch.zeros(v, h)
    for ch, i in vocab.items():
        b = to_byte.get(ch)
        if b is not None and (32 <= b < 127 or b == 10):
            lm_head[i] = randn(h, std=0.3)
    t["lm_head.weight"] = lm_head
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(h)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h)
        t[p + "self_attn.q_proj.weight"] = randn(heads * head_dim, h)
        t[p + "self_attn.k_proj.weight"] = randn(kv_heads * head_dim, h)
        t[p + "self_attn.v_proj.weight"] = randn(kv_heads * head_dim, h)
        t[p + "self_attn.o_proj.weight"] = randn(h, heads * head_dim)
        t[p + "mlp.gate_proj.weight"] = randn(inter, h)
        t[p + "mlp.up_proj.weight"] = randn(inter, h)
        t[p + "mlp.down_proj.weight"] = randn(h, inter)
    save_file({k: x.contiguous() for k, x in t.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "README.md").write_text(
        "# lorafleet placeholder model\n\nA tiny random Llama built locally by `lorafleet serve` "
        "when no MODEL is given. Its outputs are random noise; it stands in until the bundled demo "
        "fleet is available.\n")


def _byte_level_map() -> dict[str, int]:
    """GPT-2's byte -> printable character table, inverted: character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}
