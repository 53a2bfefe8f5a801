"""The multi-LoRA decode benchmark: what a decode step costs with adapters.

Same run, same requests, three configurations interleaved round by round (this machine is
noisy; only ratios measured side by side count):
  none      - 32 requests without adapters
  one       - all 32 on one adapter
  distinct  - 32 requests on 32 distinct adapters (ranks cycling through the rank set)
Figures:
  one / none throughput ratio                       (target >= 0.9)
  LoRA step time added by `distinct`, divided by the time to read those adapters' weights once
  at the memory bandwidth measured in the same run  (target <= 1.5)
  tokens/s against PEFT's mixed-adapter batch (`generate(..., adapter_names=...)`), optional.
With `quantize` (int8 or int4) the base is quantized as it loads, the adapters stay fp32: the
same figures on the lighter base, and no PEFT comparison (PEFT would run the fp32 base).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from lorafleet.bench.adapters import build_adapters
from lorafleet.bench.fixtures import build_base, check_cpu_fit
from lorafleet import hugepages


def best_seconds(fn, repeats: int) -> float:
    """The shortest of `repeats` timed calls of `fn()` (the one least disturbed by other work)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of a streaming read: the best of `repeats` sums over an nbytes float32 tensor, on
    huge pages where the host has them, as the model's weights are (`hugepages`): 4 KiB
    pages read slower, and would make the bound easier than the machine."""
    x = hugepages.empty(nbytes // 4, dtype=torch.float32).fill_(1)
    best = best_seconds(x.sum, repeats)
    del x
    return nbytes / best


def decode_step_time(engine, prompts, adapters, steps: int) -> tuple[float, float]:
    """(median seconds of a pure decode step, wall seconds of the whole run)."""
    from lorafleet import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    t_start = time.perf_counter()
    for p, a in zip(prompts, adapters):
        engine.add_request(p, params, adapter=a)
    times, first = [], True
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        if not first:  # the first step is the prefill of every prompt
            times.append(time.perf_counter() - t0)
        first = False
    return statistics.median(times), time.perf_counter() - t_start


def lora_op_time(engine, adapter_names: list[str], repeats: int = 20) -> float:
    """Median seconds of the LoRA work of one decode step (every layer and projection group),
    timed directly on the step's real LoraBatch: no base model noise around it."""
    from lorafleet import SamplingParams
    from lorafleet.engine.request import Request
    from lorafleet.engine.scheduler import Chunk
    from lorafleet.adapters.batch import GROUPS

    chunks = [Chunk(Request(f"op{i}", [1], SamplingParams(), n, loras=(engine.adapters.get(n),), scales=(1.0,)), 1)
              for i, n in enumerate(adapter_names)]
    chunks = engine.runner.order(chunks)
    feats = engine.model.cfg.linear_features()
    n = len(chunks)
    shapes = {g: (feats[ms[0]][0], sum(feats[m][1] for m in ms)) for g, ms in GROUPS.items()}
    xs = {g: torch.randn(n, fin) for g, (fin, _) in shapes.items()}
    outs = {g: torch.zeros(n, fout) for g, (_, fout) in shapes.items()}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        batch = engine.runner.lora_batch(chunks).to_device()  # per-step metadata included
        for layer in range(engine.model.cfg.num_layers):
            for g in GROUPS:
                batch.apply(layer, g, xs[g], outs[g])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peft_mixed_tokens_per_s(base: Path, adapters: list[tuple[str, Path]], prompts, steps: int) -> float:
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    name0, path0 = adapters[0]
    model = peft.PeftModel.from_pretrained(model, path0, adapter_name=name0)
    for name, path in adapters[1:]:
        model.load_adapter(path, adapter_name=name)
    model.eval()
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 1,
                             min_new_tokens=steps + 1, do_sample=False,
                             adapter_names=[n for n, _ in adapters[:len(prompts)]])
    seconds = time.perf_counter() - t0
    return (out.shape[1] - ids.shape[1]) * len(prompts) / seconds


