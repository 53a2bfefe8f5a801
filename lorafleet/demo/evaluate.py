"""Measure the demo fleet: `python -m lorafleet.demo.evaluate [--texts N] [--quantize int8|int4]`.

Every skill (and the base's echo) on the held-out texts, greedy, all requests in one engine run;
prints each adapter's exact-match rate and the highest rate at which its answers match another
skill's. The README's table comes from this; tests/demo/test_fleet.py asserts the same numbers.
With --quantize, the fleet on the base quantized at load (adapters in full precision) beside full
precision: each skill's exact match in both and the points lost.
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
    args = ap.parse_args(argv)
    if args.quantize:
        compare(args.texts, args.quantize)
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


def compare(n_texts: int, scheme: str) -> dict[str | None, tuple[float, float]]:
    """Each task's exact match on the full-precision base and on the base in `scheme`, printed
    with the points lost; returns {task: (full, quantized)}."""
    rates = {}
    for quantize in (None, scheme):
        engine = fleet_engine(quantize=quantize)
        rates[quantize] = {task: accuracy(answers, task) for task, answers in evaluate(engine, n_texts).items()}
        engine.close()
    print(f"{'skill':12s} {'full':>7s} {scheme:>7s}  points lost")
    for task, full in rates[None].items():
        print(f"{task or 'base (echo)':12s} {full:7.1%} {rates[scheme][task]:7.1%}  "
              f"{100 * (full - rates[scheme][task]):+.1f}")
    return {task: (full, rates[scheme][task]) for task, full in rates[None].items()}


if __name__ == "__main__":
    main()
