"""The conformance matrix's models: the config.json values of popular models of every family
lorafleet serves (their shapes, not their weights), built here at 2 layers with random weights.

A model wider than 1,024 is narrowed by `shrink` to at most 512 (its heads and MLP cut by one
factor), keeping every property that changes the code's path: tied or not, head_dim, the GQA
ratio, odd head counts, qkv bias, q/k norms, rope theta and llama3 scaling, and the vocabulary's
residue modulo 64 (a vocabulary past 64K is cut to 8,192 plus that residue; every real one here
but CodeLlama's is a multiple of 64). So the whole matrix runs in minutes on two cores.
"""

from __future__ import annotations

from pathlib import Path

import torch

LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)

# name -> (transformers config class, its config.json values that decide the shapes and the path)
CONFIGS: dict[str, tuple[str, dict]] = {
    "Llama-3.2-1B": ("LlamaConfig", dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling=dict(factor=32.0, **LLAMA3_ROPE), max_position_embeddings=131072)),
    "Llama-3.2-3B": ("LlamaConfig", dict(
        hidden_size=3072, intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
        vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling=dict(factor=32.0, **LLAMA3_ROPE), max_position_embeddings=131072)),
    "Llama-3.1-8B": ("LlamaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling=dict(factor=8.0, **LLAMA3_ROPE), max_position_embeddings=131072)),
    "TinyLlama-1.1B": ("LlamaConfig", dict(
        hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
        vocab_size=32000, tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=2048)),
    "CodeLlama-7B": ("LlamaConfig", dict(  # MHA, and a vocabulary that is no multiple of 32
        hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
        vocab_size=32016, tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-5,
        max_position_embeddings=16384)),
    "SmolLM2-135M": ("LlamaConfig", dict(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
        vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
        max_position_embeddings=8192)),
    "SmolLM2-360M": ("LlamaConfig", dict(
        hidden_size=960, intermediate_size=2560, num_attention_heads=15, num_key_value_heads=5,
        vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
        max_position_embeddings=8192)),
    "SmolLM2-1.7B": ("LlamaConfig", dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=32,
        vocab_size=49152, tie_word_embeddings=True, rope_theta=130000.0, rms_norm_eps=1e-5,
        max_position_embeddings=8192)),
    "Mistral-7B-v0.3": ("MistralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=32768, tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-5,
        sliding_window=None, max_position_embeddings=32768)),
    "Qwen2.5-0.5B": ("Qwen2Config", dict(
        hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
        vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768)),
    "Qwen2.5-1.5B": ("Qwen2Config", dict(
        hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
        vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768)),
    "Qwen2.5-7B": ("Qwen2Config", dict(
        hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=152064, tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768)),
    "Qwen3-0.6B": ("Qwen3Config", dict(
        hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=40960)),
    "Qwen3-4B": ("Qwen3Config", dict(
        hidden_size=2560, intermediate_size=9728, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=40960)),
    "Qwen3-8B": ("Qwen3Config", dict(
        hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        vocab_size=151936, tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=40960)),
}
# the default tier's subset: every property at least once (tied and not, odd heads and GQA 3, MHA,
# qkv bias, q/k norms with head_dim past hidden/heads, llama3 scaling, a vocabulary no multiple of 32)
FAST = ("SmolLM2-135M", "Qwen2.5-0.5B", "Qwen3-0.6B", "Llama-3.2-1B", "CodeLlama-7B")
MAX_HIDDEN = 1024   # wider: narrowed to NARROW
NARROW = 512
MAX_VOCAB = 65536


def shrink(values: dict) -> dict:
    """`values` narrowed where wider than MAX_HIDDEN or MAX_VOCAB tokens (module doc)."""
    v = dict(values)
    heads, kv = v["num_attention_heads"], v["num_key_value_heads"]
    head_dim = v.get("head_dim") or v["hidden_size"] // heads
    # the smallest factor dividing both head counts that narrows to NARROW, else the largest one
    fits = [f for f in range(1, heads + 1) if not heads % f and not kv % f] if v["hidden_size"] > MAX_HIDDEN else [1]
    f = next((f for f in fits if v["hidden_size"] // f <= NARROW), fits[-1])
    if f > 1:
        v.update(num_attention_heads=heads // f, num_key_value_heads=kv // f, hidden_size=v["hidden_size"] // f,
                 intermediate_size=v["intermediate_size"] // f)
        if "head_dim" in values:  # Qwen3 and Llama 3.2: head_dim need not be hidden / heads
            v["head_dim"] = head_dim
    if v["vocab_size"] > MAX_VOCAB:
        v["vocab_size"] = 8192 + v["vocab_size"] % 64
    return v


def build(name: str, folder: Path, seed: int = 0) -> Path:
    """The model `name` at 2 layers, shrunk, with random weights: every norm and bias random too
    (transformers starts norms at one and biases at zero, which would hide a norm or bias read
    wrongly); saved in fp32 as transformers saves it."""
    import transformers

    cls, values = CONFIGS[name]
    config = getattr(transformers, cls)(**shrink(values), num_hidden_layers=2, initializer_range=0.05,
                                        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = getattr(transformers, cls.replace("Config", "ForCausalLM"))(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    return Path(folder)


# the adapters of every case: plain LoRA on every projection, DoRA, and a saved LM head
ADAPTERS = {
    "plain": dict(r=8, lora_alpha=16, target_modules="all-linear"),
    "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    "head": dict(r=4, lora_alpha=8, target_modules=["k_proj", "up_proj"], modules_to_save=["lm_head"]),
}
