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


def variant_params() -> list:
    """Every CPU kernel variant this CPU can execute: its own (auto's) plain, the others heavy."""
    import pytest

    from lorafleet.kernels import cpu_module

    host = cpu_module.host_variant()
    return [v if v == host else pytest.param(v, marks=pytest.mark.heavy) for v in cpu_module.runnable()]


def force_kernels(monkeypatch, name: str) -> str:
    """Serve with the kernels `name` (a CPU variant, or torch) as LORAFLEET_KERNELS forces them: the
    process's CPU variant (`cpu_module.use`'s) and the variable engines and daemons read."""
    from lorafleet.kernels import cpu_module

    if name in cpu_module.VARIANTS:
        monkeypatch.setattr(cpu_module, "_current", name)
    monkeypatch.setenv("LORAFLEET_KERNELS", name)
    return name


def load_hf(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


# -- adapters ----------------------------------------------------------------------------------

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Eight adapters that differ in every way PEFT lets them: rank (odd ones too), targets,
# rsLoRA, per-module rank/alpha patterns, regex targets, layer subsets.
ADAPTER_VARIANTS = {
    "attn-r3": dict(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"]),
    "mlp-r24": dict(r=24, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all-r8": dict(r=8, lora_alpha=16, target_modules="all-linear"),
    "rslora-r16": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=ALL7),
    "patterns-r8": dict(r=8, lora_alpha=8, target_modules=ALL7, rank_pattern={"q_proj": 5},
                        alpha_pattern={"down_proj": 32}),
    "regex-r5": dict(r=5, lora_alpha=10, target_modules=r".*\.(k_proj|o_proj)$"),
    "layer1-r12": dict(r=12, lora_alpha=12, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                       layers_to_transform=[1]),
    "down-r1": dict(r=1, lora_alpha=4, target_modules=["down_proj"]),
}


def build_adapter(base_dir: Path, folder: Path, seed: int = 0, b_std: float = 0.1, **lora_kwargs) -> Path:
    """Save a PEFT LoRA adapter for the model in `base_dir`, with random non-zero B (PEFT
    starts B at zero, which would make every adapter the identity), and saved modules
    (modules_to_save) moved from the base's weights."""
    import peft

    torch.manual_seed(seed)
    model = load_hf(base_dir)
    config = peft.LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **lora_kwargs)
    peft_model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name or "lora_embedding_A" in name:  # PEFT starts the embedding's A at zero
                p.normal_(0.0, b_std)
            elif "modules_to_save" in name:  # a trained copy: the base's weights moved
                p.add_(torch.randn_like(p), alpha=b_std)
    peft_model.save_pretrained(folder, safe_serialization=True)
    return Path(folder)


def registered_fleet(root: Path, family: str, variants: dict[str, dict]):
    """A tiny base of `family` under `root`, one PEFT adapter per entry of `variants` (name ->
    LoraConfig keywords, seeded by its place), and an engine (debug checks on) with each of them
    registered: (base folder, name -> adapter folder, engine)."""
    from lorafleet import Engine

    base = build_model(root / "base", family)
    adapters = {name: build_adapter(base, root / name, seed=i, **kw) for i, (name, kw) in enumerate(variants.items())}
    engine = Engine(base, pool_bytes=8 << 20, debug_checks=True)
    for name, path in adapters.items():
        engine.register_adapter(name, path)
    return base, adapters, engine


def load_peft(base_dir: Path, adapter_dir: Path):
    import peft

    return peft.PeftModel.from_pretrained(load_hf(base_dir), adapter_dir).eval()


# -- a model with a real tokenizer -------------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_chat_model(folder: Path, family: str = "llama", seed: int = 0) -> Path:
    """A random model whose vocabulary is a small byte-level BPE trained here, saved with
    tokenizer.json, tokenizer_config.json (ChatML template) like any Hub model."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog.",
                             "héllo wörld 日本語 ça va? naïve café", "user assistant system"] * 4, trainer)
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    build_model(folder, family, seed=seed, vocab_size=raw.get_vocab_size(), bos_token_id=1, eos_token_id=2)
    raw.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}))
    return folder


def stepping(engine, until=None, timeout: float = 120.0):
    """Step `engine` until `until()` holds (default: nothing left unfinished), yielding each
    step's outputs; the test fails, instead of hanging, past `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    done = until or (lambda: not engine.has_unfinished())
    while not done():
        assert time.monotonic() < deadline, f"the engine did not get there within {timeout:.0f}s"
        yield engine.step()


def assert_demo_fleet_matches_torch(kernels: str, monkeypatch, skills: int, max_tokens: int) -> None:
    """The base and the first `skills` skills of the demo fleet in one batch, greedy: on the
    `kernels` backend (LORAFLEET_KERNELS), token for token the torch path's answers, each the
    answer its skill expects (so a row served with the wrong adapter shows)."""
    from lorafleet import SamplingParams
    from lorafleet.demo.evaluate import chat_prompt, fleet_engine
    from lorafleet.demo.skills import SKILLS, expected, held_out_texts

    tasks = [None, *list(SKILLS)[:skills]]
    jobs = list(zip(tasks, held_out_texts(len(tasks))))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    got = {}
    for name in (kernels, "torch"):
        monkeypatch.setenv("LORAFLEET_KERNELS", name)
        engine = fleet_engine()
        try:
            prompts = [chat_prompt(engine, task, text) for task, text in jobs]
            got[name] = engine.generate(prompts, params, [task for task, _ in jobs])
        finally:
            engine.close()
    for (task, text), out, ref in zip(jobs, got[kernels], got["torch"]):
        assert out.token_ids == ref.token_ids, f"{task}({text!r}): {out.text!r} ({kernels}) vs {ref.text!r} (torch)"
        assert expected(task, text).startswith(out.text), f"{task}({text!r}) answered {out.text!r}"


def call_within(fn, deadline: float, what: str):
    """fn() on a thread of its own; its result, or what it raised; the test fails if it is still
    running after `deadline` seconds (a hung call cannot hang the test run)."""
    import threading

    result: dict = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:  # handed to the test's thread below
            result["error"] = e

    thread = threading.Thread(target=run, name=what, daemon=True)
    thread.start()
    thread.join(deadline)
    assert not thread.is_alive(), f"{what} did not finish within {deadline:.0f}s"
    if "error" in result:
        raise result["error"]
    return result["value"]


def slow_down(monkeypatch, module, name: str, seconds: float) -> None:
    """Make `module.name` (a function) sleep `seconds` before it runs, for this test."""
    import time

    fn = getattr(module, name)

    def slowed(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, name, slowed)


def demo_in_process():
    """The demo fleet behind the daemon's app, in this process (`InProcessServer`): an engine on
    the CPU with every adapter registered. The caller closes it."""
    from lorafleet.demo import default_fleet
    from lorafleet.deploy.inprocess import InProcessServer
    from lorafleet.engine.engine import Engine

    fleet = default_fleet()
    engine = Engine(fleet.model, device="cpu", pool_bytes=64 << 20)
    for name, path in fleet.adapters.items():
        engine.register_adapter(name, path)
    return InProcessServer(engine, fleet.name, fleet.model)
