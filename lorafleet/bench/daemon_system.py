"""lorafleet through the daemon: `lorafleet serve` in a process of its own on a temporary Unix
socket, the workload's requests replayed at their arrival times as concurrent streaming
`/v1/completions` calls (httpx over the socket), TTFT and TPOT taken from the stream's token
timestamps. Same pool sizing as the in-process system, so the difference between the two is the
cost of the HTTP/SSE front end and the engine thread hand-off.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lorafleet.bench.systems import Job, Result, System, adapter_bytes, workload_pool_bytes
from lorafleet.bench.workloads import FIRST_ORDINARY_ID as FIRST_ID


class LorafleetDaemon(System):
    name = "lorafleet-daemon"
    subject = True
    baseline = False

    def run(self, job: Job) -> Result:
        from lorafleet.client import Client

        device, dtype = self._setup()
        root = Path(tempfile.mkdtemp(prefix="lorafleet-bench-"))
        sock = root / "run" / "d.sock"
        weights, fraction = adapter_bytes(job.adapters), job.pool_fraction
        if fraction is not None:
            pool = workload_pool_bytes(Path(job.model_dir), job.requests, dtype.itemsize,
                                       int(weights * fraction), math.ceil(len(job.adapters) * fraction), floor=False)
        else:
            pool = workload_pool_bytes(Path(job.model_dir), job.requests, dtype.itemsize, weights, len(job.adapters))
        cmd = [sys.executable, "-m", "lorafleet.cli.main", "serve", job.model_dir, "--socket", str(sock),
               "--device", str(device), "--dtype", str(dtype).removeprefix("torch."),
               "--pool-bytes", str(pool), "--max-num-seqs", "256", "--max-pending", "100000"]
        env = {**os.environ, "LORAFLEET_HOME": str(root / "home"), "OMP_NUM_THREADS": str(self.threads)}
        log = open(root / "daemon.log", "wb")
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            client = Client(sock)
            deadline = time.monotonic() + 300
            while True:
                try:
                    client.health()
                    break
                except Exception:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the daemon did not start: {(root / 'daemon.log').read_text()[-500:]}")
                    time.sleep(0.2)
            for name, path in job.adapters.items():
                client.load_adapter(name, path, lazy=job.residency == "registered")
            client.completion([FIRST_ID, FIRST_ID + 1, FIRST_ID + 2], max_tokens=2, temperature=0.0,
                              ignore_eos=True)  # warm-up
            seconds, metrics = asyncio.run(_replay(sock, job.requests))
            stats = client.stats()
            client.close()
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
            shutil.rmtree(root, ignore_errors=True)
        generated = sum(m["tokens"] for m in metrics)
        details = {"device": str(device), "dtype": str(dtype), "pool_bytes": pool, "residency": job.residency,
                   "daemon_stats": {k: v for k, v in stats.get("engine", stats).items()
                                    if isinstance(v, (int, float, str))}}
        return Result(self.name, num_requests=len(job.requests), generated_tokens=generated,
                      seconds=seconds, details=details, requests=metrics)


async def _replay(sock: Path, requests) -> tuple[float, list[dict]]:
    import httpx

    transport = httpx.AsyncHTTPTransport(uds=str(sock))
    limits = httpx.Limits(max_connections=len(requests) + 1)
    async with httpx.AsyncClient(transport=transport, base_url="http://lorafleet", timeout=None,
                                 limits=limits) as http:
        start = time.perf_counter()
        metrics = await asyncio.gather(*(_one(http, r, start) for r in requests))
        return time.perf_counter() - start, list(metrics)


async def _one(http, req, start: float) -> dict:
    await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
    arrival = start + req.arrival_s
    body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if req.adapter is not None:
        body["model"] = req.adapter
    first = last = None
    tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
    return {"arrival_s": req.arrival_s, "ttft_s": first - arrival if first is not None else None,
            "tpot_s": (last - first) / (tokens - 1) if tokens > 1 else None,
            "queue_s": None, "adapter_wait_s": None, "tokens": tokens, "adapter": req.adapter}
