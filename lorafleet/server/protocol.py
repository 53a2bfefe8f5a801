"""OpenAI request bodies -> what the engine takes, refusing what it cannot honour.

`parse_completion` and `parse_chat` read a decoded JSON body and return a `Generation`: the
prompts, the adapter (`model` names an adapter or the base), the SamplingParams and the
response options. Every refusal is an InvalidRequestError whose `param` names the field, so the
client gets OpenAI's error body with a 400. Unknown fields are ignored, as OpenAI clients send
more than any one server reads; fields that would change the output and are not implemented
(n > 1, echo, penalties, logit_bias...) are refused rather than silently ignored.

vLLM's extras are accepted: top_k, ignore_eos, stop_token_ids, include_stop_str_in_output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lorafleet.engine.request import SamplingParams
from lorafleet.errors import InvalidRequestError

MAX_LOGPROBS = 20


def bad(param: str | None, message: str) -> InvalidRequestError:
    e = InvalidRequestError(message)
    e.param = param
    return e


@dataclass
class Generation:
    kind: str                             # "completion" or "chat"
    model: str                            # as the client named it; echoed in responses
    adapter: str | None
    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False           # stream_options.include_usage
    logprobs: int | None = None           # top-N per token, None: no logprobs
    extra: dict[str, Any] = field(default_factory=dict)


# -- field readers ---------------------------------------------------------------------------------

def _number(body: dict, name: str, default: float, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(name, f"{name} must be a number, got {v!r}")
    if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
        span = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}{']' if hi is not None else ')'}"
        raise bad(name, f"{name} must be in {span}, got {v!r}")
    return float(v)


def _integer(body: dict, name: str, default: int | None, lo: int | None = None,
             hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"{name} must be an integer, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(name, f"{name} must be an integer in [{lo}, {hi if hi is not None else 'inf'}], got {v!r}")
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be true or false, got {v!r}")
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", "stop must be a non-empty string or a list of non-empty strings")
    return tuple(stops)


def _refuse_unsupported(body: dict) -> None:
    if _integer(body, "n", 1, lo=1) != 1:
        raise bad("n", "n must be 1: send one request per completion")
    if _integer(body, "best_of", 1, lo=1) != 1:
        raise bad("best_of", "best_of is not supported (must be 1)")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0) != 0.0:
            raise bad(name, f"{name} is not supported (must be 0)")
    if body.get("logit_bias"):
        raise bad("logit_bias", "logit_bias is not supported")
    if _number(body, "repetition_penalty", 1.0) != 1.0:
        raise bad("repetition_penalty", "repetition_penalty is not supported (must be 1)")


def _model(body: dict, base_name: str) -> tuple[str, str | None]:
    model = body.get("model")
    if model is None or model == base_name:
        return base_name, None
    if not isinstance(model, str) or not model:
        raise bad("model", f"model must be a string naming the base or an adapter, got {model!r}")
    return model, model


def _sampling(body: dict, max_tokens_default: int, max_tokens: int | None, logprobs: int | None,
              defaults: dict | None) -> SamplingParams:
    """`defaults`: the served model's own sampling defaults (`model.config.generation_defaults`),
    used where the request names none, as vLLM does with a model's generation_config.json."""
    defaults = defaults or {}
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stop_ids):
        raise bad("stop_token_ids", "stop_token_ids must be a list of non-negative integers")
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else max_tokens_default,
        temperature=_number(body, "temperature", defaults.get("temperature", 1.0), lo=0.0),
        top_p=_number(body, "top_p", defaults.get("top_p", 1.0), lo=0.0, hi=1.0, lo_open=True),
        top_k=_integer(body, "top_k", defaults.get("top_k", 0), lo=-1),
        seed=_integer(body, "seed", None, lo=0, hi=2**63 - 1),
        stop=_stop(body),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_bool(body, "ignore_eos", False),
        logprobs=logprobs,
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
    )


def _stream_options(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise bad("stream_options", "stream_options must be an object")
    if not stream:
        raise bad("stream_options", "stream_options is only allowed with stream: true")
    return _bool(opts, "include_usage", False)


def _check_body(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


# -- the two endpoints -----------------------------------------------------------------------------

def parse_completion(body: Any, base_name: str, defaults: dict | None = None) -> Generation:
    body = _check_body(body)
    model, adapter = _model(body, base_name)
    _refuse_unsupported(body)
    if _bool(body, "echo", False):
        raise bad("echo", "echo is not supported")
    if body.get("suffix"):
        raise bad("suffix", "suffix is not supported")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        raise bad("prompt", "prompt must be a string, a list of token ids, or a non-empty list of either")
    if any(isinstance(t, bool) for p in prompts if isinstance(p, list) for t in p):
        raise bad("prompt", "prompt token ids must be integers")
    logprobs = _integer(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    stream = _bool(body, "stream", False)
    params = _sampling(body, 16, _integer(body, "max_tokens", None, lo=1), logprobs, defaults)
    return Generation("completion", model, adapter, prompts, params, stream,
                      _stream_options(body, stream), logprobs)


def _message(m: Any, i: int) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad("messages", f"messages[{i}] must be an object with a role and a content")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text is understood by a text model
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad("messages", f"messages[{i}].content: only text parts are supported")
            texts.append(part["text"])
        content = "".join(texts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise bad("messages", f"messages[{i}].content must be a string or a list of text parts")
    return {**m, "content": content}


def parse_chat(body: Any, base_name: str, tokenizer, max_model_len: int,
               defaults: dict | None = None) -> Generation:
    body = _check_body(body)
    model, adapter = _model(body, base_name)
    _refuse_unsupported(body)
    if body.get("tools"):
        raise bad("tools", "tools are not supported")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad("response_format", "response_format: only {\"type\": \"text\"} is supported")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    if tokenizer is None:
        raise bad("messages", "the served model has no tokenizer; use /v1/completions with token ids")
    messages = [_message(m, i) for i, m in enumerate(messages)]
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except InvalidRequestError as e:
        raise bad("messages", str(e)) from None
    want = _bool(body, "logprobs", False)
    top = _integer(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not want:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    logprobs = (top or 0) if want else None
    max_tokens = _integer(body, "max_completion_tokens", None, lo=1)
    max_tokens = _integer(body, "max_tokens", max_tokens, lo=1)
    stream = _bool(body, "stream", False)
    # no max_tokens: up to the end of the context (the engine stops there with "length")
    params = _sampling(body, max(1, max_model_len - len(ids)), max_tokens, logprobs, defaults)
    return Generation("chat", model, adapter, [ids], params, stream, _stream_options(body, stream), logprobs)
