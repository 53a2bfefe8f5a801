"""What aLoRA saves, on the CPU, in one process, each comparison alternated round by round.

`reuse`: a conversation of `--history` tokens answered by the base, then a call on it by each of
N aLoRA adapters (history + invocation + a short question), against the same call by each of N
plain adapters with the same weights: the time to the first token of each, and what the pool
holds (the history's blocks once, not once per adapter). `throughput`: a batch of requests,
half on aLoRA adapters and half on plain ones, against the same batch with plain twins of the
aLoRA adapters (the same weights under other names: as many distinct adapters, the same ranks) in
their place, generated tokens per second.

    python -m lorafleet.bench.alora reuse --model smol --history 2000 --adapters 8
    python -m lorafleet.bench.alora throughput --model tiny --batch 32
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

INVOCATION = [1, 2, 3]  # the aLoRA's invocation tokens; no other token of a prompt is below FIRST
FIRST = 10


def linked_copy(folder: Path, suffix: str, **config) -> Path:
    """The adapter in `folder` under another name (its weights linked), its config updated by `config`."""
    out = folder.parent / f"{folder.name}{suffix}"
    if not (out / "adapter_config.json").is_file():
        out.mkdir(exist_ok=True)
        weights = out / "adapter_model.safetensors"
        if not weights.exists():
            weights.symlink_to(folder / "adapter_model.safetensors")
        cfg = json.loads((folder / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return out


def fleet(model: str, n: int):
    """The `model` base, n plain adapters of ranks 8-64 (all seven projections), their aLoRA copies
    and their plain twins (the same weights under other names: as many distinct adapters as the copies)."""
    from lorafleet.bench.adapters import build_adapters
    from lorafleet.bench.fixtures import build_base

    base = build_base(model)
    plain = build_adapters(base, n)
    alora = [(f"{name}-alora", linked_copy(path, "-alora", alora_invocation_tokens=INVOCATION)) for name, path in plain]
    return base, plain, alora, [(f"{name}-twin", linked_copy(path, "-twin")) for name, path in plain]


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST, vocab) for _ in range(n)]


def reuse(model: str, history: int, n: int, rounds: int) -> dict:
    from lorafleet import Engine, SamplingParams

    base, plain, alora, _ = fleet(model, n)
    engine = Engine(base, max_model_len=history + 64)
    for name, path in plain + alora:
        engine.register_adapter(name, path)
    vocab = engine.model.cfg.vocab_size
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    ttft: dict[str, list[float]] = {"alora": [], "plain": []}
    reused, grown = [], {}
    for r in range(rounds + 1):  # round 0 loads the adapters and warms up
        talk = _tokens(rng, history, vocab)
        engine.generate([talk], one)  # the base answers the conversation
        for kind, names in (("alora", [a for a, _ in alora]), ("plain", [p for p, _ in plain])):
            before = _held(engine)
            for name in names:
                t0 = time.perf_counter()
                out = engine.generate([talk + INVOCATION + _tokens(rng, 8, vocab)], one, adapters=[name])[0]
                if r:
                    ttft[kind].append(time.perf_counter() - t0)
                    reused += [out.metrics["cached_tokens"]] if kind == "alora" else []
            if not r:  # the pages the n calls added to a pool that held the history alone (no eviction yet)
                grown[kind] = _held(engine) - before
    engine.close()
    alora_ms, plain_ms = (1e3 * statistics.median(ttft[k]) for k in ("alora", "plain"))
    return {"model": model, "history": history, "adapters": n, "alora_ttft_ms": alora_ms, "plain_ttft_ms": plain_ms,
            "speedup": plain_ms / alora_ms, "reused_tokens_median": statistics.median(reused),
            "alora_pages_added": grown["alora"], "plain_pages_added": grown["plain"], "page_tokens": engine.kv.block_size}


def _held(engine) -> int:
    """The pool's pages of KV, live or cached."""
    pool = engine.stats()["pool"]
    return pool["cached_pages"] + pool["kv_pages"]


def throughput(model: str, batch: int, rounds: int, prompt: int = 64, new: int = 32) -> dict:
    from lorafleet import Engine, SamplingParams

    base, plain, alora, twins = fleet(model, 8)
    engine = Engine(base, max_num_seqs=batch, prefix_cache=False)  # the two batches share prompts: no reuse between
    for name, path in plain + alora + twins:
        engine.register_adapter(name, path)
    vocab = engine.model.cfg.vocab_size
    rng = random.Random(1)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    rates: dict[str, list[float]] = {"mixed": [], "plain": []}
    for r in range(rounds + 1):
        prompts = [_tokens(rng, prompt - 11, vocab) + INVOCATION + _tokens(rng, 8, vocab) for _ in range(batch)]
        for kind in ("mixed", "plain"):
            names = [((alora if kind == "mixed" else twins) if i % 2 else plain)[i % 8][0] for i in range(batch)]
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params, adapters=names)
            if r:
                rates[kind].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    engine.close()
    ratios = [m / p for m, p in zip(rates["mixed"], rates["plain"])]
    return {"model": model, "batch": batch, "mixed_tok_s": statistics.median(rates["mixed"]),
            "plain_tok_s": statistics.median(rates["plain"]), "ratio": statistics.median(ratios)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["reuse", "throughput"])
    ap.add_argument("--model", default=None, help="a bench shape (default: smol for reuse, tiny for throughput)")
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.what == "reuse":
        r = reuse(args.model or "smol", args.history, args.adapters, args.rounds)
        print(f"{r['model']}, a {r['history']}-token history, {r['adapters']} adapters: time to the first token "
              f"{r['alora_ttft_ms']:.1f} ms as aLoRA, {r['plain_ttft_ms']:.1f} ms as plain LoRA "
              f"({r['speedup']:.1f}x); {r['reused_tokens_median']} prompt tokens reused a call; KV pages the calls "
              f"added: {r['alora_pages_added']} as aLoRA, {r['plain_pages_added']} as plain LoRA "
              f"({r['page_tokens']} tokens a page)")
    else:
        r = throughput(args.model or "tiny", args.batch, args.rounds)
        print(f"{r['model']}, batch {r['batch']}: {r['mixed_tok_s']:.0f} tokens/s half aLoRA, {r['plain_tok_s']:.0f} "
              f"plain only ({r['ratio']:.2f}x, median of the rounds' ratios)")


if __name__ == "__main__":
    main()
