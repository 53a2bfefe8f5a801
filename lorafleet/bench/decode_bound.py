"""`lorafleet bench decode-bound`: a decode step of the base model against the memory bound.
At small batch a decode step is a matrix-vector problem: it must read every weight
once, so its floor is the step's weight bytes over the machine's read bandwidth, measured in
the same run (`lora_decode.measure_bandwidth`: a streaming sum over 1 GiB).

Per batch size (1, 8, 32 by default): the median time of a pure decode step (no adapters, short
prompts, so the KV read is small beside the weights'), the bound, and their ratio (the
target: within 1.5x at batch 1 and 8), in float32 or bfloat16 (half the bytes). The weight
bytes are every distinct weight tensor of the model but the embedding table (a step reads one
row of it per sequence), the LM head counted once even when tied to it.

A quantized base (`--quantize int8|int4`: `lorafleet.model.quant`) is measured the
same way: the bound counts what a step reads as stored, each quantized weight's codes (int8, or
uint8 with two int4 values a byte) and its float16 scales, beside the norms in the compute dtype;
the matmuls pass each weight with its scales (and a GGUF file's affine types their offsets) to
`Kernels.linear`. The report adds the base's memory: every weight tensor it holds (the embedding
included) against the same model's float32 bytes (`memory_ratio`; the targets, `MEMORY_TARGETS`:
int8 <= 0.27x, int4 <= 0.15x).
The 8b shape runs here only in int4 (`fixtures.CPU_SCHEMES`), its weights made in memory.

Beside each step, the profile of a miss: the step's matmuls alone (`matmul_time`: one
`Kernels.linear` call per distinct weight matrix, on as many random rows as the batch, the best
of a few passes), against the same round's bound. Where the step misses its target, this says
whether the matmuls already do or the rest of the step (attention, norms, the engine) does;
the matmuls' compute floor (`matmul_cached_time`: the same matmuls at the kernels' rate on
weights kept in cache), which says whether the multiply-adds alone come near the bound (where
they do, the stream can reach the bound only if the FMAs hide under it entirely); and the
engine's part of the step (`host_ms`: its step records' `host_s`, the median over the same
steps: scheduling, the batch, sampling and outputs, everything around the forward pass).

Other work on the machine is measured per round like the peer benchmarks' (`machine.other_cores`:
the CPU time of other processes, and the time the hypervisor gave the machine's other guests);
a round that had more than `report.CONTENDED_CORES` of it is named under the table: its steps
and its bound are the host's figures, not the code's (a busy hypervisor can make steps several
times slower with the kernels unchanged).

The bandwidth is measured again after each round, and each round's steps are set against their
own round's bound; the ratio is the median of those. On a shared machine whose speed drifts
over minutes, one bandwidth taken at the end let the ratio follow the drift rather than the code.
"""

from __future__ import annotations

import statistics
import time

import torch

from lorafleet.bench.fixtures import ON_DEVICE_ONLY, build_base, check_cpu_fit
from lorafleet.bench.lora_decode import best_seconds, decode_step_time, measure_bandwidth
from lorafleet.bench.machine import cpu_seconds, other_cores, other_cpu_seconds
from lorafleet.model import quant

TARGET_RATIO = 1.5
MEMORY_TARGETS = {"int8": 0.27, "int4": 0.15}  # the base's bytes (scales included) against fp32's


def step_weight_bytes(weights: dict[str, torch.Tensor]) -> int:
    """Bytes of the weights one decode step reads (distinct storages; the embedding's own table
    only where it is the LM head too). A quantized weight is its codes (int8, or uint8 holding
    two int4 values) and its scales (`<name>_s`), both as stored."""
    seen, total = set(), 0
    untied = weights["lm_head"].data_ptr() != weights["embed"].data_ptr()
    for name, t in weights.items():
        ptr = t.data_ptr()
        if ptr in seen or (untied and name in ("embed", "embed_s")):
            continue
        seen.add(ptr)
        total += t.numel() * t.element_size()
    return total


def fp32_weight_bytes(cfg) -> int:
    """The same model's weights in float32 (a `ModelConfig`'s checkpoint shapes, a tied
    embedding once): what the quantized base's memory is set against."""
    from math import prod

    from lorafleet.model.loader import expected_shapes

    return 4 * sum(prod(shape) for shape in expected_shapes(cfg).values())


def matmul_weights(weights: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor | None,
                                                                   torch.Tensor | None]]:
    """The distinct weight matrices a decode step multiplies, each with its scales (`<name>_s`,
    None where it is not quantized) and its group offsets (`<name>_o`, a GGUF file's affine types;
    else None): every weight of two dimensions or more (a matrix, or one packed into panels by
    `Kernels.pack`) but the embedding table (the LM head counted once, whether or not it is the
    embedding's storage) and the scales and offsets themselves."""
    seen, out = set(), []
    for name, t in weights.items():
        if t.dim() >= 2 and name != "embed" and not name.endswith(("_s", "_o")) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out.append((t, weights.get(name + "_s"), weights.get(name + "_o")))
    return out


