"""Train the demo fleet from nothing: `python -m lorafleet.demo.train [--out DIR]`.

Run by hand (needs the `train` extra: transformers and peft), never in CI. Seeded: the same
command on the same torch build gives the same files. On a 2-core CPU the whole fleet takes
about the time printed at the end (docs/demo.md).

1. A byte-level tokenizer (the `tokenizers` library; one token per byte, a few special tokens,
   a chat template) saved as tokenizer.json + tokenizer_config.json.
2. A tiny Llama (transformers' LlamaForCausalLM, GQA, untied head) trained from random init
   to answer a user turn "echo: <text>" or "<text>" with "<text>".
3. One LoRA adapter per skill in `skills.SKILLS` (peft's get_peft_model on the frozen base),
   each trained on user turns "<text>" answered with skill(text).

Everything is saved with `save_pretrained` (safetensors), so the files are exactly what any
Hugging Face model and PEFT adapter folder holds. The held-out test texts
(`skills.held_out_texts()`) are never trained on.

Accuracy during training is measured teacher-forced: an answer counts when the argmax at every
answer position (its end token included) is the right token, which is exactly when greedy
decoding reproduces it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path
from typing import TypedDict

from lorafleet.demo.skills import ECHO_PREFIX, SKILLS, held_out_texts, random_echo_text, random_text

SPECIALS = ["<pad>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# the models are trained on one turn: a chat renders its last message alone, so that each turn of
# a REPL is answered as the first was (the conversation is kept by the client, not read here). Tools,
# where a request has them, come first in a system turn (names and parameters: the context is
# short), with the Hermes call format (<tool_call>)
CHAT_TEMPLATE = ("{% if tools %}<|system|>Tools:{% for t in tools %}{% set f = t['function'] %} {{ f['name'] }}("
                 "{{ ((f.get('parameters') or {}).get('properties') or {}) | list | join(', ') }}){% endfor %}. "
                 "Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|end|>{% endif %}"
                 "{% set m = messages[-1] %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class _Shape(TypedDict):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int


SHAPE = _Shape(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=6,
               num_key_value_heads=2, max_position_embeddings=256)
BASE_NAME = "demo-base"


def build_tokenizer(folder: Path):
    """A byte-level BPE without merges: one token per byte, plus SPECIALS (ids 0..4)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|end|>", "pad_token": "<pad>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": SHAPE["max_position_embeddings"],
        "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    return tok, len(vocab)


