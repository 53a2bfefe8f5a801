"""Systems under test. Each is a small class with one method, `run(model_dir, requests) ->
Result`, that serves the same requests (prompt token ids, max_tokens) greedily, with every
output forced to its full length, and times only the serving: model loading and one tiny
warm-up generation happen before the clock starts.

Both systems run on the same device, dtype and number of torch threads.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from lorafleet.bench.workloads import FIRST_ORDINARY_ID as FIRST_ID

Requests = list[tuple[list[int], int]]


@dataclass
class Result:
    """One system's run of one workload. `generated_tokens` counts only tokens a request asked
    for; `status` is "ok", "skipped" (the system is not installed) or "error"."""

    system: str
    status: str = "ok"
    num_requests: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    reason: str = ""
    details: dict = field(default_factory=dict)


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class System:
    name = "system"

    def __init__(self, device: str = "auto", dtype: str = "auto", threads: int | None = None):
        self.device_name = device
        self.dtype_name = dtype
        self.threads = threads or default_threads()

    def _setup(self):
        """Set the thread count; return (torch.device, torch.dtype)."""
        import torch

        torch.set_num_threads(self.threads)
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                              if self.device_name == "auto" else self.device_name)
        if self.dtype_name == "auto":  # fp32 on CPUs (their bf16 matmuls are slow), bf16 on GPUs
            dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        else:
            dtype = getattr(torch, self.dtype_name)
        return device, dtype

    def run(self, model_dir: Path, requests: Requests) -> Result:
        raise NotImplementedError


class LorafleetInProcess(System):
    """One `lorafleet.Engine`; every request is added at once and the engine steps until all
    finish (continuous batching). On the CPU the page pool is sized to hold the whole workload,
    so no request is preempted; on a GPU it takes the engine's default."""

    name = "lorafleet"

    def __init__(self, *args, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens

    def run(self, model_dir: Path, requests: Requests) -> Result:
        from lorafleet import Engine, SamplingParams

        device, dtype = self._setup()
        pool_bytes = None if device.type == "cuda" else workload_pool_bytes(model_dir, requests, dtype.itemsize)
        engine = Engine(model_dir, device=str(device), dtype=str(dtype).removeprefix("torch."),
                        pool_bytes=pool_bytes, max_num_seqs=self.max_num_seqs,
                        max_num_batched_tokens=self.max_num_batched_tokens)
        engine.generate([[FIRST_ID, FIRST_ID + 1, FIRST_ID + 2]],
                        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        warm = engine.stats()

        _sync(device)
        start = time.perf_counter()
        for prompt, max_tokens in requests:
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        generated = 0
        while engine.has_unfinished():
            for out in engine.step():
                generated += len(out.new_token_ids)
        _sync(device)
        seconds = time.perf_counter() - start

        stats = engine.stats()
        return Result(self.name, num_requests=len(requests), generated_tokens=generated, seconds=seconds,
                      details={"device": str(device), "dtype": str(dtype), "threads": self.threads,
                               "pool_bytes": engine.pool.num_pages * engine.pool.page_bytes,
                               "num_steps": stats["num_steps"] - warm["num_steps"],
                               "num_preemptions": stats["num_preemptions"] - warm["num_preemptions"],
                               "step_time_p50_s": stats["step_time_s"]["p50"],
                               "ttft_p50_s": stats["ttft_s"]["p50"], "tpot_p50_s": stats["tpot_s"]["p50"]})


class TransformersGenerate(System):
    """Hugging Face transformers' `model.generate`, in static batches of `batch_size` requests
    in arrival order, left-padded with an attention mask, greedy.

    A static batch runs until its longest member is done, so every batch generates
    `max_tokens` of its longest request for each of its rows; only the tokens each request
    asked for count as useful `generated_tokens` (all of them are in `details["computed_tokens"]`).
    """

    name = "transformers"

    def __init__(self, *args, batch_size: int = 16, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch_size = batch_size

    def run(self, model_dir: Path, requests: Requests) -> Result:
        try:
            import transformers
        except ImportError:
            return Result(self.name, status="skipped",
                          reason="transformers is not installed (pip install 'lorafleet[bench]')")
        import torch

        transformers.logging.set_verbosity_error()
        device, dtype = self._setup()
        dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **{dtype_kw: dtype}).to(device).eval()
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

        def generate(batch: Requests) -> int:
            new = max(n for _, n in batch)
            width = max(len(p) for p, _ in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (prompt, _) in enumerate(batch):
                ids[row, width - len(prompt):] = torch.tensor(prompt)
                mask[row, width - len(prompt):] = 1
            with torch.inference_mode():
                out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                     max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                     pad_token_id=pad)
            return (out.shape[1] - width) * len(batch)

        generate([([FIRST_ID, FIRST_ID + 1, FIRST_ID + 2], 2)])  # warm-up

        _sync(device)
        start = time.perf_counter()
        computed = 0
        for i in range(0, len(requests), self.batch_size):
            computed += generate(requests[i:i + self.batch_size])
        _sync(device)
        seconds = time.perf_counter() - start

        return Result(self.name, num_requests=len(requests),
                      generated_tokens=sum(n for _, n in requests), seconds=seconds,
                      details={"device": str(device), "dtype": str(dtype), "threads": self.threads,
                               "batch_size": self.batch_size, "computed_tokens": computed,
                               "transformers": transformers.__version__})


SYSTEMS: dict[str, type[System]] = {cls.name: cls for cls in (LorafleetInProcess, TransformersGenerate)}


def workload_pool_bytes(model_dir: Path, requests: Requests, itemsize: int, block_size: int = 16) -> int:
    """Bytes of KV pages for every request at its full length at once, plus a little room."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    page_bytes = cfg["num_hidden_layers"] * 2 * block_size * kv_heads * head_dim * itemsize
    pages = sum(math.ceil((len(p) + n) / block_size) for p, n in requests) + 8
    return max(pages * page_bytes, 64 << 20)


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