def in_width(w: torch.Tensor) -> int:
    """The input features a weight multiplies: an int4 weight's codes hold two a byte."""
    return quant.in_features(w) if w.dtype in (torch.int8, torch.uint8) else w.shape[1]


def _linear(kernels, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None, offsets: torch.Tensor | None):
    return kernels.linear(x, w) if scales is None else kernels.linear(x, w, None, scales, offsets)


def _nbytes(w: torch.Tensor, scales: torch.Tensor | None, offsets: torch.Tensor | None) -> int:
    return quant.nbytes(w, scales, offsets)


def matmul_time(model, rows: int, passes: int = 5) -> float:
    """Seconds of a decode step's matmuls alone at `rows` rows: one `Kernels.linear` call per
    distinct weight (`matmul_weights`; a quantized one with its scales) on random rows of its
    input width, in the model's compute dtype; the best of `passes` passes over all of them
    (each pass streams every weight once, as a step does)."""
    weights = matmul_weights(model.w)
    g = torch.Generator().manual_seed(0)
    xs = {k: torch.randn(rows, k, generator=g).to(model.dtype) for k in {in_width(w) for w, _, _ in weights}}

    def one_pass():
        for w, s, o in weights:
            _linear(model.kernels, xs[in_width(w)], w, s, o)
    return best_seconds(one_pass, passes)