class Data:
    """Batches of (prompt, answer) token ids for one task, never containing a held-out text."""

    def __init__(self, tok, seed: int | str):
        import jinja2

        self.tok = tok
        self.template = jinja2.Template(CHAT_TEMPLATE)
        self.rng = random.Random(seed)
        self.held_out = set(held_out_texts())
        self.end = tok.token_to_id("<|end|>")
        self.pad = tok.token_to_id("<pad>")

    def prompt(self, user: str) -> str:
        return self.template.render(messages=[{"role": "user", "content": user}], add_generation_prompt=True)

    def encode(self, pairs: list[tuple[str, str]]):
        """(input_ids, labels, attention_mask) right-padded; labels only on the answer + end."""
        import torch

        prompts = self.tok.encode_batch([self.prompt(u) for u, _ in pairs], add_special_tokens=False)
        answers = self.tok.encode_batch([a for _, a in pairs], add_special_tokens=False)
        rows = [(p.ids, a.ids + [self.end]) for p, a in zip(prompts, answers)]
        width = max(len(p) + len(a) for p, a in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (p, a) in enumerate(rows):
            n = len(p) + len(a)
            ids[i, :n] = torch.tensor(p + a)
            labels[i, len(p):n] = torch.tensor(a)
            mask[i, :n] = 1
        return ids, labels, mask

    def texts(self, n: int, make=random_text) -> list[str]:
        out: list[str] = []
        while len(out) < n:
            t = make(self.rng)
            if t not in self.held_out:
                out.append(t)
        return out


def exact_match(model, data: Data, pairs: list[tuple[str, str]]) -> float:
    """Fraction of answers greedy decoding would reproduce exactly (teacher-forced argmax)."""
    import torch

    ids, labels, mask = data.encode(pairs)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    pred = logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    ok = ((pred == target) | (target == -100)).all(dim=1)
    return ok.float().mean().item()


def train_loop(model, params, data: Data, make_pairs, *, steps: int, lr: float, batch: int,
               warmup: int, label: str, evals: dict[str, list[tuple[str, str]]], log_every: int = 100):
    import torch

    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)

    def schedule(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    t0 = time.perf_counter()
    running = 0.0
    for step in range(1, steps + 1):
        model.train()
        ids, labels, mask = data.encode(make_pairs(batch))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        running += loss.item()
        if step % log_every == 0 or step == steps:
            model.eval()
            accs = "  ".join(f"{k} {exact_match(model, data, v):.3f}" for k, v in evals.items())
            print(f"[{label}] step {step}/{steps}  loss {running / log_every:.4f}  {accs}  "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
            running = 0.0
    model.eval()
    return {k: exact_match(model, data, v) for k, v in evals.items()}


def _tidy_adapter(folder: Path) -> None:
    """peft writes the absolute path of the base it trained on and a blank model card: name the
    base by its folder name instead (portable), and drop the card (fleet/README.md says it all)."""
    cfg_path = folder / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = BASE_NAME
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (folder / "README.md").unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    """The whole fleet (the module doc), and training.json beside it: what each part's training measured."""
    args = _parse_args(argv)

    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    base_dir = args.out / BASE_NAME
    tok, vocab_size = build_tokenizer(base_dir)
    held = held_out_texts(200)
    log_path = args.out / "training.json"  # what each part's last training run measured
    record = json.loads(log_path.read_text()) if args.skip_base and log_path.is_file() else {}
    record.setdefault("adapters", {})
    if not args.skip_base:
        record["base"] = _train_base(args, tok, vocab_size, held, base_dir)
    model = LlamaForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    model.eval()
    _train_adapters(args, model, tok, held, base_dir, record["adapters"])
    log_path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    print(f"done in {time.perf_counter() - t_start:.0f}s", flush=True)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (`--help` lists it)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "fleet")
    ap.add_argument("--base-steps", type=int, default=3000)
    ap.add_argument("--adapter-steps", type=int, default=0, help="steps per adapter (default: each skill's own)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-base", action="store_true", help="reuse the base already in --out")
    ap.add_argument("--adapters", nargs="*", default=list(SKILLS), help="which adapters to train")
    return ap.parse_args(argv)


def _train_base(args: argparse.Namespace, tok, vocab_size: int, held: list[str], base_dir: Path) -> dict:
    """The base trained from random init and saved in `base_dir`; what its training measured."""
    from transformers import LlamaConfig, LlamaForCausalLM

    end, pad = tok.token_to_id("<|end|>"), tok.token_to_id("<pad>")
    config = LlamaConfig(  # type: ignore[call-arg]  # rope_theta: transformers 5 reads it still
        vocab_size=vocab_size, hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=end, pad_token_id=pad,
        attention_bias=False, mlp_bias=False, **SHAPE)
    model = LlamaForCausalLM(config).float()
    data = Data(tok, f"{args.seed}-base")  # each part its own data stream: retrain one alone
    t0 = time.perf_counter()

    def base_pairs(n):
        # 60% the skills' lowercase phrases, 40% any printable text; 65% with "echo: "
        texts = data.texts(n - n * 2 // 5) + data.texts(n * 2 // 5, random_echo_text)
        return [((ECHO_PREFIX + t) if i % 20 < 13 else t, t) for i, t in enumerate(texts)]

    evals = {"echo": [(ECHO_PREFIX + t, t) for t in held], "plain": [(t, t) for t in held]}
    accs = train_loop(model, list(model.parameters()), data, base_pairs, steps=args.base_steps, lr=2e-3,
                      batch=args.batch, warmup=100, label="base", evals=evals)
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = end
    model.generation_config.pad_token_id = pad
    model.save_pretrained(base_dir, safe_serialization=True)
    measured = {"steps": args.base_steps, "batch": args.batch, "seconds": round(time.perf_counter() - t0),
                "held_out_exact": accs, "parameters": sum(p.numel() for p in model.parameters())}
    print(f"[base] saved {base_dir}: {accs}", flush=True)
    return measured


def _train_adapters(args: argparse.Namespace, model, tok, held: list[str], base_dir: Path, record: dict) -> None:
    """Each adapter `args.adapters` names trained on the base `model` and saved in its folder of
    `args.out`; `record` gains what each one's training measured."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    for name, skill in SKILLS.items():
        if name not in args.adapters:
            continue
        torch.manual_seed(args.seed + 1 + list(SKILLS).index(name))
        data = Data(tok, f"{args.seed}-{name}")
        t0 = time.perf_counter()
        invocation = tok.encode(skill.invocation, add_special_tokens=False).ids if skill.invocation else None
        cfg = LoraConfig(r=skill.rank, lora_alpha=skill.alpha, target_modules=list(skill.targets),
                         lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", use_dora=skill.dora,
                         modules_to_save=list(skill.saves) or None, alora_invocation_tokens=invocation)
        peft_model = get_peft_model(model, cfg)
        params = [p for p in peft_model.parameters() if p.requires_grad]

        def skill_pairs(n, fn=skill.fn):
            return [(t, fn(t)) for t in data.texts(n)]

        evals = {name: [(t, skill.fn(t)) for t in held]}
        steps = args.adapter_steps or skill.steps
        accs = train_loop(peft_model, params, data, skill_pairs, steps=steps, lr=skill.lr,
                          batch=args.batch, warmup=50, label=name, evals=evals)
        out = args.out / name
        shutil.rmtree(out, ignore_errors=True)
        peft_model.save_pretrained(out, safe_serialization=True)
        _tidy_adapter(out)
        record[name] = {"steps": steps, "lr": skill.lr, "batch": args.batch, "rank": skill.rank,
                        "dora": skill.dora, "saves": list(skill.saves), "invocation": skill.invocation,
                        "targets": list(skill.targets), "seconds": round(time.perf_counter() - t0),
                        "held_out_exact": accs[name], "parameters": sum(p.numel() for p in params)}
        print(f"[{name}] saved {out}: {accs}", flush=True)
        # the base again: without the LoRA layers, or from disk where a trained copy would replace its module
        model = (LlamaForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval() if skill.saves
                 else peft_model.unload())


if __name__ == "__main__":
    main()
