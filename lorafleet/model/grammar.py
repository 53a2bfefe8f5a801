"""Structured output: a request's tokens held to a JSON schema, a regular expression, a choice of
strings or a grammar (Lark or GBNF), by llguidance's matchers and per-step token masks.

A `Constraint` is the request's spec (hashable, bounded); `compile` turns it into a `Grammar` for
one tokenizer and logits width, off the engine thread; each request takes its own `Matcher`
(a copy of the grammar's), which the engine advances with every token it appends; `apply_masks`
sets the logits of the tokens a row's matcher forbids to -inf before any token is drawn.

Decisions, each with its reason:
- llguidance, not xgrammar: a request with a new schema costs several times less, it names
  the schema features it cannot honour (xgrammar ignores several, so output could break the
  schema), it never lets a special token into a JSON string, its work per token is bounded by
  parser limits, and it brings no dependency (measured: docs/benchmark-history.md).
- One `LLTokenizer` per tokenizer and logits width, built once and kept with the tokenizer (it
  holds the GIL while it is built: the daemon builds the base's at start).
- A compiled grammar is kept per vocabulary by its spec (LRU of `CACHED`): requests with the same
  schema copy its matcher instead of compiling again.
- Masks are filled on the host (llguidance's), applied to CPU logits by adding each mask byte's
  looked-up 0 / -inf addends, to GPU logits by shifts on the device; rows without a constraint
  are never touched.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
import torch

from lorafleet.errors import InvalidRequestError

KINDS = ("json_schema", "regex", "choice", "grammar")
MAX_SPEC_BYTES = 64 << 10  # a constraint's text, bounded before anything parses it
MAX_CHOICES = 4096
CACHED = 64                # compiled grammars kept per vocabulary
ANY_JSON_OBJECT = '{"type":"object"}'
# JSON laid out as json.dumps does: whitespace is no freedom a model should spend tokens on (a weak
# one loops in it), and the output reads the same every time
JSON_STYLE: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match: `kind` one of KINDS, `text` the schema (JSON text,
    compact, in its order), the regex, the choices (a JSON list) or the grammar; `param` the request field
    it came from, named in errors."""

    kind: str
    text: str
    param: str = "response_format"

    @classmethod
    def of(cls, kind: str, value: Any, param: str) -> Constraint:
        """A constraint from a request's field; a 400 naming `param` for a value of the wrong
        shape or over the bounds."""
        if kind == "json_schema":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise InvalidRequestError(f"{param}: the schema is not valid JSON: {e}", param=param) from None
            if not isinstance(value, (dict, bool)):
                raise InvalidRequestError(f"{param}: a JSON schema is an object, got {type(value).__name__}",
                                          param=param)
            text = json.dumps(value, separators=(",", ":"))  # in its order: properties are generated in it
        elif kind == "choice":
            if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                    or not all(isinstance(v, str) and v for v in value)):
                raise InvalidRequestError(f"{param}: choice is a list of 1 to {MAX_CHOICES} non-empty strings",
                                          param=param)
            text = json.dumps(value)
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise InvalidRequestError(f"{param}: the {kind} is a non-empty string", param=param)
            text = value
        else:
            raise InvalidRequestError(f"{param}: unknown constraint {kind!r}; use one of {', '.join(KINDS)}",
                                      param=param)
        if len(text.encode()) > MAX_SPEC_BYTES:
            raise InvalidRequestError(f"{param}: the {kind} is over {MAX_SPEC_BYTES >> 10} KiB", param=param)
        return cls(kind, text, param)


class Vocabulary:
    """llguidance's view of one tokenizer at one logits width, and the grammars compiled for it."""

    def __init__(self, tokenizer, width: int):
        eos = sorted(tokenizer.eos_token_ids) or None
        self.width = width
        self.lt = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=width, eos_token=eos)
        self.words = (width + 31) // 32  # int32 words of a row's mask
        self._grammars: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, c: Constraint) -> Grammar:
        key = (c.kind, c.text)
        with self._lock:
            proto = self._grammars.get(key)
            if proto is not None:
                self._grammars.move_to_end(key)
        if proto is None:
            proto = self._build(c)
            with self._lock:
                self._grammars[key] = proto
                while len(self._grammars) > CACHED:
                    self._grammars.popitem(last=False)
        return Grammar(self, proto)

    def _build(self, c: Constraint) -> llguidance.LLMatcher:
        try:
            if c.kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(c.text, overrides=JSON_STYLE)
            else:
                kind = "gbnf" if c.kind == "grammar" else c.kind
                grammar = llguidance.grammar_from(kind, c.text)  # type: ignore[arg-type]  # a Literal of its kinds
        except ValueError as e:
            raise InvalidRequestError(f"{c.param}: {e}", param=c.param) from None
        # llguidance's default bounds on one request's work a token (lexer fuel, Earley items) and on its
        # grammar's size; its errors without its parser state (a client's schema is no log's business)
        limits = llguidance.LLParserLimits(verbose_errors=False)
        unserved = f"{c.param}: this {c.kind.replace('_', ' ')} cannot be served"
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.lt, limits=limits)
        if is_error:
            raise InvalidRequestError(f"{unserved}: {messages[0]}", param=c.param)
        matcher = llguidance.LLMatcher(self.lt, grammar, log_level=0, limits=limits)  # drops the GIL while it builds
        if matcher.is_error():
            raise InvalidRequestError(f"{unserved}: {matcher.get_error()}", param=c.param)
        return matcher


