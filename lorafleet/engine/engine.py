"""Engine: the one loop. The daemon, `lorafleet.Engine` users, benchmarks and tests all drive
`step()`; `generate()` is a convenience that adds requests and steps until they finish.

Not thread-safe: one thread owns an Engine (the daemon runs it on its own thread and passes
requests in through a queue).
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Sequence

import torch

from lorafleet.config import DEFAULT_CPU_POOL_BYTES, EngineConfig
from lorafleet.engine.request import Request, RequestOutput, SamplingParams, Status
from lorafleet.engine.policy import POLICIES
from lorafleet.engine.runner import ModelRunner
from lorafleet.engine.scheduler import Scheduler
from lorafleet.engine.stats import EngineStats
from lorafleet.errors import ConfigError, InvalidRequestError, RequestNotFoundError
from lorafleet.memory.kv import KVCacheManager, kv_page_elems
from lorafleet.lora.adapter import BaseShapes
from lorafleet.memory.pool import PagePool
from lorafleet.memory.prefetch import Prefetcher, load_now
from lorafleet.memory.residency import AdapterResidency
from lorafleet.model.loader import load_model
from lorafleet.model.sampler import sample
from lorafleet.model.tokenizer import Tokenizer

Prompt = str | Sequence[int]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for, but torch sees no CUDA device")
    return torch.device(name)


class Engine:
    def __init__(self, model: str | Path, **options):
        self.config = cfg = EngineConfig.from_kwargs(**options)
        self.device = resolve_device(cfg.device)
        self.model_path = Path(model)
        self.model = load_model(self.model_path, self.device, cfg.dtype)
        mc = self.model.cfg
        self.max_model_len = min(cfg.max_model_len or mc.max_model_len, mc.max_model_len)
        self.model.cos, self.model.sin = self.model.cos[:self.max_model_len], self.model.sin[:self.max_model_len]
        self.tokenizer = (Tokenizer.from_pretrained(self.model_path)
                          if (self.model_path / "tokenizer.json").is_file() else None)
        self.eos_token_ids = frozenset(mc.eos_token_ids) | (self.tokenizer.eos_token_ids if self.tokenizer else frozenset())

        page_elems = kv_page_elems(mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim)
        page_bytes = page_elems * self.model.dtype.itemsize
        num_pages = self._pool_bytes() // page_bytes
        if num_pages < 1:
            raise ConfigError(f"pool_bytes={cfg.pool_bytes} holds no page ({page_bytes} bytes each)")
        self.pool = PagePool(num_pages, page_elems, self.model.dtype, self.device)
        self.kv = KVCacheManager(self.pool, mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim)
        self.adapters = AdapterResidency(self.pool, BaseShapes.from_model_config(mc), cfg.host_cache_bytes,
                                         cfg.min_resident_steps)
        self.prefetcher = Prefetcher(self.adapters, cfg.prefetch_workers)
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   residency=self.adapters, policy=POLICIES[cfg.policy]())
        self.runner = ModelRunner(self.model, self.kv)
        self.requests: dict[str, Request] = {}
        self.counters = EngineStats()
        self._ids = itertools.count()
        self._generator = torch.Generator(device=self.device).manual_seed(cfg.seed)

    def _pool_bytes(self) -> int:
        if self.config.pool_bytes is not None:
            return self.config.pool_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.85)
        return DEFAULT_CPU_POOL_BYTES

    # -- requests ----------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    adapter: str | None = None, request_id: str | None = None,
                    deadline_s: float | None = None) -> str:
        """Queue one request; returns its id. Raises InvalidRequestError on bad input,
        AdapterNotFoundError for an unregistered adapter. A request for an adapter that is not
        on the device starts its load at once. `deadline_s`: abort it (finish_reason
        "deadline") if it has not finished that many seconds after arrival."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self._prompt_ids(prompt)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"prompt has {len(ids)} tokens; the context holds "
                                      f"{self.max_model_len} (prompt + at least one new token)")
        if self.kv.blocks_needed(len(ids) + 1) > self.pool.num_pages:
            raise InvalidRequestError(f"prompt has {len(ids)} tokens; the page pool holds only "
                                      f"{self.pool.num_pages * self.kv.block_size} (raise pool_bytes)")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        if deadline_s is not None and not (isinstance(deadline_s, (int, float)) and deadline_s > 0):
            raise InvalidRequestError(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
        req = Request(rid, ids, params, adapter)
        if deadline_s is not None:
            req.deadline = req.arrival_time + deadline_s
        if adapter is not None:
            entry = self.adapters.get(adapter)  # AdapterNotFoundError
            entry.users += 1                    # released at finish/abort
            req.holds_adapter = True
            if entry.ready:
                entry.hits += 1
            else:
                entry.misses += 1
                entry.error = None  # a new request retries a load that failed before
                wanted = set(self.scheduler.wanted_adapters()) | {adapter}
                self.prefetcher.want(entry, wanted, self.scheduler.watermark_pages)  # starts now
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if self.tokenizer is not None:
            req.detokenizer = self.tokenizer.incremental_decoder(context_ids=ids)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(f"{self.model_path} has no tokenizer.json: pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise InvalidRequestError("prompt must be a string or a list of token ids") from None
            if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
                raise InvalidRequestError("prompt token ids must be integers")
        if not ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.model.cfg.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            raise RequestNotFoundError(f"no unfinished request {request_id!r}")
        self.scheduler.finish(req)
        self._release(req)
        req.finish_reason = "abort"
        self.counters.num_requests_aborted += 1

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return an output for every request that produced a token
        or finished in this step."""
        t0 = time.perf_counter()
        tick = self.prefetcher.tick(self.scheduler.wanted_adapters(), self.scheduler.watermark_pages)
        outputs = self._fail_adapter_requests(tick.failed) if tick.failed else []
        outputs += self._expire_deadlines()
        self.adapters.step += 1
        plan = self.scheduler.schedule()
        outputs += [self._finish(req) for req in plan.finished]
        if not plan.chunks and self.prefetcher.busy:
            self.prefetcher.wait_any(0.005)  # nothing runnable until a load lands: don't spin
        if plan.chunks:
            chunks = self.runner.order(plan.chunks)
            sampling = [c for c in chunks if c.samples]
            logits = self.runner.execute(chunks, self.runner.lora_batch(chunks, self.adapters))
            reqs = [c.request for c in sampling]
            tokens, lps = sample(logits, [r.params for r in reqs],
                                 [r.generator or self._generator for r in reqs])
            prompt_tokens = sum(c.num_tokens for c in chunks if not (c.samples and c.num_tokens == 1))
            for c in chunks:
                c.request.num_computed += c.num_tokens
            outputs += [self._append(r, t, lp) for r, t, lp in zip(reqs, tokens, lps)]
            self.counters.record_step(time.perf_counter() - t0, len(chunks), prompt_tokens, len(reqs),
                                      distinct_adapters=len({c.request.adapter for c in chunks}),
                                      adapters_loaded=len(tick.loaded))
        self.counters.num_preemptions += len(plan.preempted)
        if self.config.debug_checks:
            self.check_integrity()
        return outputs

    def _fail_adapter_requests(self, failed: dict[str, str]) -> list[RequestOutput]:
        """A load failed: only the waiting requests for that adapter end, with its message."""
        outputs = []
        for req in [r for r in self.scheduler.waiting if r.adapter in failed]:
            req.finish_reason = "error"
            req.error = f"adapter {req.adapter!r} could not be loaded: {failed[req.adapter]}"
            outputs.append(self._finish(req))
        return outputs

    def _expire_deadlines(self) -> list[RequestOutput]:
        now = time.monotonic()
        expired = [r for r in self.requests.values() if r.deadline is not None and now > r.deadline]
        for req in expired:
            req.finish_reason = "deadline"
        return [self._finish(req) for req in expired]

    def _append(self, req: Request, token: int, logprobs: dict | None) -> RequestOutput:
        now = time.monotonic()
        req.output_token_ids.append(token)
        if logprobs is not None:
            req.logprobs.append(logprobs)
        if req.first_token_time is None:
            req.first_token_time = now
        old_text = req.text
        if req.detokenizer is not None:
            req.text += req.detokenizer.step(token)
        p = req.params
        if (token in p.stop_token_ids) or (not p.ignore_eos and token in self.eos_token_ids):
            req.finish_reason = "stop"
        elif p.stop and self._stop_string(req, len(old_text)):
            req.finish_reason = "stop"
        elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            req.finish_reason = "length"
        emitted = len(old_text) if not p.stop else req.emitted
        if req.finish_reason is not None:
            if req.detokenizer is not None and not (p.stop and req.finish_reason == "stop"):
                req.text += req.detokenizer.flush()
            return self._finish(req, [token], emitted)
        if p.stop:  # hold back what could still become a stop string
            hold = max(len(s) for s in p.stop) - 1
            req.emitted = max(req.emitted, len(req.text) - hold)
            return self._output(req, [token], req.text[emitted:req.emitted])
        return self._output(req, [token], req.text[emitted:])

    @staticmethod
    def _stop_string(req: Request, new_from: int) -> bool:
        """Cut the text at the first stop string that the new text completes."""
        window_start = max(0, new_from - max(len(s) for s in req.params.stop) + 1)
        hits = [(i, s) for s in req.params.stop if (i := req.text.find(s, window_start)) >= 0]
        if not hits:
            return False
        i, s = min(hits)
        req.text = req.text[:i + len(s)] if req.params.include_stop_str_in_output else req.text[:i]
        return True

    def _finish(self, req: Request, new_tokens: list[int] | None = None, emitted: int | None = None) -> RequestOutput:
        req.finish_time = time.monotonic()
        if req.status is not Status.FINISHED:
            self.scheduler.finish(req)
        self._release(req)
        self.requests.pop(req.request_id, None)
        self.counters.record_finished(req)
        start = req.emitted if emitted is None else emitted
        return self._output(req, new_tokens or [], req.text[start:])

    def _release(self, req: Request) -> None:
        if req.holds_adapter:
            self.adapters.entries[req.adapter].users -= 1
            req.holds_adapter = False

    @staticmethod
    def _output(req: Request, new_tokens: list[int], new_text: str) -> RequestOutput:
        metrics = None
        if req.finish_reason is not None:
            metrics = {"arrival_s": req.arrival_time, "adapter_wait_s": req.adapter_wait,
                       "queue_s": (req.first_scheduled_time or req.finish_time) - req.arrival_time,
                       "ttft_s": req.first_token_time - req.arrival_time if req.first_token_time else None,
                       "e2e_s": req.finish_time - req.arrival_time,
                       "num_preemptions": req.num_preemptions}
            n = len(req.output_token_ids)
            metrics["tpot_s"] = (req.finish_time - req.first_token_time) / (n - 1) if n > 1 else None
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), text=req.text,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            finished=req.finish_reason is not None, finish_reason=req.finish_reason,
            adapter=req.adapter, new_token_ids=new_tokens, new_text=new_text,
            error=req.error, metrics=metrics)

    # -- adapters --------------------------------------------------------------------
    def register_adapter(self, name: str, path: str | Path) -> dict:
        """Record a PEFT adapter folder under `name` (disk tier): its config is checked now, its
        weights are read when a request first needs it. Costs no device memory."""
        return self.adapters.register(name, path).info()

    def load_adapter(self, name: str, path: str | Path) -> dict:
        """Validate a PEFT adapter folder and copy it into pool pages now (the eager form). A
        refused adapter (AdapterError naming the problem) changes nothing."""
        return load_now(self.prefetcher, name, path).info()

    def unload_adapter(self, name: str) -> None:
        """Forget the adapter and free its pages; AdapterInUseError while requests use it."""
        self.adapters.unregister(name)

    def list_adapters(self) -> list[dict]:
        return [e.info() for e in self.adapters.entries.values()]

    def lora_queues(self) -> dict[str, dict[str, int]]:
        """Requests per adapter, running and waiting (for vllm:lora_requests_info)."""
        out: dict[str, dict[str, int]] = {"running": {}, "waiting": {}}
        for where, reqs in (("running", self.scheduler.running), ("waiting", self.scheduler.waiting)):
            for r in reqs:
                if r.adapter is not None:
                    out[where][r.adapter] = out[where].get(r.adapter, 0) + 1
        return out

    def step_records(self) -> list[dict]:
        """One dict per recent step: time_s, num_seqs, num_tokens, distinct_adapters,
        adapters_loaded (switches: adapters that landed on the device for this step)."""
        return list(self.counters.steps)

    def close(self) -> None:
        self.prefetcher.shutdown()

    # -- conveniences ------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapters: Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Run `prompts` to completion, continuously batched together; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        n = len(prompts)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * n
        alist = list(adapters) if adapters is not None else [None] * n
        if len(plist) != n or len(alist) != n:
            raise InvalidRequestError(f"{n} prompts but {len(plist)} params and {len(alist)} adapters")
        ids = []
        try:
            for prompt, p, a in zip(prompts, plist, alist):
                ids.append(self.add_request(prompt, p, a))
        except Exception:
            for rid in ids:
                self.abort(rid)
            raise
        wanted, done = set(ids), {}
        while wanted - done.keys():
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        self.kv.check_integrity()
        self.adapters.check_integrity()
        users: dict[str, int] = {}
        pins: dict[str, int] = {}
        for r in self.requests.values():
            if r.adapter is not None:
                users[r.adapter] = users.get(r.adapter, 0) + 1
        for r in self.scheduler.running:
            if r.adapter is not None:
                pins[r.adapter] = pins.get(r.adapter, 0) + 1
        for name, entry in self.adapters.entries.items():
            assert entry.users == users.get(name, 0), f"adapter {name!r}: users count is off"
            assert entry.pins == pins.get(name, 0), f"adapter {name!r}: pin count is off"
        live = {r.request_id for r in self.scheduler.running}
        assert live <= set(self.kv.tables), "a running request has no block table"
        assert set(self.kv.tables) <= live, "pages held by a request that is not running"

    def stats(self) -> dict:
        pool = self.pool.stats()
        return {
            "model": str(self.model_path),
            "device": str(self.device),
            "max_model_len": self.max_model_len,
            "pool": pool,
            "adapters": self.adapters.stats(),
            "adapter_details": {e.name: e.info() for e in self.adapters.entries.values()},
            "scheduler": self.scheduler.policy.snapshot(),
            "kv_cache_usage": pool["kv_pages"] / pool["total_pages"],
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            **self.counters.snapshot(),
        }