def matmul_cached_time(model, rows: int, slice_bytes: int = 2 << 20, calls: int = 16, passes: int = 3) -> float:
    """Seconds a decode step's matmuls would take at `rows` rows if every weight stayed in cache:
    the compute floor of the kernels at that batch, beside the memory bound (where it comes near
    the bound, the FMAs and not the memory set the pace). Per distinct weight layout (all
    dimensions but the first, the dtype, a quantized weight's scales' width and whether it has
    offsets), the kernel's seconds per byte on a slice of about `slice_bytes` of the first such
    weight (its first rows, with their scales and offsets, kept in cache across `calls` calls; the
    best of `passes`), times the bytes of every weight of that layout (`matmul_weights`, scales and
    offsets included). 2 MiB by default:
    smaller slices add each call's start to the floor, larger ones leave a core's L2."""
    weights = matmul_weights(model.w)
    g = torch.Generator().manual_seed(0)
    per_byte: dict[tuple, float] = {}
    total = 0.0
    for w, s, o in weights:
        key = (tuple(w.shape[1:]), w.dtype, None if s is None else tuple(s.shape[1:]), o is None)
        if key not in per_byte:
            row_bytes = _nbytes(w[0:1], None if s is None else s[0:1], None if o is None else o[0:1])
            n = max(1, min(w.shape[0], slice_bytes // row_bytes))
            piece, piece_s, piece_o = w[:n], None if s is None else s[:n], None if o is None else o[:n]
            x = torch.randn(rows, in_width(w), generator=g).to(w.dtype if s is None else model.dtype)
            _linear(model.kernels, x, piece, piece_s, piece_o)  # into the cache

            def repeated():
                for _ in range(calls):
                    _linear(model.kernels, x, piece, piece_s, piece_o)
            per_byte[key] = best_seconds(repeated, passes) / (calls * _nbytes(piece, piece_s, piece_o))
        total += per_byte[key] * _nbytes(w, s, o)
    return total


def run_decode_bound(shape: str = "tiny", batches=(1, 8, 32), steps: int = 16, rounds: int = 3,
                     prompt_len: int = 16, threads: int | None = None, dtype: str = "float32",
                     quantize: str | None = None, progress=None, gguf_type: str | None = None) -> dict:
    """`gguf_type`: the base as llama-quantize writes it in that type (Q4_K_M...), served from the
    file; the report gives its tensors' bytes beside those a step reads as served."""
    from lorafleet import Engine

    check_cpu_fit(shape, quantize)
    if threads:
        torch.set_num_threads(threads)
    base = build_base(shape, on_device=shape in ON_DEVICE_ONLY)
    file_bytes = None
    if gguf_type:
        from lorafleet.bench.llamacpp_convert import quantized_gguf
        from lorafleet.model.gguf import GGUFFile

        base = quantized_gguf(base, gguf_type, say=progress or (lambda m: None), threads=threads)
        f = GGUFFile(base)  # a step reads each tensor once, the embedding's only where tied
        file_bytes = sum(int(t.data.nbytes) for n, t in f.tensors.items()
                         if n != "model.embed_tokens.weight" or "lm_head.weight" not in f.tensors)
    engine = Engine(base, device="cpu", dtype=dtype, pool_bytes=1 << 30, quantize=quantize)
    vocab = engine.model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(max(batches))]
    decode_step_time(engine, prompts[:2], [None] * 2, 2)  # warm-up: first allocations, kernel builds
    nbytes = step_weight_bytes(engine.model.w)
    held, fp32 = engine.model.weight_bytes, fp32_weight_bytes(engine.model.cfg)
    times: dict[int, list[float]]
    matmuls: dict[int, list[float]]
    hosts: dict[int, list[float]]
    cached: dict[int, list[float]]
    times, matmuls, hosts = {b: [] for b in batches}, {b: [] for b in batches}, {b: [] for b in batches}
    cached, bandwidths = {b: [] for b in batches}, []
    others = []  # cores other work kept busy in each round (None where /proc cannot say)
    for r in range(rounds):
        before, started = cpu_seconds(), time.perf_counter()
        for b in batches:
            times[b].append(decode_step_time(engine, prompts[:b], [None] * b, steps)[0])
            hosts[b].append(statistics.median(s["host_s"] for s in engine.step_records()[-steps:]))  # its decode steps
            matmuls[b].append(matmul_time(engine.model, b))
            cached[b].append(matmul_cached_time(engine.model, b))
        bandwidths.append(measure_bandwidth())  # the bound of this round's steps, measured beside them
        others.append(other_cores(other_cpu_seconds(before, cpu_seconds()), time.perf_counter() - started))
        if progress:
            for b in batches:
                progress(f"{shape} round {r + 1}/{rounds} batch {b}: decode step {times[b][-1] * 1e3:.2f} ms, "
                         f"{times[b][-1] * bandwidths[-1] / nbytes:.2f}x the bound at {bandwidths[-1] / 1e9:.1f} GB/s; "
                         f"its matmuls alone {matmuls[b][-1] * 1e3:.2f} ms ({cached[b][-1] * 1e3:.2f} on weights in cache), "
                         f"the engine around the model {hosts[b][-1] * 1e3:.2f} ms")
    bandwidth = statistics.median(bandwidths)
    bound = nbytes / bandwidth
    rows = []
    for b in batches:
        step = statistics.median(times[b])
        ratios = [t * bw / nbytes for t, bw in zip(times[b], bandwidths)]  # each round's step over its own bound
        mm_ratios = [t * bw / nbytes for t, bw in zip(matmuls[b], bandwidths)]
        cached_ratios = [t * bw / nbytes for t, bw in zip(cached[b], bandwidths)]
        rows.append({"batch": b, "step_ms": step * 1e3, "bound_ms": bound * 1e3, "ratio": statistics.median(ratios),
                     "round_step_ms": [t * 1e3 for t in times[b]], "round_ratios": ratios,
                     "matmul_ms": statistics.median(matmuls[b]) * 1e3, "matmul_ratio": statistics.median(mm_ratios),
                     "round_matmul_ms": [t * 1e3 for t in matmuls[b]], "round_matmul_ratios": mm_ratios,
                     "cached_ms": statistics.median(cached[b]) * 1e3, "cached_ratio": statistics.median(cached_ratios),
                     "round_cached_ms": [t * 1e3 for t in cached[b]], "round_cached_ratios": cached_ratios,
                     "host_ms": statistics.median(hosts[b]) * 1e3, "round_host_ms": [t * 1e3 for t in hosts[b]],
                     "tokens_per_s": b / step, "effective_gb_s": nbytes / step / 1e9,
                     **({"file_ratio": statistics.median(t * bw / file_bytes for t, bw in zip(times[b], bandwidths))}
                        if file_bytes else {})})
    return {"benchmark": "decode-bound", "shape": shape, "dtype": str(engine.model.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "steps": steps, "rounds": rounds,
            "quantization": engine.model.quantization, "weight_bytes": nbytes, "gguf_type": gguf_type,
            "file_bytes": file_bytes,
            "model_weight_bytes": held, "fp32_weight_bytes": fp32, "memory_ratio": held / fp32,
            "memory_target": MEMORY_TARGETS.get(engine.model.quantization), "bandwidth_gb_s": bandwidth / 1e9, "bound_ms": bound * 1e3,
            "round_bandwidths_gb_s": [bw / 1e9 for bw in bandwidths],
            "round_other_cores": others, "other_cores": max((o for o in others if o is not None), default=None),
            "batches": rows, "target_ratio": TARGET_RATIO,
            "target_met": all(r["ratio"] <= TARGET_RATIO for r in rows if r["batch"] in (1, 8))}
