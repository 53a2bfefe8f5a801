"""`lorafleet bench gpu`: the figures of the GPU path in one run (`kernels/gpu_check.sh` runs it).

1. Kernels, each timed alone against the device's copy bandwidth (a device-to-device copy of
   1 GiB, bytes read + written): the LoRA op in decode form (one token per adapter, rank 16, and
   ranks mixed 8-256) and paged decode attention; achieved bandwidth = the bytes each must read
   and write (adapter weights, KV, inputs, outputs) / its time. On a GPU every call is replayed
   from a CUDA graph, as a decode step runs them (`timed`).
2. The engine's decode throughput (requests / the median step that only decodes, as
   `lora_decode.decode_step_time` times it) on a random base of the given shape, in bf16 on a
   GPU: no adapter; one rank-16 adapter on every request; 8 and 1,000 adapters (ranks 8-64; the
   1,000 are registered names over 16 distinct files, each loaded into its own pages; q/v
   targets, so the 1,000 fit a load budget of minutes); a batch mixing ranks 8-256 against one
   of the uniform mean rank. With the decode-graph statistics: captures, replays, re-captures,
   capture time and memory.

Each figure goes to `progress` as it is measured, so a run cut short (a device lent for minutes)
keeps what it measured in its log.

Runs on the CPU too (small shapes, the C++ kernels): the tests check it that way.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from lorafleet.bench.adapters import write_adapter
from lorafleet.bench.fixtures import build_base
from lorafleet.bench.lora_decode import decode_step_time
from lorafleet.kernels import backend
from lorafleet.kernels.reference import META_FIELDS
from lorafleet.lora.batch import MODULE_SLOTS
from lorafleet.model.config import ModelConfig

QV = ("q_proj", "v_proj")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, iters: int, per_graph: int = 10) -> float:
    """Median seconds of one call over `iters` timings (after two untimed calls). On a GPU each
    timing replays a CUDA graph of `per_graph` calls, as a decode step replays its kernels: the
    kernel's time, not Python's launch of it (a Triton launch from Python costs tens of us, more
    than these kernels take)."""
    fn(), fn()
    call, calls = fn, 1
    if device.type == "cuda":
        _sync(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(per_graph):
                fn()
        call, calls = graph.replay, per_graph
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] / calls


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device, 10)


def _lora_case(cfg: ModelConfig, ranks: list[int], dtype, device, page_elems: int):
    """The qkv group of one layer for len(ranks) adapters, one token each, pages shuffled."""
    fan_in, outs = cfg.hidden_size, [cfg.q_size, cfg.kv_size, cfg.kv_size]
    numels = [r * fan_in * 3 + sum(r * o for o in outs) for r in ranks]
    pages = [-(-n // page_elems) for n in numels]
    total = sum(pages)
    w = torch.randn(total * page_elems, dtype=dtype, device=device) * 0.01
    perm = torch.randperm(total, device=device)
    tables = torch.zeros(len(ranks), max(pages), dtype=torch.long, device=device)
    meta = torch.zeros(len(ranks), MODULE_SLOTS, META_FIELDS, dtype=torch.long)
    at = 0
    for s, (r, k) in enumerate(zip(ranks, pages)):
        tables[s, :k] = perm[at:at + k]
        at += k
        b_off, col = 3 * r * fan_in, 0
        for j, o in enumerate(outs):
            meta[s, j] = torch.tensor([j * r * fan_in, r, b_off, o, col])
            b_off += r * o
            col += o
    seg = torch.stack([torch.arange(len(ranks)), torch.arange(1, len(ranks) + 1)], 1).to(device)
    x = torch.randn(len(ranks), fan_in, dtype=dtype, device=device)
    out = torch.zeros(len(ranks), sum(outs), dtype=dtype, device=device)
    moved = sum(numels) * w.element_size() + (x.numel() + 2 * out.numel()) * x.element_size()
    return (x, out, w, page_elems, seg, meta.to(device), tables, 1, max(ranks)), moved


def kernel_figures(cfg: ModelConfig, device: torch.device, dtype, batch: int, context: int, iters: int,
                   progress=None) -> list[dict]:
    kernels = backend.select(device, dtype)
    copy = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 26)
    say = progress or (lambda message: None)
    say(f"copy bandwidth {copy / 1e9:.0f} GB/s ({kernels.name} kernels, {dtype})")
    page_elems = cfg.num_layers * 2 * 16 * cfg.num_kv_heads * cfg.head_dim
    rows = []

    def add(name: str, fn, moved: int) -> None:
        s = timed(fn, device, iters)
        rows.append({"kernel": name, "backend": kernels.name, "us": s * 1e6, "bytes": moved,
                     "GB/s": moved / s / 1e9, "of_copy_bw": moved / s / copy})
        say(f"{name}: {s * 1e6:.1f} us, {moved / s / 1e9:.0f} GB/s, {moved / s / copy:.0%} of copy")

    for name, ranks in (("lora decode r16", [16] * batch),
                        ("lora decode ranks 8-256", [8 * 2 ** (i % 6) for i in range(batch)])):
        args, moved = _lora_case(cfg, ranks, dtype, device, page_elems)
        add(name, lambda a=args: kernels.lora(*a), moved)
    blocks = -(-context // 16)
    kv = torch.randn(batch * blocks + 1, 2, 16, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
    tables = torch.randperm(batch * blocks, device=device).view(batch, blocks)
    lens = torch.full((batch,), context, dtype=torch.long, device=device)
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
    moved = batch * context * 2 * cfg.num_kv_heads * cfg.head_dim * kv.element_size()
    add(f"paged decode attention ctx {context}", lambda: kernels.decode(q, kv, tables, lens, cfg.head_dim ** -0.5), moved)
    return [{"copy_GB/s": copy / 1e9}, *rows]


def engine_figures(shape: str, device: str, batch: int, max_tokens: int, many: int, root: Path | None = None,
                   progress=None, dtype: str = "float32") -> dict:
    from lorafleet import Engine

    base = build_base(shape, root)
    folder = base.parent / f"{base.name}-gpu-adapters"
    folder.mkdir(exist_ok=True)
    def adapter(rank: int, targets, seed: int) -> Path:
        path = folder / f"r{rank}-{'-'.join(targets)}-{seed}"
        return path if path.is_dir() else write_adapter(base, path, rank, targets=targets, seed=seed)
    all7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    mixed = [8 * 2 ** (i % 6) for i in range(batch)]                       # 8 .. 256
    uniform = round(sum(mixed) / len(mixed))
    cases = {
        "no adapter": ({}, [None] * batch),
        "1 adapter r16": ({"a": adapter(16, all7, 1)}, ["a"] * batch),
        "8 adapters r8-64": ({f"e{i}": adapter(8 * (1 + i % 8), QV, i) for i in range(8)},
                             [f"e{i % 8}" for i in range(batch)]),
        f"{many} adapters r8-64": ({f"m{i}": adapter(8 * (1 + i % 8), QV, i % 16) for i in range(many)},
                                   [f"m{(i * 7) % many}" for i in range(batch)]),
        "mixed ranks 8-256": ({f"x{r}": adapter(r, all7, r) for r in set(mixed)}, [f"x{r}" for r in mixed]),
        f"uniform rank {uniform}": ({"u": adapter(uniform, all7, 3)}, ["u"] * batch),
    }
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (32,), generator=g).tolist() for _ in range(batch)]
    out = {}
    on_gpu = torch.device(device).type == "cuda"
    for label, (adapters, names) in cases.items():
        engine = Engine(base, device=device, dtype=dtype, max_num_seqs=batch)
        try:
            t0 = time.perf_counter()
            for name, path in adapters.items():
                engine.load_adapter(name, path)
            load_s = time.perf_counter() - t0
            # the median pure decode step (the first ones compile the kernels and capture the graphs)
            step_s, _ = decode_step_time(engine, prompts, names, max_tokens)
            tps = len(names) / step_s
            stats = engine.stats()
            out[label] = {"tokens_per_s": tps, "load_s": load_s, "kernels": stats["kernels"],
                          "decode_graphs": stats["decode_graphs"]}
            if progress:
                progress(f"decode, {label}: {tps:.0f} tok/s (adapters loaded in {load_s:.1f} s), "
                         f"graphs {stats['decode_graphs']}")
        finally:
            engine.close()
            # the pool takes most free device memory: hand this case's back before the next one
            del engine
            if on_gpu:
                torch.cuda.empty_cache()
    base_tps = out["no adapter"]["tokens_per_s"]
    ratios = {
        "1 adapter r16 / no adapter": out["1 adapter r16"]["tokens_per_s"] / base_tps,
        f"{many} adapters / 8 adapters": out[f"{many} adapters r8-64"]["tokens_per_s"] / out["8 adapters r8-64"]["tokens_per_s"],
        "mixed ranks / uniform rank": out["mixed ranks 8-256"]["tokens_per_s"] / out[f"uniform rank {uniform}"]["tokens_per_s"],
    }
    return {"shape": shape, "batch": batch, "cases": out, "ratios": ratios,
            "recaptures": sum(c["decode_graphs"].get("recaptures", 0) for c in out.values())}


def run_gpu_bench(shape: str = "1b", device: str = "cuda", batch: int = 64, max_tokens: int = 64,
                  many: int = 1000, context: int = 1024, root: Path | None = None, progress=None) -> dict:
    dev = torch.device(device)
    # bf16 on a GPU for the kernels and the engine alike (the random base is saved in fp32)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = ModelConfig.from_folder(build_base(shape, root))
    return {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "kernels": kernel_figures(cfg, dev, dtype, batch, context, 20, progress),
            "engine": engine_figures(shape, device, batch, max_tokens, many, root, progress,
                                     str(dtype).removeprefix("torch."))}
