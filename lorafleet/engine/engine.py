"""Engine: the one loop. The daemon, `lorafleet.Engine` users, benchmarks and tests all drive
`step()`; `generate()` is a convenience that adds requests and steps until they finish.

Not thread-safe: one thread owns an Engine (the daemon runs it on its own thread and passes
requests in through a queue).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Sequence, cast

import torch

from lorafleet.config import EngineConfig, pool_bytes_for
from lorafleet.engine.graphs import DecodeGraphs
from lorafleet.engine.mixes import MixChecks
from lorafleet.engine.output import OutputProcessor
from lorafleet.engine.request import Request, RequestOutput, SamplingParams, Status, prompt_ids
from lorafleet.engine.policy import POLICIES
from lorafleet.engine.runner import Launched, ModelRunner
from lorafleet.engine.scheduler import Scheduler
from lorafleet.engine.selfcheck import self_check
from lorafleet.engine.stats import Counters
from lorafleet.engine import offline, views
from lorafleet.errors import (AdapterError, ConfigError, InvalidRequestError, RequestFailedError,
                              RequestNotFoundError)
from lorafleet.memory.kv import KVCacheManager, kv_page_elems
from lorafleet.adapters.adapter import BaseShapes
from lorafleet.adapters.mix import Mix
from lorafleet.memory.arbiter import Arbiter
from lorafleet.memory.entry import Inspected
from lorafleet.memory.eviction import EvictionOrder
from lorafleet.adapters.layout import page_problem
from lorafleet.memory.pool import PagePool, lora_dtype
from lorafleet.memory.prefetch import Prefetcher
from lorafleet.memory.residency import AdapterResidency
from lorafleet.model.grammar import Constraint, Grammar, compile as compile_grammar, matcher_for
from lorafleet.model.loader import load_model, resolve_device
from lorafleet.model.tokenizer import Tokenizer
from lorafleet.snapshot import AdapterInfo, EngineStats, LoraCapacity, LoraQueues

Prompt = str | Sequence[int]
log = logging.getLogger("lorafleet.engine")


class Engine:
    def __init__(self, model: str | Path, **options):
        self.config = cfg = EngineConfig.from_kwargs(**options)
        self.device = resolve_device(cfg.device)
        self.model_path = Path(model)
        self.model = load_model(self.model_path, self.device, cfg.dtype, max_len=cfg.max_model_len,
                                quantize=cfg.quantize, kernels=cfg.kernels, prefill=cfg.quantized_prefill)
        # before the pool is sized: the check holds a second copy of the weights while it runs
        self.self_check = self_check(self.model, self.model_path, cfg) if cfg.self_check else None
        mc = self.model.cfg
        self.max_model_len = self.model.max_len  # the option, bounded by the model's own
        self.tokenizer = (Tokenizer.from_gguf(self.model_path) if self.model_path.suffix.lower() == ".gguf" else
                          Tokenizer.from_pretrained(self.model_path)
                          if (self.model_path / "tokenizer.json").is_file() else None)

        page_elems = kv_page_elems(mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim)
        page_bytes = page_elems * self.model.dtype.itemsize
        num_pages = pool_bytes_for(cfg, self.device) // page_bytes
        if num_pages < 1:
            raise ConfigError(f"pool_bytes={cfg.pool_bytes} holds no page ({page_bytes} bytes each)")
        held = lora_dtype(cfg.lora_dtype, self.model.dtype)  # the adapters' dtype in the pool
        problem = page_problem(BaseShapes.from_model_config(mc), page_bytes // held.itemsize, held.itemsize)
        if problem:
            raise ConfigError(f"block_size={cfg.block_size}: {problem}")
        self.pool = PagePool(num_pages, page_elems, self.model.dtype, self.device, held)
        self.kv = KVCacheManager(self.pool, mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim,
                                 prefix_cache=cfg.prefix_cache)
        self.adapters = AdapterResidency(self.pool, BaseShapes.from_model_config(mc), cfg.host_cache_bytes,
                                         cfg.min_resident_steps, base_rows=self.model.base_rows)
        self.arbiter = Arbiter(self.pool, self.kv, self.adapters,
                               EvictionOrder(cfg.eviction, cfg.block_size, self.pool.page_bytes))
        self.prefetcher = Prefetcher(self.adapters, self.arbiter, cfg.prefetch_workers)
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   residency=self.adapters, arbiter=self.arbiter, policy=POLICIES[cfg.policy](),
                                   max_model_len=self.max_model_len)
        # async_decode: a step's tokens read in the next call, after the step that follows it is launched
        self.pipelined = cfg.async_decode == "on" or (cfg.async_decode == "auto" and self.device.type == "cuda")
        self.runner = ModelRunner(self.model, self.kv, DecodeGraphs.for_mode(cfg.decode_graphs, self.model, self.kv,
                                                                               cfg.max_num_seqs, self.max_model_len),
                                  torch.Generator(device=self.device).manual_seed(cfg.seed), exact=self.pipelined)
        self.inflight: Launched | None = None  # the step launched and not read yet (pipelined only)
        self.constrained = 0  # live requests under a structured output's grammar: their steps are not pipelined
        eos = frozenset(mc.eos_token_ids) | (self.tokenizer.eos_token_ids if self.tokenizer else frozenset())
        self.outputs = OutputProcessor(eos, self.max_model_len)  # the one owner of the stop tokens
        self.requests: dict[str, Request] = {}
        self.counters = Counters()
        self._ids = itertools.count()
        self._deadlines: list = []  # heap of (deadline, request id, request); finished ones dropped lazily
        self.mixes = MixChecks(self.adapters, self.pool, self.kv)

    # -- requests ----------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    adapter: str | Mix | None = None, request_id: str | None = None,
                    deadline_s: float | None = None, grammar: Grammar | None = None) -> str:
        """Queue one request; returns its id. `adapter`: a name, a `Mix` (`Mix.of({"sql": 1.0, "formal":
        0.5})`) or None (the base); adapters not on the device start loading now. InvalidRequestError on
        bad input, AdapterNotFoundError for an unregistered adapter. `deadline_s`: aborted ("deadline")
        if not finished by then. `grammar`: `params.structured` compiled by `Engine.grammar` off this
        thread (else compiled here)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        tokenizer, vocab, eos = self._vocabulary(adapter)
        ids = prompt_ids(prompt, tokenizer, vocab, self.model_path)
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
        mix = adapter if isinstance(adapter, Mix) else None
        if mix is None and adapter is not None and not isinstance(adapter, str):
            raise InvalidRequestError(f"adapter must be a name or a Mix, got {type(adapter).__name__}")
        req = Request(rid, ids, params, adapter if isinstance(adapter, str) else None, mix=mix)
        req.activation = self.mixes.check(req)  # a mix's bounds; where an aLoRA takes over (`engine/mixes.py`)
        if deadline_s is not None:
            req.deadline = req.arrival_time + deadline_s
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        req.eos_token_ids = eos
        matcher = matcher_for(params.structured, tokenizer, vocab, grammar) if params.structured else None
        self.outputs.start(req, tokenizer, ids)
        if req.names:  # last: nothing after it can fail, so no reference is ever leaked
            req.loras = self.adapters.acquire_all(req.names)  # AdapterNotFoundError; released at the end
            req.scales = mix.scales if mix is not None else (1.0,)
            req.adapter_cold = not all(e.ready for e in req.loras)
        self.requests[rid] = req
        req.matcher, self.constrained = matcher, self.constrained + (matcher is not None)
        self.scheduler.add(req)
        for entry in req.loras:
            if not entry.ready:  # its load starts now, sparing what others wait for
                self.prefetcher.want(entry, self.scheduler.waiting_loras, self.scheduler.watermark_pages)
        if req.deadline is not None:
            heapq.heappush(self._deadlines, (req.deadline, rid, req))
        if mix is not None:
            self.counters.record_mix(len(mix.members))
            self.mixes.watch(req)
        return rid

    def grammar(self, constraint: Constraint, adapter: str | Mix | None = None) -> Grammar:
        """`constraint` compiled for a request on `adapter` (its vocabulary); any thread may call it."""
        tokenizer, vocab, _ = self._vocabulary(adapter)
        return compile_grammar(constraint, tokenizer, vocab)

    def tokenizer_for(self, adapter: str | Mix | None):
        """A request's tokenizer: its adapter's own vocabulary's, else the base's; any thread may call it."""
        return self._vocabulary(adapter)[0]

    def _vocabulary(self, adapter) -> tuple:
        """(tokenizer, vocabulary size, stop ids or None: the engine's) of a request on `adapter`."""
        entry = self.adapters.entries.get(adapter) if isinstance(adapter, str) else None
        if entry is None or entry.vocab_size is None:
            return self.tokenizer, self.model.cfg.vocab_size, None
        assert entry.tokenizer is not None  # an own vocabulary comes with its tokenizer (`AdapterResidency.inspect`)
        return entry.tokenizer, entry.vocab_size, self.outputs.eos_token_ids | entry.tokenizer.eos_token_ids

    def abort(self, request_id: str) -> RequestOutput:
        """End a request now, freeing its pages; returns its final output (finish_reason "abort")."""
        req = self.requests.get(request_id)
        if req is None:
            raise RequestNotFoundError(f"no unfinished request {request_id!r}")
        self.counters.num_requests_aborted += 1
        return self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        """Requests in the queues, eager adapter loads or a step in flight: `step()` has work."""
        return self.scheduler.has_unfinished() or self.prefetcher.eager_pending or self.inflight is not None

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return an output for every request that produced a token
        or finished in this step (its delta; the whole answer only once it finished:
        `RequestOutput`). A request can fail only itself: a row that cannot be sampled
        or processed ends that request with finish_reason "error".

        The request path, in order: adapters that landed or failed and deadlines; 1. schedule;
        2. build the batch (rows ordered decode-first and by adapter, the LoRA segments);
        3. run the model; 4. draw the tokens; 5. read them and process outputs (text, stops,
        finishes). With `async_decode` a step is read in the next call, after the step that
        follows it is launched (docs/engine.md, "Reading a step late")."""
        t0 = time.perf_counter()
        tick = self.prefetcher.tick(self.scheduler.wanted_adapters(), self.scheduler.watermark_pages)
        outputs = self._fail_adapter_requests(tick.failed) if tick.failed else []
        if self.mixes.watched:  # mixes refused once their adapters' kinds became known end here
            outputs += [self._fail(req, why, InvalidRequestError.code) for req, why in self.mixes.refused()]
        outputs += self._expire_deadlines()
        if self.inflight is not None and self.constrained:  # a grammar's mask needs every token read
            outputs += self._settle(None)
        self.adapters.next_step()
        plan = self.scheduler.schedule()                                            # 1
        outputs += [self._finish(req, "length") for req in plan.finished]
        self.counters.num_preemptions += len(plan.preempted)
        launched = self._launch(plan.chunks, t0, len(tick.loaded)) if plan.chunks else None  # 2-4
        read = self._settle(launched)                                               # 5
        outputs += read
        if launched is None and not read and self.prefetcher.busy:
            self.prefetcher.wait_any(0.005)  # nothing runnable until a load lands: don't spin
        if self.config.debug_checks:
            self.check_integrity()
        return outputs

    def _launch(self, chunks: list, t0: float, loaded: int) -> Launched:
        """2-4 (`ModelRunner.launch`); pipelined, each drawing request's token is pending until
        read, and the prefetcher's copies into pages wait for this step."""
        step = self.runner.launch(chunks, self.inflight, t0, loaded)
        self.scheduler.computed(step.chunks)
        if self.pipelined:
            for j, req in enumerate(step.reqs):
                req.num_pending += 1
                req.pending_row = j
            self.prefetcher.after(step.fence)
        return step

    def _settle(self, launched: Launched | None) -> list[RequestOutput]:
        """5. read the step in flight, if any; then `launched` too, unless pipelined (then in flight)."""
        last, self.inflight = self.inflight, None
        outputs = self._read(last) if last is not None else []
        if launched is not None and self.pipelined:
            self.inflight = launched
        elif launched is not None:
            outputs += self._read(launched)
        return outputs

    def _read(self, step: Launched) -> list[RequestOutput]:
        """Each drawing request's token appended (or its error); pipelined, those of requests
        that ended meanwhile dropped. Then the step's record (its tokens: those appended)."""
        outputs, generated = [], 0
        for req, token, lp, error in self.runner.read(step):
            if self.pipelined:
                req.num_pending -= 1
                if req.status is Status.FINISHED:  # ended while its token was drawn
                    self.counters.num_discarded += 1
                    continue
            generated += error is None
            outputs.append(self._fail(req, error) if error is not None else self._append(req, token, lp))
            if self.pipelined:
                self.scheduler.read(req)
        model_s = step.model_s()
        prompt_tokens = self.counters.record_launched(step.chunks, step.t0, step.loaded, generated, model_s)
        if prompt_tokens:  # what recomputing a cached block would cost (the eviction order)
            self.arbiter.observe_prefill(model_s, sum(c.num_tokens for c in step.chunks))
        return outputs

    def _append(self, req: Request, token: int, logprobs: dict | None) -> RequestOutput:
        if req.matcher is not None and (refused := req.matcher.accept(token)) is not None:
            return self._fail(req, refused)
        try:
            reason = self.outputs.append(req, token, logprobs)
        except Exception as e:  # noqa: BLE001 - one request's text must not fail the step
            log.exception("processing the output of %s failed", req.request_id)
            return self._fail(req, f"internal error while processing its output: {type(e).__name__}")
        if reason is None and req.matcher is not None and req.matcher.done:
            reason = "stop"  # the grammar allows nothing more
        if reason is not None:
            return self._finish(req, reason)
        return self.outputs.output(req)

    def _fail(self, req: Request, why: str, code: str = RequestFailedError.code) -> RequestOutput:
        req.error, req.error_code = why, code
        return self._finish(req, "error")

    def _fail_adapter_requests(self, failed: dict) -> list[RequestOutput]:
        """A load failed: only the waiting requests that use that adapter end, with its message."""
        out = []
        for req in self.scheduler.waiting:
            bad = next((e for e in req.loras if e in failed), None)
            if bad is not None:
                out.append(self._fail(req, f"adapter {bad.name!r} could not be loaded: {failed[bad]}",
                                      AdapterError.code))
        return out

    def _expire_deadlines(self) -> list[RequestOutput]:
        """Requests past their deadline end (a heap: the step looks at the earliest only)."""
        now, expired = time.monotonic(), []
        while self._deadlines and self._deadlines[0][0] < now:
            req = heapq.heappop(self._deadlines)[2]
            if req.status is not Status.FINISHED:
                expired.append(self._finish(req, "deadline"))
        return expired

    def _finish(self, req: Request, reason: str) -> RequestOutput:
        """Every way a request ends comes here, the one writer of `finish_reason`: out of the
        queues, pages and adapter back, its final output (what it had not handed out, and the
        whole answer: engine/output.py's one rule)."""
        req.finish_reason = reason
        req.finish_time = time.monotonic()
        if req.matcher is not None:
            self.constrained -= 1
            req.matcher = None
        if req.status is not Status.FINISHED:
            self.scheduler.finish(req)
        for entry in req.loras:
            if reason != "abort":
                self.adapters.record_wait(entry, req.adapter_wait)
            self.adapters.release(entry)
        req.loras = ()
        self.requests.pop(req.request_id, None)
        if reason != "abort":  # aborts are counted apart (num_requests_aborted), as they always were
            self.counters.record_finished(req)
        self.outputs.close_text(req)
        return self.outputs.output(req)

    # -- adapters --------------------------------------------------------------------
    def register_adapter(self, name: str, path: str | Path, trusted_digest: str | None = None,
                         inspected: Inspected | None = None) -> AdapterInfo:
        """Record a PEFT adapter folder under `name` (disk tier: its config checked now, its weights
        read on first need). `trusted_digest`: the store validated and hashed the files when they
        were pulled, so loads skip both. `inspected`: `inspect_adapter`'s result, run off this thread."""
        return self.adapters.register(name, self.adapter_folder(path), trusted_digest, inspected).info()

    def inspect_adapter(self, name: str, path: str | Path) -> Inspected:
        """`register_adapter`'s checks (config, size against the pool, an own vocabulary's tokenizer),
        safe on any thread."""
        return self.adapters.inspect(name, self.adapter_folder(path))

    def adapter_folder(self, path: str | Path) -> Path:
        """The PEFT folder a path names: itself, or a GGUF adapter's conversion (`adapters/gguf.py`,
        cached by content: off the engine thread for a large file)."""
        from lorafleet.adapters.gguf import as_folder

        return as_folder(path, (self.model.cfg.num_heads, self.model.cfg.num_kv_heads))

    def load_adapter_async(self, name: str, path: str | Path) -> Future:
        """An eager load on a worker while steps go on; the adapter takes over `name` once its pages
        hold it (requests on the old one finish on it). The future: its info, or the AdapterError."""
        return self.prefetcher.load_eager(name, self.adapter_folder(path))

    def load_adapter(self, name: str, path: str | Path) -> dict:
        """`load_adapter_async`, waited for; a refused adapter (AdapterError) changes nothing."""
        done = self.load_adapter_async(name, path)
        while not done.done():
            self.prefetcher.wait_any(0.05)
            self.prefetcher.harvest()  # what else it finds is handed to the next step
        return done.result()

    def unload_adapter(self, name: str) -> None:
        """Forget the adapter and free its pages; AdapterInUseError while requests use it."""
        self.adapters.unregister(name)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (running requests keep their KV); returns the pages freed."""
        return self.kv.reset()

    def adapter_path(self, name: str) -> Path | None:
        """The folder registered under `name`, or None when no adapter has that name."""
        return self.adapters.entries[name].path if name in self.adapters else None

    def lora_capacity(self) -> LoraCapacity:
        """Adapters the pool could hold at the median size (gateways' `max_lora`)."""
        return self.arbiter.adapter_capacity(self.config.max_num_seqs)

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    def list_adapters(self) -> list[AdapterInfo]:
        return [e.info() for e in self.adapters.entries.values()]

    def lora_queues(self) -> LoraQueues:
        """Requests per adapter, running and waiting (for vllm:lora_requests_info)."""
        return views.lora_queues(self.scheduler)

    def step_records(self) -> list[dict]:
        """One dict per recent step: time_s, host_s (outside the forward pass), num_seqs, num_tokens,
        num_generated, distinct_adapters, adapters_loaded (adapters that landed for this step)."""
        return list(self.counters.steps)

    def close(self) -> None:
        self.prefetcher.shutdown()

    # -- conveniences ------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | list[SamplingParams] | tuple[SamplingParams, ...] | None = None,
                 adapters: Sequence[str | Mix | None] | None = None) -> list[RequestOutput]:
        """Run `prompts` to completion, continuously batched together; outputs in prompt order.
        `adapters`: per prompt, an adapter's name, a `Mix` or None (`offline.generate`)."""
        return offline.generate(self, prompts, params, adapters)

    def check_integrity(self) -> None:
        """Every part's invariants (`views.check_integrity`); after each step with `debug_checks`."""
        views.check_integrity(self)

    def stats(self) -> EngineStats:
        return views.stats(self)