def run_lora_decode(shape: str = "smol", batch: int = 32, ranks=(8, 16, 32, 64), steps: int = 16,
                    prompt_len: int = 16, rounds: int = 3, peft: bool = True, threads: int | None = None,
                    progress=None, quantize: str | None = None) -> dict:
    from lorafleet import Engine

    if threads:
        torch.set_num_threads(threads)
    check_cpu_fit(shape, quantize)
    base = build_base(shape)
    adapters = build_adapters(base, batch, ranks)
    engine = Engine(base, device="cpu", pool_bytes=4 << 30, quantize=quantize)
    for name, path in adapters:
        engine.load_adapter(name, path)
    vocab = engine.model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    configs = {
        "none": [None] * batch,
        "one": [adapters[0][0]] * batch,
        "distinct": [n for n, _ in adapters],
    }
    decode_step_time(engine, prompts[:4], [None] * 4, 2)  # warm-up
    samples: dict[str, list[float]] = {k: [] for k in configs}
    walls: dict[str, list[float]] = {k: [] for k in configs}
    for r in range(rounds):
        for k, ads in configs.items():
            step_s, wall = decode_step_time(engine, prompts, ads, steps)
            samples[k].append(step_s)
            walls[k].append(wall)
            if progress:
                progress(f"round {r + 1}/{rounds} {k}: decode step {step_s * 1e3:.1f} ms")
    step = {k: statistics.median(v) for k, v in samples.items()}
    bandwidth = measure_bandwidth()
    elem = engine.pool.tensor.element_size()
    distinct_bytes = sum(engine.adapters.get(n).numel * elem for n, _ in adapters)
    read_time = distinct_bytes / bandwidth
    added = step["distinct"] - step["none"]
    op_time = lora_op_time(engine, [n for n, _ in adapters])  # the "distinct" config's adapters
    result = {
        "benchmark": "lora-decode", "shape": shape, "batch": batch, "ranks": list(ranks), "quantization": quantize,
        "targets": "all 7 projections", "decode_steps": steps, "rounds": rounds,
        "threads": torch.get_num_threads(), "weight_bytes": engine.model.weight_bytes,
        "decode_step_ms": {k: v * 1e3 for k, v in step.items()},
        "tokens_per_s": {k: batch / v for k, v in step.items()},
        "one_vs_none_throughput": step["none"] / step["one"],
        "distinct_adapter_bytes": distinct_bytes,
        "bandwidth_gb_s": bandwidth / 1e9,
        "adapter_read_ms": read_time * 1e3,
        "lora_added_ms": added * 1e3,
        # 1.0 = LoRA costs exactly one read of its weights. Two estimates: the step-time
        # difference (noisy: a small difference of two large numbers) and the LoRA op timed alone.
        "lora_efficiency_step_diff": added / read_time,
        "lora_op_ms": op_time * 1e3,
        "lora_efficiency": op_time / read_time,
        "targets_met": {"one_vs_none>=0.9": step["none"] / step["one"] >= 0.9,
                        "efficiency<=1.5": op_time / read_time <= 1.5},
    }
    distinct_tps = batch * (steps + 1) / statistics.median(walls["distinct"])
    result["distinct_end_to_end_tokens_per_s"] = distinct_tps
    if peft and quantize:
        result["peft_mixed_skipped"] = f"PEFT would run the fp32 base, not the {quantize} one"
    elif peft:
        try:
            peft_tps = peft_mixed_tokens_per_s(base, adapters, prompts, steps)
            result["peft_mixed_tokens_per_s"] = peft_tps
            result["lorafleet_vs_peft_mixed"] = distinct_tps / peft_tps
        except ImportError as e:
            result["peft_mixed_skipped"] = f"peft/transformers not installed ({e.name})"
    return result
