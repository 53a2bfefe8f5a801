"""Micro-benchmark of the CPU matmul on quantized weights (`quant_cpu`): a decode step's
matmuls on a model-shaped set of layers, int8 and int4, at 1 and 8 rows, against the memory bound
(the codes' and scales' bytes over the read bandwidth measured in the same run,
`lora_decode.measure_bandwidth`) and against the fp32 kernel (`linear_cpu.linear`) on the same
shapes. Each weight set is timed in turn, round after round, and each figure is the median over
the rounds of the best pass of a round, the bound taken per round (the machine is shared: ratios
only within one run); `best`: the least disturbed round's ratio.

    .venv/bin/python -m lorafleet.bench.quant_micro --shape llama1b --rounds 5

Shapes: `llama1b` (Llama-3.2-1B: hidden 2048, intermediate 8192, 32 q / 8 kv heads of 64, 16
layers), `smol` (SmolLM2-135M-like: hidden 576, intermediate 1536, 9 q / 3 kv heads of 64, 30
layers); each layer's qkv, o, gate_up and down, every layer its own tensors (a step reads each
once), codes random (the kernel's time does not depend on their values), on huge pages where
the host has them, as the model's weights are.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch

SHAPES = {  # hidden, intermediate, q heads, kv heads, head dim, layers
    "llama1b": (2048, 8192, 32, 8, 64, 16),
    "smol": (576, 1536, 9, 3, 64, 30),
}


def layer_shapes(shape: str) -> list[tuple[int, int]]:
    h, i, qh, kvh, d, _ = SHAPES[shape]
    return [((qh + 2 * kvh) * d, h), (h, qh * d), (2 * i, h), (h, i)]


def weights(shape: str, scheme: str | None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Every layer's four matrices: (codes, scales) for `scheme`, (fp32 weight, None) for None."""
    from lorafleet import hugepages

    g = torch.Generator().manual_seed(0)
    out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for _ in range(SHAPES[shape][-1]):
        for n, k in layer_shapes(shape):
            if scheme is None:
                w = hugepages.empty(n, k, dtype=torch.float32)
                out.append((w.uniform_(-0.05, 0.05, generator=g), None))
                continue
            group = k if scheme == "int8" else 32
            q = hugepages.empty(n, k if scheme == "int8" else k // 2, dtype=torch.int8 if scheme == "int8" else torch.uint8)
            q.copy_(torch.randint(-127 if scheme == "int8" else 0, 128 if scheme == "int8" else 256, q.shape,
                                  generator=g, dtype=torch.int16).to(q.dtype))
            scales = (torch.rand(n, k // group, generator=g) * 0.01 + 0.001).half()
            out.append((q, scales))
    return out


def nbytes(ws) -> int:
    return sum(t.numel() * t.element_size() for pair in ws for t in pair if t is not None)


def pass_time(ws, rows: int, dtype: torch.dtype, passes: int) -> float:
    """The best of `passes` passes over every matrix, each on `rows` random rows of its width."""
    from lorafleet.bench.lora_decode import best_seconds
    from lorafleet.kernels import linear_cpu, quant_cpu

    xs = {k: torch.randn(rows, k).to(dtype) for k in {w.shape[1] * (2 if w.dtype == torch.uint8 else 1) for w, _ in ws}}

    def one():
        for w, s in ws:
            k = w.shape[1] * (2 if w.dtype == torch.uint8 else 1)
            if s is None:
                linear_cpu.linear(xs[k], w, None)
            else:
                quant_cpu.linear(xs[k], w, None, s)

    one()  # warm: first touch, the build
    return best_seconds(one, passes)


def host() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    flags = open("/proc/cpuinfo").read()
    isa = [f for f in ("avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f" {f}" in flags]
    return f"{model}, {torch.get_num_threads()} threads, {'/'.join(isa) or 'avx2'}"


def main(argv=None) -> dict:
    from lorafleet.bench.lora_decode import measure_bandwidth

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=SHAPES, default="llama1b")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--schemes", nargs="+", default=["int8", "int4"])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--no-fp32", action="store_true", help="skip the fp32 kernel's figures")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    sets = {s: weights(args.shape, s) for s in args.schemes}
    if not args.no_fp32:
        sets["fp32"] = weights(args.shape, None)
    times: dict[tuple, list[float]] = {}
    ratios: dict[tuple, list[float]] = {}
    bws = []
    for _ in range(args.rounds):
        bw = measure_bandwidth()
        bws.append(bw)
        for name, ws in sets.items():
            for rows in args.rows:
                t = pass_time(ws, rows, dtype, args.passes)
                times.setdefault((name, rows), []).append(t)
                ratios.setdefault((name, rows), []).append(t * bw / nbytes(ws))
    out = {"host": host(), "shape": args.shape, "dtype": args.dtype, "bandwidth_gb_s": statistics.median(bws) / 1e9,
           "results": []}
    for (name, rows), ts in times.items():
        fp32 = times.get(("fp32", rows))
        out["results"].append({
            "weights": name, "rows": rows, "mb": nbytes(sets[name]) / 1e6,
            "ms": statistics.median(ts) * 1e3, "x_bound": statistics.median(ratios[(name, rows)]),
            "x_bound_best": min(ratios[(name, rows)]),
            "x_fp32_time": statistics.median(ts) / statistics.median(fp32) if fp32 else None})
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"host: {out['host']}; shape {args.shape}, x {args.dtype}; read bandwidth "
              f"{out['bandwidth_gb_s']:.1f} GB/s (median of {args.rounds} rounds)")
        print(f"{'weights':8} {'rows':>4} {'MB':>8} {'ms':>8} {'x bound':>8} {'best':>6} {'x fp32 time':>11}")
        for r in out["results"]:
            fp = f"{r['x_fp32_time']:.3f}" if r["x_fp32_time"] is not None else "-"
            print(f"{r['weights']:8} {r['rows']:>4} {r['mb']:>8.1f} {r['ms']:>8.2f} "
                  f"{r['x_bound']:>8.2f} {r['x_bound_best']:>6.2f} {fp:>11}")
    return out


if __name__ == "__main__":
    main()