class Grammar:
    """A compiled constraint for one vocabulary: `matcher()` gives each request its own state."""

    def __init__(self, vocabulary: Vocabulary, proto: llguidance.LLMatcher):
        self.vocabulary, self._proto = vocabulary, proto

    def matcher(self) -> Matcher:
        return Matcher(self.vocabulary, self._proto.deep_copy())


class Matcher:
    """One request's place in its grammar. One owner at a time (llguidance refuses concurrent use):
    the engine thread."""

    def __init__(self, vocabulary: Vocabulary, m: llguidance.LLMatcher):
        self.vocabulary, self._m = vocabulary, m

    def accept(self, token: int) -> str | None:
        """Advance by the drawn `token`; None, or why the grammar refused it (a token its mask
        allowed only where a literal spells an added special token: llguidance allows the token,
        then refuses it; that request fails alone)."""
        if self._m.consume_token(token):
            return None
        return f"the output left its grammar: {self._m.get_error() or 'token refused'}"

    @property
    def done(self) -> bool:
        """Nothing but the end may follow: the output is complete."""
        return self._m.is_stopped()

    def fill(self, row: np.ndarray) -> None:
        """The allowed tokens as bits (token 32k + j is bit j of word k) into `row`, int32 [words]."""
        words = self.vocabulary.words
        if row.dtype != np.int32 or not row.flags.c_contiguous or len(row) < words:
            raise ValueError(f"a mask row is {words} contiguous int32 words or more")
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, words * 4)
        row[words:] = 0


# byte -> the 8 tokens' addends, bit j (little-endian) set: 0, else -inf; a lookup and an add beat
# unpacking the bits and a masked fill on a large vocabulary (benchmark-history.md)
_ADDENDS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"),
                    np.float32(0), np.float32(-np.inf)).astype(np.float32)
_vocabularies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {width: Vocabulary}
_vocab_lock = threading.Lock()


def vocabulary(tokenizer, width: int) -> Vocabulary:
    """The one `Vocabulary` of `tokenizer` at logits `width` (built on first use: seconds, under the
    GIL, for a large vocabulary: a daemon builds the base's at start)."""
    with _vocab_lock:
        found = _vocabularies.setdefault(tokenizer, {}).get(width)
        if found is None:
            found = _vocabularies[tokenizer][width] = Vocabulary(tokenizer, width)
        return found


def compile(c: Constraint, tokenizer, width: int) -> Grammar:
    """`c` compiled for `tokenizer` at logits `width` (cached by spec); a 400 naming the field for
    a constraint llguidance cannot honour (an unsupported schema keyword, an invalid regex...)."""
    if tokenizer is None:
        raise InvalidRequestError(f"{c.param}: structured output needs a tokenizer; this model serves token ids "
                                  "only", param=c.param)
    return vocabulary(tokenizer, width).compile(c)


def matcher_for(c: Constraint, tokenizer, width: int, grammar: Grammar | None = None) -> Matcher:
    """A request's matcher: from `grammar` where it was compiled for this vocabulary (the daemon
    compiles off the engine thread), else compiled now (an adapter replaced meanwhile, a library
    caller)."""
    if grammar is None or tokenizer is None or grammar.vocabulary is not vocabulary(tokenizer, width):
        grammar = compile(c, tokenizer, width)
    return grammar.matcher()


def apply_masks(logits: torch.Tensor, rows: list[tuple[int, Matcher]]) -> list[int]:
    """Set to -inf, in place, each listed row's logits of the tokens its matcher forbids; logits
    [S, V] float32; `rows` (row, matcher). Returns the rows masked."""
    V = logits.shape[1]
    words = max([(V + 31) // 32] + [m.vocabulary.words for _, m in rows])
    bits = np.zeros((len(rows), words), dtype=np.int32)
    for i, (_, m) in enumerate(rows):
        m.fill(bits[i])
    at = [r for r, _ in rows]
    (_apply_on_host if logits.device.type == "cpu" else apply_on_device)(logits, bits, at)
    return at


def _apply_on_host(logits: torch.Tensor, bits: np.ndarray, at: list[int]) -> None:
    """Each mask byte's 8 addends (0 or -inf) looked up, then added to its row: one lookup and one
    add for every row (the rows are distinct)."""
    host, V = logits.numpy(), logits.shape[1]
    host[at] += _ADDENDS[bits.view(np.uint8)].reshape(len(at), -1)[:, :V]


def apply_on_device(logits: torch.Tensor, bits: np.ndarray, at: list[int]) -> None:
    """The bits unpacked by shifts where the logits are (a GPU's path; any device runs it)."""
    dev, V = logits.device, logits.shape[1]
    t = torch.from_numpy(bits).to(dev)
    shifts = torch.arange(32, device=dev, dtype=torch.int32)
    allowed = ((t[:, :, None] >> shifts) & 1).reshape(len(at), -1)[:, :V].bool()
    idx = torch.tensor(at, device=dev)
    logits.index_copy_(0, idx, logits.index_select(0, idx).masked_fill(~allowed, float("-inf")))
