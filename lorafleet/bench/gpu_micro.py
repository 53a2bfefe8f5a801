"""The GPU kernels' microbenchmark: each LoRA design against the read ceiling, in at most 5 minutes.

    python -m lorafleet.bench.gpu_micro [--out DIR] [--shapes 1b,8b] [--deadline 270] [--quant]

Run it first whenever a GPU is lent (`kernels/gpu_check.sh` does): it decides which design of
`lora_triton.CANDIDATES` the engine keeps (`lora_triton.CONFIG`) and says how far each is from
the memory bound, before any engine figure is measured.

For each model shape (random bf16 weights in a pool on the device; pages of the engine's page
size for that shape, shuffled; the adapters' row tables built by the engine's own `Layout`):
- the device's copy bandwidth (a device-to-device copy: bytes read + written / time), and the
  rate of a vectorized read (`_read_kernel`: 16-byte loads, one sum a program) of exactly the
  bytes each case must move: the ceiling a kernel of that size can reach, launch and tail
  included;
- every candidate LoRA configuration on the cases
    r16 x 64      64 one-row segments, each its own rank-16 adapter, the qkv group
    ranks 8-256   64 one-row segments of ranks 8, 16, ..., 256 in turn, the qkv group
    1 r16 layer   one rank-16 adapter (all 7 projections) over 64 rows, the 4 groups of a layer
    64 r8-64      64 one-row segments of ranks 8-64 (all 7 projections), the 4 groups of a layer
  at the bounds a captured decode step passes (segments of at most 16 rows, the rank bucket,
  the group's widest output), each timed as replays of a CUDA graph of 10 calls (the kernels'
  time, not Python's launches), with its parity against `reference.lora` (the largest error
  over the largest magnitude of the output);
- GQA decode attention at batch 64, context 1024 (`attention_triton.paged_decode`).
Bytes moved: the adapters' rows, x read, out read and written. Figures: microseconds, GB/s,
the fraction of the copy bandwidth and of the same-size read's rate (`of_read`: the issue's
">= 70% of the same-size read ceiling").

With `--quant` it measures the quantized projections instead (`gpu_micro_quant`).

JSON goes to `$OUT/gpu_micro.json` (or --out) after every case, so a run cut short keeps what it
measured. On a machine without a GPU it runs the same cases at toy sizes on the CPU kernels (the
tests check it that way), timing nothing that matters.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from lorafleet.kernels import reference
from lorafleet.kernels.reference import lora_entry, scale_bits
from lorafleet.adapters.adapter import BaseShapes
from lorafleet.adapters.batch import GROUP_INDEX, GROUPS, MODULE_SLOTS, group_shapes
from lorafleet.memory.kv import kv_page_elems
from lorafleet.adapters.layout import Layout, pieces

CALLS_PER_GRAPH = 10
SEGMENT_ROWS = 16  # engine/graphs.py's: a captured step's segments


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def features(self) -> dict[str, tuple[int, int]]:
        h, kv, i = self.hidden, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def page_elems(self) -> int:
        return kv_page_elems(self.layers, 16, self.kv_heads, self.head_dim)


SHAPES = {
    "1b": ModelShape(2048, 16, 32, 8, 8192),          # lorafleet.bench.fixtures' "1b"
    "8b": ModelShape(4096, 32, 32, 8, 14336),         # Llama-3-8B
    "toy": ModelShape(64, 2, 4, 2, 128),              # the tests, on the CPU
}
ALL7 = tuple(m for modules in GROUPS.values() for m in modules)


@dataclass
class Case:
    """One layer's LoRA work for a set of adapters over a flat batch: per group (x, out) and the
    segments [S, SEG_FIELDS] (each a segment alone: scale 1, mix 1); `moved` the bytes the op must
    read and write."""

    name: str
    groups: tuple[str, ...]
    seg: torch.Tensor
    xs: dict[str, torch.Tensor]
    outs: dict[str, torch.Tensor]
    max_rank: int
    moved: int


class Pool:
    """A pool on the device holding random adapters of one layer, each in shuffled pages with its
    row table, as residency lays them out."""

    def __init__(self, shape: ModelShape, adapters: list[tuple[int, tuple[str, ...]]], dtype, device):
        E = shape.page_elems()
        self.base = BaseShapes(1, shape.features())
        itemsize = torch.empty(0, dtype=dtype).element_size()
        layouts = [Layout.plan({(0, m): r for m in targets}, self.base, E) for r, targets in adapters]
        need = [-(-lay.paged_numel(itemsize) // E) for lay in layouts]
        g = torch.Generator(device="cpu").manual_seed(0)
        perm = torch.randperm(sum(need) + 1, generator=g).tolist()
        # random weights everywhere (a row reads whatever its pages hold), then the row tables
        self.w = (torch.randn(len(perm) * E, dtype=torch.float32, device=device) * 0.05).to(dtype)
        self.tables, at = [], 0
        for layout, k in zip(layouts, need):
            pages = perm[at:at + k]
            at += k
            start, words, table = layout.row_table(pages, itemsize)
            src = torch.from_numpy(words).view(dtype).to(device)
            for o, lo, n in pieces(pages, E, start, src.numel()):
                self.w[o:o + n] = src[lo:lo + n]
            self.tables.append(table)
        self.itemsize = itemsize


def make_case(name: str, shape: ModelShape, ranks: list[int], targets: tuple[str, ...], rows: list[int],
              groups: tuple[str, ...], dtype, device) -> tuple[Case, Pool]:
    """Segment s: rows[s] rows on its own adapter of rank ranks[s] over `targets` (adapters of
    equal (rank, rows) are not shared: every segment reads its own weights)."""
    pool = Pool(shape, [(r, targets) for r in ranks], dtype, device)
    feats = shape.features()
    starts = np.concatenate([[0], np.cumsum(rows)])
    segs = []
    for s, n in enumerate(rows):  # a captured step splits each segment into runs of SEGMENT_ROWS
        for lo in range(int(starts[s]), int(starts[s + 1]), SEGMENT_ROWS):
            segs.append((lo, min(lo + SEGMENT_ROWS, int(starts[s + 1])), pool.tables[s], scale_bits(1.0), 1))
    T = int(starts[-1])
    g = torch.Generator(device="cpu").manual_seed(1)
    xs, outs, moved = {}, {}, 0
    for group in groups:
        fin = feats[GROUPS[group][0]][0]
        width = sum(feats[m][1] for m in GROUPS[group])
        xs[group] = torch.randn(T, fin, generator=g).to(device, dtype)
        outs[group] = torch.randn(T, width, generator=g).to(device, dtype)
        moved += (xs[group].numel() + 2 * outs[group].numel()) * pool.itemsize
        for r in ranks:
            moved += sum(r * (feats[m][0] + feats[m][1]) for m in GROUPS[group] if m in targets) * pool.itemsize
    seg = torch.tensor(segs, dtype=torch.long, device=device)
    return Case(name, groups, seg, xs, outs, max(ranks), moved), pool


def rank_bucket(r: int) -> int:
    return next(b for b in (16, 64, 256) if b >= r)


def run_lora(case: Case, pool: Pool, op, out: dict[str, torch.Tensor] | None = None) -> None:
    """The case's LoRA calls through `op` (a `Kernels.lora`), into `out` (the case's outputs if None)."""
    shapes = group_shapes(pool.base.features)
    for group in case.groups:
        entry = lora_entry(0, GROUP_INDEX[group], len(GROUPS), MODULE_SLOTS)
        op(case.xs[group], (out or case.outs)[group], pool.w, case.seg, entry, len(GROUPS[group]), SEGMENT_ROWS,
           rank_bucket(case.max_rank), *shapes[group])


def parity(case: Case, pool: Pool, op) -> float:
    """The largest error of `op` against `reference.lora`, over the largest magnitude of the result."""
    def ref_op(x, out, w, seg, entry, slots, *bounds):
        reference.lora(x, out, w, seg, entry, slots)
    got = {g: o.clone() for g, o in case.outs.items()}
    want = {g: o.clone() for g, o in case.outs.items()}
    run_lora(case, pool, op, got)
    run_lora(case, pool, ref_op, want)
    return max(float((got[g].float() - want[g].float()).abs().max() / want[g].float().abs().max()) for g in got)


def timed(fn, device: torch.device, iters: int = 20) -> float:
    """Median seconds of one call: on a GPU replays of a CUDA graph of CALLS_PER_GRAPH calls."""
    fn()
    fn()
    call, calls = fn, 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS_PER_GRAPH):
                fn()
        call, calls = graph.replay, CALLS_PER_GRAPH
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] / calls


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device)


def read_rate(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a vectorized read of `nbytes` (the ceiling for a kernel that must read that much)."""
    src = torch.ones(max(nbytes // 2, 1), dtype=torch.bfloat16, device=device)
    if device.type != "cuda":
        return nbytes / timed(src.sum, device)
    from lorafleet.bench import read_triton
    partial = torch.empty(read_triton.programs(src.numel()), dtype=torch.float32, device=device)
    return nbytes / timed(lambda: read_triton.read_all(src, partial), device)


def cases_for(shape: ModelShape, dtype, device) -> list[tuple[Case, Pool]]:
    mixed = [8 * 2 ** (i % 6) for i in range(64)]           # 8 .. 256
    small = [8 * (1 + i % 8) for i in range(64)]            # 8 .. 64
    qkv, layer = ("qkv",), tuple(GROUPS)
    return [make_case("r16 x 64", shape, [16] * 64, ("q_proj", "k_proj", "v_proj"), [1] * 64, qkv, dtype, device),
            make_case("ranks 8-256", shape, mixed, ("q_proj", "k_proj", "v_proj"), [1] * 64, qkv, dtype, device),
            make_case("1 r16 layer", shape, [16], ALL7, [64], layer, dtype, device),
            make_case("64 r8-64", shape, small, ALL7, [1] * 64, layer, dtype, device)]


def attention_figure(shape: ModelShape, dtype, device, batch: int, context: int) -> dict:
    from lorafleet.kernels import backend
    kernels = backend.select(device, dtype)
    blocks = -(-context // 16)
    kv = torch.randn(batch * blocks + 1, 2, 16, shape.kv_heads, shape.head_dim, device=device).to(dtype)
    tables = torch.randperm(batch * blocks, device=device).view(batch, blocks)
    lens = torch.full((batch,), context, dtype=torch.long, device=device)
    q = torch.randn(batch, shape.heads, shape.head_dim, device=device).to(dtype)
    scale = shape.head_dim ** -0.5
    moved = batch * context * 2 * shape.kv_heads * shape.head_dim * kv.element_size()
    got = kernels.decode(q, kv, tables, lens, scale).float()
    want = reference.paged_decode(q.float(), kv.float(), tables, lens, scale)
    s = timed(lambda: kernels.decode(q, kv, tables, lens, scale), device)
    return {"case": f"decode attention b{batch} ctx {context}", "backend": kernels.name, "us": s * 1e6,
            "bytes": moved, "GB/s": moved / s / 1e9, "error": float((got - want).abs().max() / want.abs().max())}


def run(shapes: list[str], out: Path, deadline_s: float = 270.0, device: str | None = None) -> dict:
    t_start = time.monotonic()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    from lorafleet.kernels import backend
    if on_gpu:
        from lorafleet.kernels import lora_triton
        candidates: dict[str, Callable[..., Any]]
        candidates = {f"{i}: {c}": functools.partial(lora_triton.lora, config=c)
                      for i, c in enumerate(lora_triton.CANDIDATES)}
        configs = {f"{i}: {c}": asdict(c) for i, c in enumerate(lora_triton.CANDIDATES)}
    else:
        kernels = backend.select(dev, dtype)
        candidates = {kernels.name: kernels.lora}
        configs = {kernels.name: {}}
    copy = copy_bandwidth(dev, 1 << 30 if on_gpu else 1 << 24)
    report: dict[str, Any]
    report = {"device": torch.cuda.get_device_name(dev) if on_gpu else "cpu", "dtype": str(dtype),
              "torch": torch.__version__, "copy_GB/s": copy / 1e9, "configs": configs, "shapes": {}}
    out.mkdir(parents=True, exist_ok=True)

    def save(message: str) -> None:
        print(message, flush=True)
        (out / "gpu_micro.json").write_text(json.dumps(report, indent=1))

    save(f"{report['device']}: copy {copy / 1e9:.0f} GB/s")
    for name in shapes:
        shape = SHAPES[name]
        rows = report["shapes"].setdefault(name, [])
        for case, pool in cases_for(shape, dtype, dev):
            ceiling = read_rate(dev, case.moved)
            for label, op in candidates.items():
                if time.monotonic() - t_start > deadline_s:
                    save(f"deadline ({deadline_s:.0f} s) passed: stopping")
                    return report
                err = parity(case, pool, op)
                s = timed(lambda: run_lora(case, pool, op), dev)
                rows.append({"case": case.name, "config": label, "us": s * 1e6, "bytes": case.moved,
                             "GB/s": case.moved / s / 1e9, "of_copy": case.moved / s / copy,
                             "of_read": case.moved / s / ceiling, "read_GB/s": ceiling / 1e9, "error": err})
                r = rows[-1]
                save(f"{name} {case.name} [{label}]: {r['us']:.1f} us, {r['GB/s']:.0f} GB/s, "
                     f"{r['of_read']:.0%} of a {case.moved / 1e6:.1f} MB read, error {err:.1e}")
        if on_gpu:
            torch.cuda.empty_cache()
        rows.append(attention_figure(shape, dtype, dev, 64 if on_gpu else 4, 1024 if on_gpu else 64))
        save(f"{name} {rows[-1]['case']}: {rows[-1]['us']:.1f} us, {rows[-1]['GB/s']:.0f} GB/s")
    report["seconds"] = time.monotonic() - t_start
    save(f"done in {report['seconds']:.0f} s")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-results"))
    parser.add_argument("--shapes", default=None, help="model shapes (default 1b,8b; with --quant 8b)")
    parser.add_argument("--deadline", type=float, default=270.0, help="seconds; cases past it are skipped")
    parser.add_argument("--quant", action="store_true", help="the quantized projections instead (run_quant)")
    args = parser.parse_args()
    shapes = (args.shapes or ("8b" if args.quant else "1b,8b")).split(",")
    if args.quant:
        from lorafleet.bench.gpu_micro_quant import run_quant

        run_quant(shapes, Path(args.out), args.deadline)
        return
    run(shapes, Path(args.out), args.deadline)


if __name__ == "__main__":
    main()
