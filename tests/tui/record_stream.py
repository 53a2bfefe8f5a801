"""Record the stats stream the TUI tests replay: `python -m tests.tui.record_stream`.

A tiny random model and eight adapters of ranks 2-32, all registered on disk (and two more
that no request names), a pool small
enough that they cannot all stay on the device and a host cache that holds a few, and three
waves of requests that mix them; one `/v1/stats`-shaped snapshot (the server part fixed:
pid 4242, a clock of one second per snapshot) every few engine steps. The snapshots go to
`tests/tui/data/stream.json`; the tests never run an engine to get them, so what they draw is
the same on every machine.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from tests.fixtures import build_adapter, build_model

OUT = Path(__file__).parent / "data" / "stream.json"
SPARE = ("spare-a", "spare-b")
ADAPTERS = [("sql-r16", 16, ["q_proj", "v_proj"]), ("chat-r8", 8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
            ("code-r32", 32, ["q_proj", "v_proj", "gate_proj"]), ("tiny-r2", 2, ["o_proj"]),
            ("math-r4", 4, ["up_proj", "down_proj"]), ("law-r16", 16, ["q_proj", "k_proj"]),
            ("med-r8", 8, ["v_proj", "o_proj"]), ("poem-r24", 24, ["q_proj", "v_proj"])]


def main() -> None:
    from lorafleet import Engine, SamplingParams
    from lorafleet.server.metrics import engine_snapshot, v1_stats

    root = Path(tempfile.mkdtemp())
    base = build_model(root / "base", "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    engine = Engine(base, device="cpu", pool_bytes=300_000, host_cache_bytes=150_000)
    for i, (name, rank, targets) in enumerate(ADAPTERS):
        engine.register_adapter(name, build_adapter(base, root / name, seed=i, r=rank, lora_alpha=2 * rank,
                                                    target_modules=targets))
    for name in SPARE:  # registered, never asked for: `untouched_adapters`
        engine.register_adapter(name, root / ADAPTERS[0][0])
    snaps, clock = [], 0.0

    def snapshot():
        nonlocal clock
        clock += 1.0
        snaps.append(v1_stats("0.1.0", {
            "pid": 4242, "socket": "/run/user/1000/lorafleet/lorafleet.sock", "model": "tiny",
            "model_path": "/models/tiny", "sampling_defaults": {}, "started": 0.0, "uptime_s": clock,
            "tcp": None, "pending": engine.stats()["num_waiting"] + engine.stats()["num_running"],
            "max_pending": 1024, "draining": False, "num_rejected": 0, "num_disconnects": 0,
            "engine_alive": True, "engine_steps_failed": 0}, engine_snapshot(engine)))

    params = SamplingParams(max_tokens=12, temperature=0.0)
    waves = [[0, 1, 2, 0, 0, 3], [4, 5, 0, 6, 1, 1, 7], [2, 0, 0, 1, 5, 6, 3, 4]]
    snapshot()
    for w, wave in enumerate(waves):
        for j, a in enumerate(wave):
            engine.add_request([5 + (7 * j + w) % 90 for _ in range(20 + 3 * j)], params, ADAPTERS[a][0])
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
            if steps % 3 == 0:
                snapshot()
        snapshot()
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(snaps, indent=None, separators=(",", ":")) + "\n")
    print(f"{len(snaps)} snapshots -> {OUT}")


if __name__ == "__main__":
    main()
