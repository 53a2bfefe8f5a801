"""Engine outputs -> OpenAI response bodies and stream chunks (the shapes the `openai` client
parses): `text_completion` / `chat.completion` objects, their `.chunk` forms for SSE, usage,
and logprobs in the legacy completions form and the chat form."""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

from lorafleet.model import tool_calls
from lorafleet.server import tools
from lorafleet.server.protocol import Generation

TokenText = Callable[[int], str]


def token_text_of(tokenizer) -> TokenText:
    """id -> the token's own text, as logprobs name tokens ("token_id:N" without a tokenizer)."""
    if tokenizer is None:
        return lambda i: f"token_id:{i}"

    @lru_cache(maxsize=65536)
    def text(i: int) -> str:
        return tokenizer.decode([i], skip_special_tokens=False)
    return text


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


def usage(outputs) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(o.token_ids) for o in outputs)
    cached = sum(o.metrics["cached_tokens"] for o in outputs if o.metrics)  # the prefix cache's part
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# -- logprobs ----------------------------------------------------------------------------------

def completion_logprobs(ids: list[int], lps: list[dict[int, float]], text: TokenText, offset: int) -> dict:
    """Legacy completions logprobs for the tokens `ids`; `offset`: characters before them."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, lp in zip(ids, lps):
        s = text(tok)
        out["tokens"].append(s)
        out["token_logprobs"].append(lp[tok])
        out["top_logprobs"].append({text(i): v for i, v in lp.items()})
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def chat_logprobs(ids: list[int], lps: list[dict[int, float]], text: TokenText, top_n: int) -> dict:
    def entry(i: int, v: float) -> dict:
        s = text(i)
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}
    content = []
    for tok, lp in zip(ids, lps):
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({**entry(tok, lp[tok]), "top_logprobs": [entry(i, v) for i, v in top]})
    return {"content": content}


def logprobs_of(gen: Generation, ids: list[int], lps: list[dict[int, float]] | None, text: TokenText,
                offset: int = 0) -> dict | None:
    """The logprobs of the tokens `ids` (a chunk's new ones, or a final output's all), when asked for."""
    if gen.logprobs is None or lps is None:
        return None
    if gen.kind == "chat":
        return chat_logprobs(ids, lps, text, gen.logprobs)
    return completion_logprobs(ids, lps, text, offset)


# -- whole responses ---------------------------------------------------------------------------

def _ids(choice: dict, token_ids: list[int] | None) -> dict:
    """A model without a tokenizer has no text to give: its choices carry the generated token
    ids (`token_ids`, vLLM's field for them) instead."""
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice


def completion_response(gen: Generation, rid: str, created: int, outputs, text: TokenText,
                        with_ids: bool = False) -> dict:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": gen.model,
        "choices": [_ids({"index": i, "text": o.text,
                          "logprobs": logprobs_of(gen, o.token_ids, o.logprobs, text),
                          "finish_reason": finish_reason(o.finish_reason)}, o.token_ids if with_ids else None)
                    for i, o in enumerate(outputs)],
        "usage": usage(outputs),
    }


def chat_response(gen: Generation, rid: str, created: int, outputs, text: TokenText, with_ids: bool = False) -> dict:
    (o,) = outputs
    message: dict = {"role": "assistant", "content": o.text}
    reason = finish_reason(o.finish_reason)
    if gen.tools is not None and gen.tool_format is not None:  # the calls read out of the answer
        content, calls = tool_calls.parse(gen.tool_format, o.text, gen.tools.names)
        calls = calls if gen.tools.parallel else calls[:1]
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": [tools.call_json(c) for c in calls]}
            reason = "tool_calls" if reason == "stop" else reason
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": gen.model,
        "choices": [_ids({"index": 0, "message": message,
                          "logprobs": logprobs_of(gen, o.token_ids, o.logprobs, text),
                          "finish_reason": reason}, o.token_ids if with_ids else None)],
        "usage": usage(outputs),
    }


def response(gen: Generation, rid: str, created: int, outputs, text: TokenText, with_ids: bool = False) -> dict:
    """The whole answer, from each request's final output; `with_ids`: the model has no
    tokenizer, each choice carries `token_ids`."""
    build = chat_response if gen.kind == "chat" else completion_response
    return build(gen, rid, created, outputs, text, with_ids)


# -- stream chunks -----------------------------------------------------------------------------

def chunk(gen: Generation, rid: str, created: int, index: int, out, text: TokenText, offset: int,
          with_ids: bool = False) -> dict:
    """The chunk for one output's delta (text, logprobs, finish_reason; `with_ids`: the model has
    no tokenizer, the chunk carries the new tokens' ids as `token_ids`); `offset`: the characters
    streamed before it."""
    lp = logprobs_of(gen, out.new_token_ids, out.new_logprobs, text, offset)
    reason = finish_reason(out.finish_reason)
    ids = out.new_token_ids if with_ids else None
    if gen.kind == "chat":
        delta = {"content": out.new_text} if out.new_text or not reason else {}
        choice = _ids({"index": 0, "delta": delta, "logprobs": lp, "finish_reason": reason}, ids)
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": gen.model,
                "choices": [choice]}
    choice = _ids({"index": index, "text": out.new_text, "logprobs": lp, "finish_reason": reason}, ids)
    return {"id": rid, "object": "text_completion", "created": created, "model": gen.model,
            "choices": [choice]}


def first_chat_chunk(gen: Generation, rid: str, created: int) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": gen.model,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}]}


def usage_chunk(gen: Generation, rid: str, created: int, outputs) -> dict:
    kind = "chat.completion.chunk" if gen.kind == "chat" else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": gen.model, "choices": [],
            "usage": usage(outputs)}


def tool_chunks(gen: Generation, rid: str, created: int, stream: tool_calls.ToolStream, out, text: TokenText,
                with_ids: bool = False) -> list[dict]:
    """A chat output's delta read through `stream`: its text that is no call, then each call completed
    (a delta with its id and name, then one with its arguments, as OpenAI streams them), the last
    chunk with the finish reason ("tool_calls" where the answer made calls and stopped)."""
    content, calls = stream.feed(out.new_text)
    if out.finished:
        more, last = stream.finish()
        content, calls = content + more, calls + last
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": gen.model}
    lp = logprobs_of(gen, out.new_token_ids, out.new_logprobs, text)
    ids = out.new_token_ids if with_ids else None
    deltas: list[dict] = [{"content": content}] if content else []
    for c in calls if gen.tools is None or gen.tools.parallel else calls[:max(0, 1 - stream.calls)]:
        i = stream.calls
        stream.calls += 1
        deltas.append({"tool_calls": [{"index": i, "id": tools.call_id(), "type": "function",
                                       "function": {"name": c.name, "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": i, "function": {"arguments": c.arguments}}]})
    reason = finish_reason(out.finish_reason)
    if reason == "stop" and stream.calls:
        reason = "tool_calls"
    if reason or (not deltas and (lp is not None or ids)):  # the end, or tokens whose text is held back
        deltas.append({})
    if not deltas:
        return []
    choices: list[dict] = [{"index": 0, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
    choices[0]["logprobs"] = lp
    _ids(choices[0], ids)
    choices[-1]["finish_reason"] = reason
    return [{**head, "choices": [c]} for c in choices]
