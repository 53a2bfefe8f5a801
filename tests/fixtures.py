"""Builders for tiny random models in real Hugging Face formats (config.json + safetensors),
made with `transformers` itself so that the files are exactly what users bring."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILY_CONFIGS = {
    # each family's distinguishing features at toy size
    "llama": dict(cls="LlamaConfig", model="LlamaForCausalLM"),
    "llama3": dict(cls="LlamaConfig", model="LlamaForCausalLM", tie_word_embeddings=True,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                   rope_theta=500000.0),
    "mistral": dict(cls="MistralConfig", model="MistralForCausalLM", sliding_window=None),
    "qwen2": dict(cls="Qwen2Config", model="Qwen2ForCausalLM", tie_word_embeddings=True),
    "qwen3": dict(cls="Qwen3Config", model="Qwen3ForCausalLM", head_dim=24),
}
FAMILIES = tuple(FAMILY_CONFIGS)


def tiny_config(family: str, **overrides):
    import transformers

    spec = dict(FAMILY_CONFIGS[family])
    cls = getattr(transformers, spec.pop("cls"))
    spec.pop("model")
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=160, max_position_embeddings=512,
                initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base.update(spec)
    base.update(overrides)
    return cls(**base)


def build_model(folder: Path, family: str = "llama", seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    """Save a random model of `family` to `folder`; returns the folder."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = getattr(transformers, FAMILY_CONFIGS[family]["model"])(config).to(dtype).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return Path(folder)


def load_hf(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
