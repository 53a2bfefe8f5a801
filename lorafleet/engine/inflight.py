"""A launched step whose drawn tokens the host has not read yet, and the rule that decides when
they are read.

Synchronous (`async_decode` off, the default): a step is read as soon as it is launched.
Asynchronous (`async_decode` on; `auto`: on with CUDA): the step stays in flight until the
engine's next `step()` has scheduled and launched the step after it, then it is read. Its drawn
tokens stay on the device (`Drawn.tokens`), and the next step's rows whose input they are read
them there (`Request.input_ids`, `graphs.fill_pending`). So the host schedules, builds and
launches step k+1 and processes step k's outputs while the device runs them: the host's work of
a step hides behind the device's instead of adding to it (vLLM's async scheduling; the rule
here is ours).

What reading one step late costs, and how each is kept right:
- a request that ends by a token read late (a stop token or string, an error) was given a row in
  the step launched meanwhile: that row's token is dropped when read (`discarded`); max_tokens
  and the context are known ahead, so those ends never take a row (`Scheduler._ends_when_read`);
- blocks are named for the prefix cache when their last token is read (`Scheduler.read`);
- pages freed meanwhile may still be written by the step in flight (a dropped row's KV): the
  next step runs after it on the same stream, and the prefetcher's copies into pages wait for
  the fence recorded after the last launch (`Prefetcher.fence`);
- the sampler filters over whole rows (`launch(exact=True)`): a token drawn again after its read
  would differ from the one the next step already took;
- a request's outputs come one `step()` call later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from lorafleet.engine.request import RequestOutput, Status
from lorafleet.model.sampler import Drawn, launch


@dataclass
class Launched:
    """A step on the device: its chunks, the requests whose rows draw (in row order), the draws,
    when its `step()` call began, the adapters that landed for it, and its forward pass's time."""

    chunks: list
    reqs: list
    drawn: Drawn
    t0: float
    loaded: int
    model_s: Callable[[], float]


class Steps:
    """Launches the engine's steps and reads them: at once, or (`pipelined`) one call late. The
    one owner of the step in flight and of `Request.num_pending`."""

    def __init__(self, engine, pipelined: bool):
        self.engine, self.pipelined = engine, pipelined
        self.inflight: Launched | None = None
        self._last_read = 0.0

    def launch(self, chunks, t0: float, loaded: int) -> Launched:
        """2. order the rows and build the batch, 3. run the model, 4. draw the tokens: all queued
        on the device; each drawing request's token is pending until read."""
        e = self.engine
        chunks = e.runner.order(chunks)
        prev = self.inflight.drawn.tokens if self.inflight is not None else None
        logits = e.runner.execute(chunks, e.runner.lora_batch(chunks), prev=prev)
        reqs = [c.request for c in chunks if c.samples]
        drawn = launch(logits, [r.params for r in reqs], [r.generator for r in reqs], e.model.kernels.greedy,
                       shared=e._generator, exact=self.pipelined)
        e.scheduler.computed(chunks)
        if self.pipelined:  # read at once, a step's tokens are never pending between calls
            for j, req in enumerate(reqs):
                req.num_pending += 1
                req.pending_row = j
            if e.device.type == "cuda":
                e.prefetcher.fence = torch.cuda.Event()
                e.prefetcher.fence.record()
        return Launched(chunks, reqs, drawn, t0, loaded, e.runner.model_time())

    def settle(self, launched: Launched | None) -> list[RequestOutput]:
        """5. read the step in flight, if any; then `launched` too, unless pipelined (then it is
        the step in flight)."""
        last, self.inflight = self.inflight, None
        outputs = self.read(last) if last is not None else []
        if launched is not None and self.pipelined:
            self.inflight = launched
        elif launched is not None:
            outputs += self.read(launched)
        return outputs

    def read(self, step: Launched) -> list[RequestOutput]:
        """The step's tokens read: each request's appended (or its error), those of requests that
        ended meanwhile dropped; then the step's record (its tokens generated: those appended)."""
        e = self.engine
        tokens, lps, errors = step.drawn.read()
        outputs, generated = [], 0
        pipelined = self.pipelined
        for i, (req, token, lp) in enumerate(zip(step.reqs, tokens, lps)):
            if pipelined:
                req.num_pending -= 1
                if req.status is Status.FINISHED:  # ended while its token was drawn
                    e.counters.num_discarded += 1
                    continue
            generated += i not in errors
            outputs.append(e._fail(req, errors[i]) if i in errors else e._append(req, token, lp))
            if pipelined:
                e.scheduler.read(req)
        self._record(step, generated)
        return outputs

    def _record(self, step: Launched, generated: int) -> None:
        e, chunks, model_s = self.engine, step.chunks, step.model_s()
        prompt_tokens = sum(c.num_tokens for c in chunks if not (c.samples and c.num_tokens == 1))
        if prompt_tokens:  # what recomputing a cached block would cost (the eviction order)
            e.arbiter.order.observe_prefill(model_s, sum(c.num_tokens for c in chunks))
        now = time.perf_counter()
        seconds = now - max(step.t0, self._last_read)  # read one call late: the time between reads
        self._last_read = now
        e.counters.record_step(seconds, len(chunks), prompt_tokens, generated,
                               distinct_adapters=len({n for c in chunks for n in c.request.names or (None,)}),
                               adapters_loaded=step.loaded, model_s=model_s)
