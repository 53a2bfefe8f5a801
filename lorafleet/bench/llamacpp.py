"""llama.cpp as a system of `lorafleet bench` (`llama.cpp`): `llama-server` on the same random
model and PEFT adapters, converted to GGUF, the workload's requests replayed over HTTP as for
the daemon system. The base is f32, or with `--quantize` (`job.quantize`) the same model as Q8_0
(int8) or Q4_0 (int4, every tensor: `llamacpp_convert.quantize_command`); adapters stay f32.
A server that a signal ends while it warms up on a quantized model (AMX tiles that fault on
some hosts) is started again with `--no-repack`, and the run's `details.fallback` says so.

The server comes from `llamacpp_build.py` and the GGUF files from `llamacpp_convert.py` (built
and converted once, cached outside the repository; what cannot be had is the reason the system
is skipped).

Serving. llama-server on a free localhost port with the base, every adapter of the job and the
warm-up adapter (`--lora` each, and `--lora-init-without-apply`), `-np` = the requests in flight
(the workload's concurrency, else all its requests), `-c` room for each slot's longest request
(rounded up to 256 tokens), `-t`/`-tb` = the bench's threads, an f32 KV cache, no prompt cache
(each replay meets its prompts for the first time, as with the lorafleet systems). Each request is a streaming `POST
/completion`: the prompt as token ids, `n_predict` its length with `ignore_eos` (llama.cpp keeps
end-of-generation tokens from being sampled, where lorafleet samples them and goes on: the same
length, but greedy outputs part where lorafleet picks `</s>`), greedy (`temperature` 0, `top_k`
1, no repetition penalty), and `lora` naming every adapter the server loaded, at scale 1.0 for
the request's and 0.0 for the others; a base request names them all at 0.0. Not `"lora": []`:
this server reads an empty list as "its defaults", every adapter at 1.0, whatever
`--lora-init-without-apply` says (a test pins this). llama.cpp leaves adapters at 0.0 out of
the graph, and batches a request only with others on the same adapters and scales. Scale 1.0
is PEFT's scaling: the GGUF adapter carries PEFT's `lora_alpha`, and llama.cpp scales by alpha
/ rank.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from lorafleet.bench import http_replay
from lorafleet.bench.jobs import WARM_UP_PROMPT, Job, Replayed, System
from lorafleet.bench.llamacpp_build import SDIST_NAME, SDIST_VERSION, LlamaCppUnavailable, server_binary
from lorafleet.bench.llamacpp_convert import GGUF_TYPES, bench_gguf, convert_adapter

START_TIMEOUT_S = 300     # llama-server loading the model and adapters
CTX_ROUND = 256           # each slot's context, rounded up to this (llama.cpp pads to it)
SILENCE_TIMEOUT_S = 600   # a request whose stream says nothing for this long has failed
STOP_TIMEOUT_S = 30


class LlamaCpp(System):
    name = "llama.cpp"
    baseline = False     # serves every request of the workload
    closed_loop = True
    quantizable = True   # `job.quantize`: the same base as Q8_0 (int8) or Q4_0 (int4)
    proc = None          # llama-server, once prepare started it

    def skip_reason(self, job: Job) -> str | None:
        """CPU and f32 only, adapters loaded before the clock only; then the server and the GGUF
        files, built or converted on first use: what cannot be had is the reason."""
        import torch

        device, dtype = self._setup()
        if device.type != "cpu":
            return f"built for the CPU only; this run is on {device}"
        if dtype != torch.float32:
            return f"the GGUF files (and the KV cache) are f32; this run is in {dtype}"
        if job.residency != "loaded":
            return "llama-server loads every adapter at its start: it cannot start with adapters on disk"
        try:
            self.binary = server_binary()
            self.model_gguf = bench_gguf(Path(job.model_dir), job.quantize, threads=self.threads)
            self.adapter_ggufs = {name: convert_adapter(Path(job.model_dir), Path(path))
                                  for name, path in job.adapters.items()}
            self.warm_up_gguf = (convert_adapter(Path(job.model_dir), Path(job.warm_up_adapter))
                                 if job.warm_up_adapter else None)
        except LlamaCppUnavailable as e:
            return str(e)
        return None

    def prepare(self, job: Job) -> dict:
        import httpx

        slots = job.concurrency or len(job.requests)
        longest = max([len(WARM_UP_PROMPT) + 4, *(len(r.prompt) + r.max_tokens for r in job.requests)])
        per_slot = -(-(longest + 1) // CTX_ROUND) * CTX_ROUND
        loras = [*self.adapter_ggufs.values(), *([self.warm_up_gguf] if self.warm_up_gguf else [])]
        port = _free_port()
        cmd = [str(self.binary), "-m", str(self.model_gguf), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(slots), "-c", str(slots * per_slot), "-t", str(self.threads), "-tb", str(self.threads),
               "-ctk", "f32", "-ctv", "f32", "--no-cache-prompt", "--cache-ram", "0"]
        for path in loras:
            cmd += ["--lora", str(path)]
        if loras:
            cmd.append("--lora-init-without-apply")
        self.root = Path(tempfile.mkdtemp(prefix="lorafleet-bench-llamacpp-"))
        self.url = f"http://127.0.0.1:{port}"
        # no kept-alive connections for the few untimed calls: one the server closed after a 503
        # while loading would fail the next call on it
        self.http = httpx.Client(base_url=self.url, timeout=60, limits=httpx.Limits(max_keepalive_connections=0))
        fallback = None
        started = self._start(cmd)
        assert self.proc is not None  # _start started it
        if not started and job.quantize and self.proc.returncode is not None and self.proc.returncode < 0:
            # killed by a signal while it warmed up: on a host whose AMX tiles fault (ldtilecfg in
            # ggml_backend_amx_mul_mat), a quantized model dies so; without the extra buffer types
            # (AMX and the repacked layouts) it runs, slower than a sound llama.cpp would
            fallback = (f"llama-server died by signal {-self.proc.returncode} on the "
                        f"{GGUF_TYPES.get(job.quantize, job.quantize)} model; "
                        "run with --no-repack (no AMX, no repacked layouts: slower than it could be)")
            cmd.append("--no-repack")
            self.log.close()
            if not self._start(cmd):
                raise RuntimeError(f"llama-server did not start, with --no-repack either: {self._log_tail()}")
        elif self.proc.poll() is not None or not self.started:
            raise RuntimeError(f"llama-server did not start: {self._log_tail()}")
        self.fallback = fallback
        ids = {Path(a["path"]).resolve(): a["id"] for a in self.http.get("/lora-adapters").raise_for_status().json()}
        missing = [p for p in loras if p.resolve() not in ids]
        if missing:
            raise RuntimeError(f"llama-server did not list the adapters {missing} (it lists {sorted(ids)})")
        self.lora_ids: dict[str, int] = {name: ids[path.resolve()] for name, path in self.adapter_ggufs.items()}
        self.warm_up_id: int | None = ids[self.warm_up_gguf.resolve()] if self.warm_up_gguf else None
        self.all_ids: list[int] = sorted(ids.values())
        return {"server": str(self.binary), "command": cmd, "slots": slots, "ctx_per_slot": per_slot,
                "fallback": self.fallback,
                "model_gguf": str(self.model_gguf), "model_gguf_type": GGUF_TYPES.get(job.quantize, job.quantize),
                "sdist": f"{SDIST_NAME}=={SDIST_VERSION}"}

    def _start(self, cmd: list[str]) -> bool:
        """llama-server started with `cmd`; whether it answered /health in time (False: it exited
        first, or the time ran out; `self.proc` says which)."""
        import httpx

        self.log = open(self.root / "llama-server.log", "wb")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        self.started = False
        while True:
            try:
                if self.http.get("/health").status_code == 200:
                    self.started = True
                    return True
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.2)

    def warm_up(self, job: Job) -> dict:
        """A small completion on the base and one on the warm-up adapter (none of the workload's)."""
        t0 = time.perf_counter()
        ids = [None, *([self.warm_up_id] if self.warm_up_id is not None else [])]
        for lora in ids:
            body = request_body(WARM_UP_PROMPT, 4, lora, self.all_ids)
            self.http.post("/completion", json={**body, "stream": False}).raise_for_status()
        return {"requests": len(ids), "adapter_loaded": self.warm_up_id is not None,
                "seconds": time.perf_counter() - t0}

    def replay(self, job: Job) -> Replayed:
        seconds, metrics = asyncio.run(_replay(self.url, job, self.lora_ids, self.all_ids))
        return Replayed(seconds, sum(m["tokens"] for m in metrics), metrics)

    def pids(self) -> tuple[int, ...]:
        assert self.proc is not None  # prepare started it
        return (self.proc.pid,)

    def close(self) -> None:
        if self.proc is None:
            return
        self.http.close()
        http_replay.stop_server(self.proc, STOP_TIMEOUT_S)
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def _log_tail(self) -> str:
        self.log.flush()
        return (self.root / "llama-server.log").read_text(errors="replace")[-800:]


def request_body(prompt: list[int], max_tokens: int, lora: int | None, lora_ids: list[int]) -> dict:
    """A `/completion` body: greedy, forced to `max_tokens`, token ids in and out, no prompt
    cache, and every adapter the server loaded (`lora_ids`) named with its scale: 1.0 for the
    request's adapter, 0.0 for the others (none applied: the base). An empty list would not be
    the base: the server would apply its defaults, every adapter at 1.0."""
    return {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
            "repeat_penalty": 1.0, "cache_prompt": False, "return_tokens": True, "stream": True,
            "lora": [{"id": i, "scale": 1.0 if i == lora else 0.0} for i in lora_ids]}


async def _replay(url: str, job: Job, lora_ids: dict[str, int], all_ids: list[int]) -> tuple[float, list[dict]]:
    # a connection per request (localhost TCP: cheap), never one the server may have closed
    async with http_replay.session(url, len(job.requests) + 1, fresh_connections=True,
                                   silence_s=SILENCE_TIMEOUT_S) as http:
        async def send(req, client, sent_at: float) -> dict:
            lora = None if req.adapter is None else lora_ids[req.adapter]
            return await _one(client, req, request_body(req.prompt, req.max_tokens, lora, all_ids), sent_at)
        return await http_replay.replay(http, job.requests, job.concurrency, send)


async def _one(http, req, body: dict, sent_at: float) -> dict:
    first = last = stop = None
    out: list[int] = []
    async for chunk in http_replay.events(http, "/completion", body):
        if "error" in chunk:
            raise RuntimeError(f"llama-server failed a request: {chunk['error']}")
        if chunk["tokens"]:
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            out += chunk["tokens"]
        if chunk["stop"]:
            stop = chunk["stop_type"]
    if len(out) != req.max_tokens:
        raise RuntimeError(f"llama-server answered {len(out)} of {req.max_tokens} tokens (stop: {stop})")
    return http_replay.figures(req, sent_at, first, last, len(out), output_ids=out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
