"""lorafleet through the daemon: `lorafleet serve` in a process of its own on a temporary Unix
socket, the workload's requests replayed at their arrival times as concurrent streaming
`/v1/completions` calls (aiohttp over the socket; a workload's closed loop honoured:
`http_replay.py`), TTFT and TPOT taken from the stream's token timestamps. Same pool sizing as
the in-process system, so the difference between the two is the cost of the HTTP/SSE front end
and the engine thread hand-off. A request on one adapter names it as `model`; one that mixes
adapters names them, with their scales, in `adapters` (the base's name left out), as a client does.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lorafleet.bench import http_replay
from lorafleet.bench.jobs import WARM_UP_ADAPTER, WARM_UP_PROMPT, Job, Replayed, System, job_pool_bytes


class LorafleetDaemon(System):
    name = "lorafleet-daemon"
    subject = True
    baseline = False
    closed_loop = True
    quantizable = True
    mixes = True  # the request body's `adapters`
    proc = None  # the daemon, once prepare started it

    def prepare(self, job: Job) -> dict:
        from lorafleet.client import Client

        self.root = Path(tempfile.mkdtemp(prefix="lorafleet-bench-"))
        self.sock = self.root / "run" / "d.sock"
        pool = job_pool_bytes(job, self.dtype.itemsize)
        cmd = serve_command(job, self.sock, str(self.device), str(self.dtype).removeprefix("torch."), pool)
        env = {**os.environ, "LORAFLEET_HOME": str(self.root / "home"), "OMP_NUM_THREADS": str(self.threads)}
        self.log = open(self.root / "daemon.log", "wb")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env)
        self.client = Client(self.sock)
        deadline = time.monotonic() + 300
        while True:
            try:
                self.client.health()
                break
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the daemon did not start: {(self.root / 'daemon.log').read_text()[-500:]}")
                time.sleep(0.2)
        for name, path in job.adapters.items():
            self.client.load_adapter(name, _adapter_file(job, path), lazy=job.residency == "registered")
        return {"pool_bytes": pool, "residency": job.residency, "command": cmd[1:], "quantization": job.quantize}

    def warm_up(self, job: Job) -> dict:
        """Through the socket: one adapter loaded (not one of the workload's), a completion on
        it and one on the base; the daemon's engine loads its kernels on the way."""
        t0 = time.perf_counter()
        if job.warm_up_adapter:
            self.client.load_adapter(WARM_UP_ADAPTER, job.warm_up_adapter)
        for model in dict.fromkeys([WARM_UP_ADAPTER if job.warm_up_adapter else None, None]):
            self.client.completion(WARM_UP_PROMPT, model=model, max_tokens=4, temperature=0.0, ignore_eos=True)
        if job.warm_up_adapter:
            self.client.unload_adapter(WARM_UP_ADAPTER)
        return {"requests": 2 if job.warm_up_adapter else 1, "adapter_loaded": bool(job.warm_up_adapter),
                "seconds": time.perf_counter() - t0}

    def replay(self, job: Job) -> Replayed:
        self.client.reset_prefix_cache()  # every replay meets its prompts for the first time
        seconds, metrics = asyncio.run(_replay(self.sock, job))
        return Replayed(seconds, sum(m["tokens"] for m in metrics), metrics)

    def pids(self) -> tuple[int, ...]:
        assert self.proc is not None  # prepare started it
        return (self.proc.pid,)

    def finish(self, job: Job) -> dict:
        stats = self.client.stats()
        return {"daemon_stats": {k: v for k, v in stats["engine"].items()
                                 if isinstance(v, (int, float, str))}}

    def close(self) -> None:
        if self.proc is None:
            return
        self.client.close()
        http_replay.stop_server(self.proc, 60)
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _file_type(job: Job) -> bool:
    from lorafleet.bench.llamacpp_convert import FILE_TYPES

    return job.quantize in FILE_TYPES


def _adapter_file(job: Job, path) -> str:
    """An adapter as the daemon loads it: the PEFT folder; with a GGUF file type (`bench llama-cpp
    --quantize Q4_K_M`), the GGUF adapter llama-server is given too."""
    if not _file_type(job):
        return str(path)
    from lorafleet.bench.llamacpp_convert import convert_adapter

    return str(convert_adapter(Path(job.model_dir), Path(path)))


def serve_command(job: Job, sock: Path, device: str, dtype: str, pool: int) -> list[str]:
    """`lorafleet serve` for the job's base: this Python, the bench's device, dtype and pool, and
    the job's `--quantize` (the base quantized as it loads; a GGUF file type: the file llama-quantize
    wrote, which llama-server is given too). No self-check: it would hold a second copy of the
    weights, which the bench's large random bases may not have room for."""
    model = job.model_dir
    if _file_type(job):
        from lorafleet.bench.llamacpp_convert import bench_gguf

        model = str(bench_gguf(Path(job.model_dir), job.quantize))
    return [sys.executable, "-P", "-m", "lorafleet.cli.main", "serve", model, "--socket", str(sock),
            "--device", device, "--dtype", dtype, "--pool-bytes", str(pool), "--max-num-seqs", "256",
            "--max-pending", "100000", "--no-self-check",
            *(["--quantize", job.quantize] if job.quantize and not _file_type(job) else []),
            *(["--lora-dtype", job.lora_dtype] if job.lora_dtype != "auto" else []),
            *(["--quantized-prefill", job.quantized_prefill] if job.quantized_prefill != "float32" else [])]


async def _replay(sock: Path, job: Job) -> tuple[float, list[dict]]:
    async with http_replay.session("http://lorafleet", len(job.requests) + 1, uds=str(sock)) as http:
        return await http_replay.replay(http, job.requests, job.concurrency, _one)


async def _one(req, http, sent_at: float) -> dict:
    body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if req.adapter is not None:
        body["model"] = req.adapter
    elif req.mix:
        body["adapters"] = [{"name": n, "scale": s} for n, s in req.mix]
    first = last = None
    tokens = 0
    async for chunk in http_replay.events(http, "/v1/completions", body):
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if chunk.get("choices"):
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
    return http_replay.figures(req, sent_at, first, last, tokens)
