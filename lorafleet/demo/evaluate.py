"""Measure the demo fleet: `python -m lorafleet.demo.evaluate [--texts N] [--quantize int8|int4]
[--lora-dtype bfloat16|float16]`.

Every skill (and the base's echo) on the held-out texts, greedy, all requests in one engine run;
prints each adapter's exact-match rate and the highest rate at which its answers match another
skill's. The README's table comes from this; tests/demo/test_fleet.py asserts the same numbers.
With --quantize, the fleet on the base quantized at load (adapters in full precision) beside full
precision: each skill's exact match in both and the points lost; with --lora-dtype, the adapters
held in 16 bits (`serve --lora-dtype`) beside float32 the same way.
"""

from __future__ import annotations

import argparse
import time


def fleet_engine(**options):
    """An Engine on the demo base with every adapter of the fleet loaded (the caller closes it)."""
    from lorafleet import Engine
    from lorafleet.demo import default_fleet

    fleet = default_fleet()
    engine = Engine(fleet.model, **{"pool_bytes": 32 << 20, **options})
    for name, path in fleet.adapters.items():
        engine.load_adapter(name, path)
    return engine


def chat_prompt(engine, skill: str | None, text: str) -> list[int]:
    """The token ids of the chat turn that asks `skill` (None: the base) to transform `text`."""
    from lorafleet.demo.skills import user_turn

    return engine.tokenizer.apply_chat_template([{"role": "user", "content": user_turn(skill, text)}],
                                                add_generation_prompt=True, tokenize=True)


def run_greedy(engine, jobs: list[tuple[str | None, str]]):
    """Greedy outputs of (skill, text) jobs, all in one continuously batched run, in job order."""
    from lorafleet import SamplingParams

    return engine.generate([chat_prompt(engine, task, t) for task, t in jobs],
                           SamplingParams(max_tokens=40, temperature=0.0), [task for task, _ in jobs])


def evaluate(engine, n_texts: int = 200) -> dict[str | None, dict[str, str]]:
    """{task: {text: answer}} for the base (None) and every skill, one batch of all requests."""
    from lorafleet.demo.skills import SKILLS, held_out_texts

    tasks = [None, *SKILLS]
    texts = held_out_texts(n_texts)
    jobs = [(task, t) for task in tasks for t in texts]
    outs = run_greedy(engine, jobs)
    got: dict[str | None, dict[str, str]] = {task: {} for task in tasks}
    for (task, t), o in zip(jobs, outs):
        got[task][t] = o.text
    return got


def accuracy(answers: dict[str, str], skill: str | None) -> float:
    from lorafleet.demo.skills import expected

    return sum(out == expected(skill, t) for t, out in answers.items()) / len(answers)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=200)
    ap.add_argument("--quantize", choices=("int8", "int4"), help="compare the base quantized at load with full precision")
    ap.add_argument("--lora-dtype", choices=("bfloat16", "float16"), help="compare the adapters held in 16 bits with "
                                                                          "float32")
    args = ap.parse_args(argv)
    if args.quantize or args.lora_dtype:
        compare(args.texts, args.quantize, args.lora_dtype)
        return

    engine = fleet_engine()
    t0 = time.perf_counter()
    got = evaluate(engine, args.texts)
    print(f"{len(got) * args.texts} requests in {time.perf_counter() - t0:.1f}s")
    for task, answers in got.items():
        others = {o: accuracy(answers, o) for o in got if o != task}
        worst = max(others, key=lambda o: others[o])
        print(f"{task or 'base (echo)':12s} {accuracy(answers, task):7.1%}   closest other skill: "
              f"{worst or 'echo'} {others[worst]:.1%}")
    engine.close()


def compare(n_texts: int, scheme: str | None, lora_dtype: str | None = None) -> dict[str | None, tuple[float, float]]:
    """Each task's exact match in full precision and with the base in `scheme` (None: as it is) and
    the adapters held in `lora_dtype` (None: float32), printed with the points lost; returns
    {task: (full, reduced)}."""
    label = " + ".join(filter(None, (scheme, lora_dtype and f"adapters {lora_dtype}")))
    rates = []
    for options in ({}, {"quantize": scheme, "lora_dtype": lora_dtype or "auto"}):
        engine = fleet_engine(**options)
        rates.append({task: accuracy(answers, task) for task, answers in evaluate(engine, n_texts).items()})
        engine.close()
    full, reduced = rates
    print(f"{'skill':12s} {'full':>7s} {label:>7s}  points lost")
    for task, rate in full.items():
        print(f"{task or 'base (echo)':12s} {rate:7.1%} {reduced[task]:7.1%}  {100 * (rate - reduced[task]):+.1f}")
    return {task: (rate, reduced[task]) for task, rate in full.items()}


if __name__ == "__main__":
    main()
