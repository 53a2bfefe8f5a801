"""`lorafleet bench gpu`: the figures of the GPU path in one run (`kernels/gpu_check.sh` runs it,
after `lorafleet/bench/gpu_micro.py`).

1. Kernels, the engine's own (`Kernels.lora` at its configuration, decode attention), each timed
   alone on `gpu_micro`'s cases and against its figures: the device's copy bandwidth and the rate
   of a vectorized read of the same bytes (the ceiling a kernel of that size can reach).
2. The engine's decode throughput (requests / the median step that only decodes, as
   `lora_decode.decode_step_time` times it) on a random base of the given shape (weights made on
   the device: nothing downloaded, nothing on disk), in bf16 on a GPU, at each batch: no adapter;
   one rank-16 adapter (all 7 projections) on every request; 8 adapters and 64 distinct ones
   (ranks 8-64); `many` registered (a batch touches as many of them as it has requests, loaded
   on first use); a batch mixing ranks 8-256 against one of the uniform mean rank. Adapters of
   the many-adapter cases are names over 16 files (ranks 8-64 in turn), each name in its own
   pages; their targets, and the mixed ranks', are all 7 projections up to the 1b shape and q/v
   beyond (an 8B rank-256 adapter on all 7 is 3 GB of fp32 files). With each case: the
   decode-graph statistics (captures, replays, re-captures) and the host's share of a step.
3. The 64-adapter step against its bound: the base's weights, the step's adapters' bytes and its
   KV read once at the copy bandwidth.

Each figure goes to `progress` as it is measured, so a run cut short (a device lent for minutes)
keeps what it measured in its log. Runs on the CPU too (small shapes, the C++ kernels): the tests
check it that way.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from lorafleet.bench.adapters import write_adapter
from lorafleet.bench.fixtures import build_base, get_shape
from lorafleet.bench.lora_decode import decode_step_time
from lorafleet.bench import gpu_micro
from lorafleet.kernels import backend

QV = ("q_proj", "v_proj")
ALL7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FILES = 16  # distinct adapter files behind the many-adapter cases' names


def model_shape(shape: str) -> gpu_micro.ModelShape:
    s = get_shape(shape)
    return gpu_micro.ModelShape(s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.intermediate_size)


def kernel_figures(shape: str, device: torch.device, dtype, context: int, progress=None) -> list[dict]:
    """The engine's LoRA op on `gpu_micro`'s cases, and decode attention, against the copy
    bandwidth and the same-size read."""
    say = progress or (lambda message: None)
    kernels = backend.select(device, dtype)
    copy = gpu_micro.copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 24)
    say(f"copy bandwidth {copy / 1e9:.0f} GB/s ({kernels.name} kernels, {dtype})")
    rows: list[dict[str, Any]] = [{"copy_GB/s": copy / 1e9}]
    for case, pool in gpu_micro.cases_for(model_shape(shape), dtype, device)[:3]:
        s = gpu_micro.timed(lambda: gpu_micro.run_lora(case, pool, kernels.lora), device)
        ceiling = gpu_micro.read_rate(device, case.moved)
        rows.append({"kernel": f"lora {case.name}", "backend": kernels.name, "us": s * 1e6, "bytes": case.moved,
                     "GB/s": case.moved / s / 1e9, "of_copy_bw": case.moved / s / copy,
                     "of_read": case.moved / s / ceiling, "error": gpu_micro.parity(case, pool, kernels.lora)})
        r = rows[-1]
        say(f"{r['kernel']}: {r['us']:.1f} us, {r['GB/s']:.0f} GB/s, {r['of_read']:.0%} of the same-size read")
    att = gpu_micro.attention_figure(model_shape(shape), dtype, device, 64 if device.type == "cuda" else 4, context)
    rows.append({"kernel": att["case"], "backend": att["backend"], "us": att["us"], "bytes": att["bytes"],
                 "GB/s": att["GB/s"], "of_copy_bw": att["GB/s"] * 1e9 / copy,
                 "of_read": att["bytes"] / att["us"] * 1e6 / gpu_micro.read_rate(device, att["bytes"]),
                 "error": att["error"]})
    say(f"{att['case']}: {att['us']:.1f} us, {att['GB/s']:.0f} GB/s")
    return rows


ASYNC = "1 adapter r16, async_decode"  # the same case with each step read after the next is launched


def _cases(base: Path, batch: int, many: int, big: bool) -> dict[str, tuple[dict[str, Path], list, bool]]:
    """label -> (adapters: name -> folder, the adapter of each request, registered only)."""
    folder = base.parent / f"{base.name}-gpu-adapters"
    folder.mkdir(exist_ok=True)

    def adapter(rank: int, targets, seed: int) -> Path:
        path = folder / f"r{rank}-{'-'.join(t.split('_')[0] for t in targets)}-{seed}"
        return path if path.is_dir() else write_adapter(base, path, rank, targets=targets, seed=seed)
    wide = QV if big else ALL7
    files = [adapter(8 * (1 + i % 8), QV, i) for i in range(FILES)]   # ranks 8..64
    mixed = [8 * 2 ** (i % 6) for i in range(batch)]                    # 8 .. 256
    uniform = round(sum(mixed) / len(mixed))
    distinct = min(64, batch)
    return {
        "no adapter": ({}, [None] * batch, False),
        "1 adapter r16": ({"a": adapter(16, ALL7, 1)}, ["a"] * batch, False),
        ASYNC: ({"a": adapter(16, ALL7, 1)}, ["a"] * batch, False),
        "8 adapters r8-64": ({f"e{i}": files[i] for i in range(8)}, [f"e{i % 8}" for i in range(batch)], False),
        f"{distinct} distinct adapters r8-64": ({f"d{i}": files[i % FILES] for i in range(distinct)},
                                       [f"d{i % distinct}" for i in range(batch)], False),
        f"{many} registered r8-64": ({f"m{i}": files[i % FILES] for i in range(many)},
                                     [f"m{(i * 7) % many}" for i in range(batch)], True),
        "mixed ranks 8-256": ({f"x{r}": adapter(r, wide, r) for r in set(mixed)}, [f"x{r}" for r in mixed], False),
        f"uniform rank {uniform}": ({"u": adapter(uniform, wide, 3)}, ["u"] * batch, False),
    }


def _bound(engine, names: list, steps: int, copy: float) -> float:
    """Seconds to read once, at the copy bandwidth, what a decode step of these requests must: the
    base's weights, its distinct adapters' pages, the KV of their contexts (32-token prompts, the
    median step halfway through `steps`)."""
    model, pool = engine.model, engine.pool
    tied = model.w["embed"].data_ptr() == model.w["lm_head"].data_ptr()
    read = {t.data_ptr(): t for name, t in model.w.items()
            if tied or name not in ("embed", "embed_s")}  # the LM head, tied or not (scales too, quantized)
    weights = sum(t.numel() * t.element_size() for t in read.values())
    adapters = sum(engine.adapters.get(n).numel for n in set(filter(None, names))) * pool.tensor.element_size()
    cfg = model.cfg
    kv = len(names) * (32 + steps // 2) * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * pool.tensor.element_size()
    return (weights + adapters + kv) / copy


def engine_figures(shape: str, device: str, batches: list[int], max_tokens: int, many: int, root: Path | None = None,
                   progress=None, dtype: str = "float32", copy: float | None = None,
                   quantize: str | None = None) -> dict:
    from lorafleet import Engine

    base = build_base(shape, root, on_device=True)
    big = get_shape(shape).hidden_size > 2048
    g = torch.Generator().manual_seed(0)
    on_gpu = torch.device(device).type == "cuda"
    out = {}
    for batch in batches:
        prompts = [torch.randint(3, 200, (32,), generator=g).tolist() for _ in range(batch)]
        cases, rows = _cases(base, batch, many, big), {}
        for label, (adapters, names, registered) in cases.items():
            engine = Engine(base, device=device, dtype=dtype, max_num_seqs=batch, quantize=quantize,
                            async_decode="on" if label == ASYNC else "off")
            try:
                t0 = time.perf_counter()
                for name, path in adapters.items():
                    (engine.register_adapter if registered else engine.load_adapter)(name, path)
                load_s = time.perf_counter() - t0
                # the median pure decode step (the first ones compile the kernels and capture the graphs)
                step_s, _ = decode_step_time(engine, prompts, names, max_tokens)
                steps = [s for s in engine.counters.steps if s["num_generated"] == s["num_seqs"] == batch][1:]
                stats = engine.stats()
                rows[label] = {"tokens_per_s": batch / step_s, "step_ms": step_s * 1e3, "load_s": load_s,
                               "host_share": statistics.median(s["host_s"] / s["time_s"] for s in steps) if steps else None,
                               "kernels": stats["kernels"], "decode_graphs": stats["decode_graphs"]}
                if copy and label.endswith("distinct adapters r8-64"):
                    rows[label]["bound_ms"] = _bound(engine, names, max_tokens, copy) * 1e3
                if progress:
                    r = rows[label]
                    progress(f"{shape} batch {batch}, {label}: {r['tokens_per_s']:.0f} tok/s, step {r['step_ms']:.2f} ms"
                             f" (host {r['host_share'] or 0:.0%}), adapters in {load_s:.1f} s, graphs "
                             f"{stats['decode_graphs'].get('captures', 0)} captures / "
                             f"{stats['decode_graphs'].get('recaptures', 0)} re-captures")
            finally:
                engine.close()
                del engine  # the pool takes most free device memory: hand it back before the next case
                if on_gpu:
                    torch.cuda.empty_cache()
        base_tps = rows["no adapter"]["tokens_per_s"]
        distinct = next(k for k in rows if k.endswith("distinct adapters r8-64"))
        uniform = next(k for k in rows if k.startswith("uniform"))
        ratios = {
            "1 adapter r16 / no adapter": rows["1 adapter r16"]["tokens_per_s"] / base_tps,
            "1 adapter r16: async_decode / off": rows[ASYNC]["tokens_per_s"] / rows["1 adapter r16"]["tokens_per_s"],
            f"{many} registered / 8 adapters": rows[f"{many} registered r8-64"]["tokens_per_s"]
            / rows["8 adapters r8-64"]["tokens_per_s"],
            "mixed ranks / uniform rank": rows["mixed ranks 8-256"]["tokens_per_s"] / rows[uniform]["tokens_per_s"],
        }
        if "bound_ms" in rows[distinct]:
            ratios[f"{distinct} step / its bound"] = rows[distinct]["step_ms"] / rows[distinct]["bound_ms"]
        if rows[distinct]["host_share"] is not None:
            ratios[f"{distinct} step: host share"] = rows[distinct]["host_share"]
        if rows[ASYNC]["host_share"] is not None:
            ratios[f"{ASYNC} step: host share"] = rows[ASYNC]["host_share"]
        out[batch] = {"cases": rows, "ratios": ratios,
                      "recaptures": sum(c["decode_graphs"].get("recaptures", 0) for c in rows.values())}
    return {"shape": shape, "quantization": quantize, "mixed_targets": "q/v" if big else "all 7", "batches": out}


def run_gpu_bench(shape: str = "1b", device: str = "cuda", batches: list[int] | None = None, max_tokens: int = 64,
                  many: int = 1000, context: int = 1024, root: Path | None = None, progress=None,
                  quantize: str | None = None) -> dict:
    """The kernels' and the engine's figures on `device`; `quantize` (int8 | int4): the engine's base
    quantized at load (the kernel figures stay the LoRA op's and attention's)."""
    dev = torch.device(device)
    # bf16 on a GPU for the kernels and the engine alike
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    kernels = kernel_figures(shape, dev, dtype, context, progress)
    return {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "kernels": kernels,
            "engine": engine_figures(shape, device, batches or [64], max_tokens, many, root, progress,
                                     str(dtype).removeprefix("torch."), kernels[0]["copy_GB/s"] * 1e9, quantize)}
