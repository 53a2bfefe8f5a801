"""OutputProcessor: the one place where a sampled token becomes text, a stop, and a streamed delta.

One rule for what a client sees, whatever ends the request (stop token, stop string, length,
the pool-full "length", deadline, abort, adapter error, a failed row):
- `req.text` is everything decoded so far (cut at a stop string when one is hit);
- `req.emitted` is how many of its characters have been handed out;
- every output carries `new_text = text[emitted:visible]` and moves `emitted` to `visible`,
  where `visible` is the whole text once the request has finished, and otherwise the text
  minus what could still become a stop string (held back);
- the final output's `text` is the whole text (`visible` then).
So the `new_text` of a request's outputs, concatenated, is always its final `text`.
Token ids and logprobs follow the same pattern: `req.emitted_tokens` of them have been handed
out, each output carries the rest as `new_token_ids`/`new_logprobs`, and the final one all of
them (`RequestOutput`'s contract: deltas always, the whole once, at the end).
"""

from __future__ import annotations

import time

from lorafleet.engine.request import Request, RequestOutput


class OutputProcessor:
    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int):
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def append(self, req: Request, token: int, logprobs: dict | None) -> str | None:
        """Add one sampled token: its text and its logprobs; returns the finish it causes, "stop"
        or "length", or None (the engine's `_finish` records it: one writer of `finish_reason`)."""
        req.output_token_ids.append(token)
        if logprobs is not None:
            req.logprobs.append(logprobs)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        old_len = len(req.text)
        if req.detokenizer is not None:
            req.text += req.detokenizer.step(token)
        p = req.params
        eos = self.eos_token_ids if req.eos_token_ids is None else req.eos_token_ids
        if token in p.stop_token_ids or (not p.ignore_eos and token in eos):
            return "stop"
        if p.stop and self._cut_at_stop_string(req, old_len):
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_known >= self.max_model_len:  # not those drawn since
            return "length"
        return None

    @staticmethod
    def _cut_at_stop_string(req: Request, new_from: int) -> bool:
        """Cut the text at the first stop string that the new text completes. The text is then
        final: the decoder is dropped so that nothing past the cut is flushed later."""
        stops = req.params.stop
        window_start = max(0, new_from - max(len(s) for s in stops) + 1)
        hits = [(i, s) for s in stops if (i := req.text.find(s, window_start)) >= 0]
        if not hits:
            return False
        i, s = min(hits)
        req.text = req.text[:i + len(s)] if req.params.include_stop_str_in_output else req.text[:i]
        req.detokenizer = None
        return True

    def start(self, req: Request, tokenizer, prompt_ids: list[int]) -> None:
        """A new request's decoder, which reads its text after the prompt (none without a
        tokenizer: token ids only)."""
        if tokenizer is not None:
            req.detokenizer = tokenizer.incremental_decoder(context_ids=prompt_ids)

    def close_text(self, req: Request) -> None:
        """The request ends: whatever the decoder held back (a split character) joins the text."""
        if req.detokenizer is not None:
            req.text += req.detokenizer.flush()
            req.detokenizer = None

    def output(self, req: Request) -> RequestOutput:
        """This step's output for `req`: the delta since the last one, under the module's rule;
        the whole answer too once it has finished."""
        finished = req.finish_reason is not None
        visible = len(req.text)
        if not finished and req.params.stop:  # hold back what could still become a stop string
            visible = max(req.emitted, visible - (max(len(s) for s in req.params.stop) - 1))
        new_text = req.text[req.emitted:visible]
        req.emitted = visible
        sent = req.emitted_tokens
        req.emitted_tokens = len(req.output_token_ids)
        want_lp = req.params.logprobs is not None  # then each output token has its dict
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            finished=finished, finish_reason=req.finish_reason, adapter=req.adapter,
            new_token_ids=req.output_token_ids[sent:], new_text=new_text,
            new_logprobs=req.logprobs[sent:] if want_lp else None,
            token_ids=list(req.output_token_ids) if finished else None,
            text=req.text if finished else None,
            logprobs=list(req.logprobs) if finished and want_lp else None,
            error=req.error, error_code=req.error_code, metrics=metrics(req) if finished else None)


def metrics(req: Request) -> dict:
    """A finished request's timings (seconds; monotonic clock)."""
    n = len(req.output_token_ids)
    first = req.first_token_time
    assert req.finish_time is not None  # finished
    return {"arrival_s": req.arrival_time, "adapter_wait_s": req.adapter_wait,
            "queue_s": (req.first_scheduled_time or req.finish_time) - req.arrival_time,
            "ttft_s": first - req.arrival_time if first else None,
            "tpot_s": (req.finish_time - first) / (n - 1) if n > 1 and first is not None else None,
            "e2e_s": req.finish_time - req.arrival_time,
            "num_preemptions": req.num_preemptions, "cached_tokens": req.num_cached_tokens}
