"""OpenAI request bodies -> what the engine takes, refusing what it cannot honour.

`decode_body` turns the raw bytes into JSON, refusing what is not plain, well-formed Unicode
JSON (lone surrogates, nesting deeper than `MAX_DEPTH`). `parse_completion` and `parse_chat`
read it and return a `Generation`: the prompts (chat: the messages), the adapter (`model` names
an adapter or the base), the SamplingParams and the response options; none of them tokenizes.
`tokenize` turns text prompts and chat messages into token ids: the server runs it on a worker
thread, never on the event loop (a long prompt takes a while) nor on the engine thread (it would
stall every running request). Every refusal is an InvalidRequestError whose `param` names the
field, so the client gets OpenAI's error body with a 400. Unknown fields are ignored, as OpenAI clients send
more than any one server reads; fields that would change the output and are not implemented
(n > 1, echo, penalties, logit_bias...) are refused rather than silently ignored. vLLM's extras
are accepted: top_k, min_p, ignore_eos, stop_token_ids, include_stop_str_in_output. Every list a body may carry is capped: `prompt` (a list of prompts: `--max-pending`; token ids:
the context), `stop` (MAX_STOP_STRINGS of MAX_STOP_LENGTH), `stop_token_ids`
(MAX_STOP_TOKEN_IDS), `messages` (MAX_MESSAGES), and a chat message's content parts by the body's
size. Bodies over DECODE_ON_WORKER bytes are decoded and checked on a worker thread, not on the
event loop (`decode_body_async`). Tools: `server/tools.py`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from lorafleet.engine.request import SamplingParams
from lorafleet.errors import InvalidRequestError, shown
from lorafleet.adapters.mix import FIELD as MIX_FIELD
from lorafleet.adapters.mix import Mix
from lorafleet.model.grammar import Grammar
from lorafleet.server import structured, tools
from lorafleet.server.tools import Tools

MAX_LOGPROBS = 20
MAX_DEPTH = 32          # JSON nesting a request body may have (OpenAI's bodies need 5)
MAX_STOP_STRINGS = 64   # each is searched for at every new token
MAX_STOP_LENGTH = 1024
MAX_STOP_TOKEN_IDS = 1024  # checked against every new token (a set), but kept per request
MAX_MESSAGES = 4096     # chat turns in one request
# JSON values a body may hold, counted as its commas and colons before it is parsed: parsing holds
# the GIL, so a body of a million tiny values would stall every other thread; 262,144 still takes
# a 128K-token prompt as ids
MAX_JSON_ITEMS = 1 << 18
DECODE_ON_WORKER = 64 << 10  # bodies larger than this are decoded and checked on a worker thread
# A JSON string decodes to at least a sixth of its length ("\u0041" is one byte of text), so a
# literal longer than ESCAPE_RATIO times the text a context can hold is refused unparsed
ESCAPE_RATIO = 6
# Bytes a token's text may take, for that bound before the request's tokenizer is known: above any
# real vocabulary's longest token (each tokenizer's own bound applies after parsing)
ANY_TOKEN_BYTES = 1024
_D = TypeVar("_D", bound=int | None)  # an integer field's default (`_integer`): an int, or None where it may be unset


def bad(param: str | None, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


@dataclass
class Generation:
    kind: str                             # "completion" or "chat"
    model: str                            # as the client named it; echoed in responses
    adapter: str | Mix | None             # the adapter `model` names, the mix `adapters` names, or None
    prompts: list[str | list[int]]        # chat: [] until `tokenize`
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False           # stream_options.include_usage
    logprobs: int | None = None           # top-N per token, None: no logprobs
    messages: list[dict] | None = None    # chat: the conversation, rendered by `tokenize`
    max_tokens_given: bool = True         # chat without max_tokens: up to the end of the context
    grammar: Grammar | None = None        # params.structured compiled for its vocabulary (`prepare_request`)
    tools: Tools | None = None            # chat: the tools it may call (`server/tools.py`)
    tool_format: str | None = None        # the template's tool-call format, once known (`prepare_request`)

    def template_extra(self) -> dict:
        """The chat template's variables beside the messages: the tools, where the request has them."""
        return {"tools": self.tools.rendered()} if self.tools is not None else {}


# -- the body --------------------------------------------------------------------------------------

