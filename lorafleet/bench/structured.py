"""What structured output costs a step: on the demo fleet's base, B requests under a JSON schema
against the same B requests free, greedy, the two alternated in one process, `rounds` times; each
round's mean step time over the first `steps` steps (every row still running). Also the grammar's
compile time, cold (a new schema) and cached. The demo's vocabulary is small (261 tokens), so the
ratio is the per-row host work a constraint adds (filling its mask, advancing its matcher, the
masked draw), not a large vocabulary's mask (docs/benchmark-history.md has those, per token).

    python -m lorafleet.bench.structured --batch 1 --batch 64
"""

from __future__ import annotations

import argparse
import statistics
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {"type": "string"}},
    "role": {"enum": ["admin", "user", "guest"]}, "address": {"type": "object", "properties": {
        "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city"]},
    "active": {"type": "boolean"}, "score": {"type": "number"}},
    "required": ["name", "age", "role", "address"], "additionalProperties": False}


def run(batch: int, steps: int, rounds: int) -> dict:
    from lorafleet import Engine, SamplingParams
    from lorafleet.demo import default_fleet
    from lorafleet.model.grammar import Constraint

    engine = Engine(default_fleet().model, max_num_seqs=max(batch, 1))
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
                engine.add_request(f"record {i}", params)
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
    return {"batch": batch, "free_ms": 1e3 * statistics.median(times["free"]),
            "schema_ms": 1e3 * statistics.median(times["schema"]), "ratio": statistics.median(ratios),
            "compile_cold_ms": 1e3 * cold, "compile_cached_ms": 1e3 * cached}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    for b in args.batch or [1, 64]:
        r = run(b, args.steps, args.rounds)
        print(f"batch {r['batch']}: step {r['free_ms']:.2f} ms free, {r['schema_ms']:.2f} ms under the schema "
              f"({r['ratio']:.2f}x, median of the rounds' ratios); compile {r['compile_cold_ms']:.1f} ms cold, "
              f"{r['compile_cached_ms']:.2f} ms cached")


if __name__ == "__main__":
    main()
