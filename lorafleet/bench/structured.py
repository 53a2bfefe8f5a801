"""What structured output costs a step: on the demo fleet's base, B requests under a JSON schema
against the same B requests free, greedy, the two alternated in one process, `rounds` times; each
round's mean step time over the first `steps` steps (every row still running). Also the grammar's
compile time, cold (a new schema) and cached. The demo's vocabulary is small (261 tokens), so the
ratio is the per-row host work a constraint adds (filling its mask, advancing its matcher, the
masked draw), not a large vocabulary's mask (docs/benchmark-history.md has those, per token).

With `--model tiny`: the bench's `tiny` base (8,192-token logits) with a byte-level BPE tokenizer
trained here to its vocabulary's size, and `--adapters N` random adapters of ranks 8-64, the rows
spread over them round-robin (a step of 64 rows over 8 adapters, as a fleet serves it).

    python -m lorafleet.bench.structured --batch 1 --batch 64
    python -m lorafleet.bench.structured --model tiny --adapters 8 --batch 64
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {"type": "string"}},
    "role": {"enum": ["admin", "user", "guest"]}, "address": {"type": "object", "properties": {
        "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city"]},
    "active": {"type": "boolean"}, "score": {"type": "number"}},
    "required": ["name", "age", "role", "address"], "additionalProperties": False}


def tiny_with_tokenizer() -> Path:
    """The bench's `tiny` base beside a byte-level BPE tokenizer of its vocabulary's size (its files
    linked into a folder of its own, built once: the cached base stays tokenizer-free)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from lorafleet.bench.fixtures import build_base, get_shape

    base = build_base("tiny")
    folder = base.parent / f"{base.name}-bpe"
    if (folder / "tokenizer.json").is_file():
        return folder
    folder.mkdir(exist_ok=True)
    for f in base.iterdir():
        if not (folder / f.name).exists():
            (folder / f.name).symlink_to(f)
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9))) for _ in range(20000)]
    corpus = [" ".join(rng.choice(words) for _ in range(40)) + ' {"key": [1, 2.5, true, null]}' for _ in range(4000)]
    trainer = trainers.BpeTrainer(vocab_size=get_shape("tiny").vocab_size - 1, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(corpus, trainer)
    raw.save(str(folder / ".tokenizer.json.tmp"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (folder / ".tokenizer.json.tmp").rename(folder / "tokenizer.json")
    return folder


def build_base_of(folder: Path) -> Path:
    """The folder whose weights `folder` links to (the adapters are built against them)."""
    weights = folder / "model.safetensors"
    return weights.resolve().parent if weights.is_symlink() else folder


def run(batch: int, steps: int, rounds: int, model: str = "demo", adapters: int = 0) -> dict:
    from lorafleet import Engine, SamplingParams
    from lorafleet.demo import default_fleet
    from lorafleet.model.grammar import Constraint

    folder = tiny_with_tokenizer() if model == "tiny" else default_fleet().model
    engine = Engine(folder, max_num_seqs=max(batch, 1))
    names: list[str | None] = [None]
    if adapters:
        from lorafleet.bench.adapters import build_adapters

        names = []
        for name, path in build_adapters(build_base_of(folder), adapters):
            engine.register_adapter(name, path)
            names.append(name)
    c = Constraint.of("json_schema", SCHEMA, "bench")
    t0 = time.perf_counter()
    engine.grammar(c)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.grammar(c)
    cached = time.perf_counter() - t0
    ways = {"free": SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True),
            "schema": SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True, structured=c)}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(rounds + 1):  # round 0 warms up
        for name, params in ways.items():
            for i in range(batch):
                engine.add_request(f"record {i}", params, adapter=names[i % len(names)])
            engine.step()  # the prefill
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            if r:
                times[name].append((time.perf_counter() - t0) / steps)
            while engine.has_unfinished():
                engine.step()
    engine.close()
    ratios = [s / f for s, f in zip(times["schema"], times["free"])]
    return {"batch": batch, "model": model, "adapters": adapters, "free_ms": 1e3 * statistics.median(times["free"]),
            "schema_ms": 1e3 * statistics.median(times["schema"]), "ratio": statistics.median(ratios),
            "compile_cold_ms": 1e3 * cold, "compile_cached_ms": 1e3 * cached}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", choices=["demo", "tiny"], default="demo")
    ap.add_argument("--adapters", type=int, default=0, help="random adapters the rows are spread over (tiny)")
    args = ap.parse_args(argv)
    for b in args.batch or [1, 64]:
        r = run(b, args.steps, args.rounds, args.model, args.adapters)
        print(f"{r['model']}, batch {r['batch']} over {r['adapters']} adapters: step {r['free_ms']:.2f} ms free, {r['schema_ms']:.2f} ms under the schema "
              f"({r['ratio']:.2f}x, median of the rounds' ratios); compile {r['compile_cold_ms']:.1f} ms cold, "
              f"{r['compile_cached_ms']:.2f} ms cached")


if __name__ == "__main__":
    main()