def decode_body(raw: bytes, max_text_bytes: int | None = None) -> Any:
    """bytes -> JSON value; a 400 for anything that is not JSON made of valid Unicode strings
    nested at most MAX_DEPTH deep (a lone surrogate such as "\\ud800" is valid JSON but no
    text: tokenizers and UTF-8 encoders refuse it), holding at most MAX_JSON_ITEMS values, and, given
    `max_text_bytes`, no string surely longer than that in UTF-8. Both counts are taken before the
    body is parsed: parsing holds the GIL, the counts (numpy) do not."""
    if _separators(raw) > MAX_JSON_ITEMS:
        raise bad(None, f"the request body holds more than {MAX_JSON_ITEMS} JSON values")
    if max_text_bytes is not None and len(raw) > ESCAPE_RATIO * max_text_bytes:
        if (longest := _longest_string(raw)) > ESCAPE_RATIO * max_text_bytes:
            raise bad(None, f"a string in the request body is {longest:,} bytes of JSON, {longest // ESCAPE_RATIO:,} "
                            f"bytes of text or more; this daemon's context holds at most {max_text_bytes:,} bytes "
                            "of text")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(None, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad(None, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    stack = [(body, 0, None)]
    while stack:
        value, depth, top = stack.pop()
        if depth > MAX_DEPTH:
            raise bad(top, f"the request body nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, str):
            _unicode(value, top)
        elif isinstance(value, list):
            stack.extend((v, depth + 1, top) for v in value)
        elif isinstance(value, dict):
            for k, v in value.items():
                _unicode(k, top)
                stack.append((v, depth + 1, k if depth == 0 else top))
    return body


def _separators(raw: bytes) -> int:
    """Commas and colons in `raw` (an upper bound of its JSON values, less one). Small bodies by
    `bytes.count`; large ones by numpy, which releases the GIL while it scans (`bytes.count`
    holds it throughout)."""
    if len(raw) <= DECODE_ON_WORKER:
        return raw.count(b",") + raw.count(b":")
    a = np.frombuffer(raw, dtype=np.uint8)
    return int(np.count_nonzero(a == ord(","))) + int(np.count_nonzero(a == ord(":")))


def _longest_string(raw: bytes) -> int:
    """The length in `raw` of its longest JSON string literal, quotes left out, found by numpy
    (0 when the quotes do not pair: the parser then names the error). A quote after an odd run of
    backslashes is escaped, inside a string."""
    a = np.frombuffer(raw, dtype=np.uint8)
    quotes = np.flatnonzero(a == ord('"'))
    after = quotes[quotes > 0]
    after = after[a[after - 1] == ord("\\")]
    if len(after):
        slash = a == ord("\\")
        starts = np.flatnonzero(slash[1:] & ~slash[:-1]) + 1  # where each run of backslashes begins
        if slash[0]:
            starts = np.concatenate(([0], starts))
        run = after - starts[np.searchsorted(starts, after - 1, side="right") - 1]
        quotes = np.setdiff1d(quotes, after[run % 2 == 1], assume_unique=True)
    n = len(quotes) // 2 * 2
    return int((quotes[1:n:2] - quotes[0:n:2] - 1).max()) if n else 0


def _unicode(s: str, param: str | None) -> None:
    if s.isascii():  # no surrogate; a scan, not a copy (the check holds the GIL through a large prompt)
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        where = f"{param}: " if param else ""
        raise bad(param, f"{where}a string holds a lone surrogate (such as \\ud800): not valid Unicode") from None


# -- field readers ---------------------------------------------------------------------------------

def _number(body: dict, name: str, default: float, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(name, f"{name} must be a number, got {shown(v)}")
    if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
        span = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}{']' if hi is not None else ')'}"
        raise bad(name, f"{name} must be in {span}, got {shown(v)}")
    return float(v)


def _integer(body: dict, name: str, default: _D, lo: int | None = None, hi: int | None = None) -> int | _D:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"{name} must be an integer, got {shown(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(name, f"{name} must be an integer in [{lo}, {hi if hi is not None else 'inf'}], got {shown(v)}")
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be true or false, got {shown(v)}")
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", "stop must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in stops):
        raise bad("stop", f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} characters")
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


def _model(body: dict, base_name: str) -> tuple[str, str | Mix | None]:
    """(the model as echoed, what the request runs on): `model` naming an adapter, or the base
    (or nothing) with `adapters` naming a mix, or the base alone."""
    model = body.get("model")
    mix = body.get(MIX_FIELD)
    if mix is not None:
        if model is not None and model != base_name:
            raise bad(MIX_FIELD, f"model names {shown(model)} and adapters names a mix: with adapters, model names the "
                                 f"base ({base_name!r}) or is left out")
        return base_name, Mix.from_json(mix)  # a 400 naming the entry at fault (adapters/mix.py)
    if model is None or model == base_name:
        return base_name, None
    if not isinstance(model, str) or not model:
        raise bad("model", f"model must be a string naming the base or an adapter, got {shown(model)}")
    return model, model


def _sampling(body: dict, max_tokens_default: int, max_tokens: int | None, logprobs: int | None,
              defaults: dict | None) -> SamplingParams:
    """`defaults`: the served model's own sampling defaults (`model.config.generation_defaults`),
    used where the request names none, as vLLM does with a model's generation_config.json."""
    defaults = defaults or {}
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise bad("stop_token_ids", "stop_token_ids must be a list of non-negative integers")
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise bad("stop_token_ids", f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stop_ids):
        raise bad("stop_token_ids", "stop_token_ids must be a list of non-negative integers")
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else max_tokens_default,
        temperature=_number(body, "temperature", defaults.get("temperature", 1.0), lo=0.0),
        top_p=_number(body, "top_p", defaults.get("top_p", 1.0), lo=0.0, hi=1.0, lo_open=True),
        top_k=_integer(body, "top_k", defaults.get("top_k", 0), lo=-1),
        min_p=_number(body, "min_p", defaults.get("min_p", 0.0), lo=0.0, hi=1.0),
        seed=_integer(body, "seed", None, lo=0, hi=2**63 - 1),
        stop=_stop(body),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_bool(body, "ignore_eos", False),
        logprobs=logprobs,
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
        structured=structured.constraint(body),
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
    return tools.message_calls({**m, "content": content}, i)


def parse_chat(body: Any, base_name: str, defaults: dict | None = None) -> Generation:
    body = _check_body(body)
    model, adapter = _model(body, base_name)
    _refuse_unsupported(body)
    if _bool(body, "echo", False):  # vLLM's chat extra: the prompt before the answer
        raise bad("echo", "echo is not supported")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise bad("messages", f"messages takes at most {MAX_MESSAGES} turns")
    messages = [_message(m, i) for i, m in enumerate(messages)]
    want = _bool(body, "logprobs", False)
    top = _integer(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not want:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    logprobs = (top or 0) if want else None
    max_tokens = _integer(body, "max_completion_tokens", None, lo=1)
    max_tokens = _integer(body, "max_tokens", max_tokens, lo=1)
    stream = _bool(body, "stream", False)
    params = _sampling(body, 1, max_tokens, logprobs, defaults)
    return Generation("chat", model, adapter, [], params, stream, _stream_options(body, stream), logprobs,
                      messages=messages, max_tokens_given=max_tokens is not None, tools=tools.parse(body))


# -- tokenization (a worker thread) ----------------------------------------------------------------

def _check_text_size(text: str, tokenizer, max_model_len: int, param: str, what: str) -> None:
    """Refuse, before encoding, a text longer than the context could hold whatever it encodes to
    (encoding costs time and memory in proportion to the text)."""
    bound = tokenizer.max_text_bytes(max_model_len)
    # a character is 1-4 bytes: its count alone decides but between bound / 4 and bound (no copy)
    size = len(text) if len(text) > bound or text.isascii() else len(text.encode("utf-8")) if len(text) * 4 > bound else 0
    if size > bound:
        raise bad(param, f"{what} is {size:,} bytes or more; the context of {max_model_len:,} tokens holds at most "
                         f"{bound:,} bytes of text ({tokenizer.max_token_bytes} bytes a token at most)")


def render_chat(gen: Generation, tokenizer, max_model_len: int) -> str:
    """The chat's prompt text, rendered with the tokenizer's template, bounded in time and in size by
    what the context can hold (`chat_template.render_bounded`)."""
    if tokenizer is None:
        raise bad("messages", "the served model has no tokenizer; use /v1/completions with token ids")
    try:
        return tokenizer.apply_chat_template(gen.messages, add_generation_prompt=True,
                                             max_chars=tokenizer.max_text_bytes(max_model_len), **gen.template_extra())
    except InvalidRequestError as e:
        raise bad("messages", str(e)) from None


def tokenize(gen: Generation, tokenizer, max_model_len: int, rendered: str | None = None) -> Generation:
    """Text prompts and chat messages -> token ids (a chat's `rendered` text when it is given).
    Chat without max_tokens may generate up to the end of the context (the engine stops there
    with "length")."""
    if gen.kind == "chat":
        text = render_chat(gen, tokenizer, max_model_len) if rendered is None else rendered
        _check_text_size(text, tokenizer, max_model_len, "messages", "the rendered chat")
        # The template already wrote every special token the model needs; adding them again would
        # double the BOS.
        ids = tokenizer.encode(text, add_special_tokens=False)
        params = gen.params
        if not gen.max_tokens_given:
            params = dataclasses.replace(params, max_tokens=max(1, max_model_len - len(ids)))
        return dataclasses.replace(gen, prompts=[ids], params=params)
    if any(isinstance(p, str) for p in gen.prompts):
        if tokenizer is None:
            raise bad("prompt", "the served model has no tokenizer.json: send token ids")
        for i, p in enumerate(gen.prompts):
            if isinstance(p, str):
                _check_text_size(p, tokenizer, max_model_len, "prompt",
                                 "the prompt" if len(gen.prompts) == 1 else f"prompt[{i}]")
        return dataclasses.replace(gen, prompts=[tokenizer.encode(p) if isinstance(p, str) else p
                                                 for p in gen.prompts])
    return gen
