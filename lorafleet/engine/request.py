"""A request's parameters, its state while the engine works on it, and what it hands back."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lorafleet.errors import InvalidRequestError
from lorafleet.adapters.mix import Mix
from lorafleet.model.grammar import Constraint

if TYPE_CHECKING:
    from lorafleet.model.grammar import Matcher
    from lorafleet.model.tokenizer import IncrementalDecoder

# Below this a temperature is greedy (as in vLLM): dividing logits by a smaller one overflows the
# softmax (1e-300 gives inf/NaN probabilities), and no sampled distribution differs from argmax.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """What to generate. temperature 0 (or below MIN_TEMPERATURE) is greedy; top_k 0 or -1, top_p 1 and
    min_p 0 disable those filters (min_p as vLLM's: tokens less likely than min_p times the most
    likely one are dropped); `logprobs` = N returns the N most likely tokens (plus the chosen one)
    per step."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    structured: Constraint | None = None  # structured output: what the text must match (`model/grammar.py`)

    def __post_init__(self):
        # lists are welcome at the boundary; stored as tuples so params stay hashable/frozen
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        def bad(msg):
            raise InvalidRequestError(f"SamplingParams: {msg}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            bad(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        if self.structured is not None and not isinstance(self.structured, Constraint):
            bad(f"structured must be a grammar.Constraint, got {type(self.structured).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity, not field equality: requests are tracked by object
class Request:
    """One sequence. `token_ids` = prompt + generated so far; the engine has computed KV for the
    first `num_computed` of them. Preemption resets `num_computed` to 0 (recompute)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None   # the one adapter it names (the API's `model`), or None
    mix: Mix | None = None       # or the adapters it mixes, with their scales (the API's `adapters`)
    arrival_time: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at admission
    finish_reason: str | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    text: str = ""
    detokenizer: IncrementalDecoder | None = None
    eos_token_ids: frozenset | None = None  # its stop tokens where its adapter has its own tokenizer (else the engine's)
    loras: tuple = ()    # each adapter's memory.entry.AdapterEntry: acquired at arrival, released at the end
    scales: tuple[float, ...] = ()  # each one's scale (1.0 for `adapter`)
    activation: int | None = None  # an aLoRA's: the position its adapter applies from (`adapters/alora.py`)
    emitted: int = 0  # characters of text already streamed out (see engine/output.py)
    emitted_tokens: int = 0  # output tokens (and their logprobs) already handed out
    first_scheduled_time: float | None = None
    adapter_blocked_since: float | None = None  # skipped only because its adapter was not ready
    adapter_wait: float = 0.0                    # exposed adapter-load time, seconds
    adapter_cold: bool = False                   # its adapter was not on the device when it arrived
    deadline: float | None = None                # monotonic time after which it is aborted
    _lora_key: tuple | None = field(default=None, repr=False)  # (loras, lora_key) as last computed
    num_pending: int = 0   # tokens drawn on the device, not read yet (`Engine._launch`: async_decode)
    pending_row: int = -1  # the newest one's row among its step's drawn tokens
    matcher: Matcher | None = None  # structured output: its place in its grammar (advanced by each token appended)
    error: str | None = None
    error_code: str | None = None                # the LorafleetError code of `error`
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the adapters it uses (none for the base)."""
        return self.mix.names if self.mix is not None else (self.adapter,) if self.adapter is not None else ()

    @property
    def label(self) -> str | None:
        """Its adapter's name, its mix's label (`a+b*0.5`), or None for the base."""
        return self.mix.label if self.mix is not None else self.adapter

    @property
    def lora_key(self) -> tuple:
        """What decides its LoRA rows: its adapters' entries and their scales. Kept while its
        `loras` are the same tuple (the runner orders and segments every step by it)."""
        cached = self._lora_key
        if cached is None or cached[0] is not self.loras:
            cached = self._lora_key = (self.loras, tuple((e.name, e.uid, s) for e, s in zip(self.loras, self.scales)))
        return cached[1]

    @property
    def num_tokens(self) -> int:
        """Its tokens: prompt, output, and those drawn but not read yet (`num_pending`)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known(self) -> int:
        """Its tokens the host has: prompt and output, not those drawn and not read yet."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def input_ids(self, start: int, end: int) -> list[int]:
        """The ids of positions [start, end) as a step's input: a position whose token is drawn
        but not read yet (the last one) as -1 - its row among its step's drawn tokens, which the
        runner replaces on the device (`fill_pending`)."""
        known = self.num_known
        if end <= known:
            return self.token_at(start, end)
        return self.token_at(start, known) + [-1 - self.pending_row]

    def token_at(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:  # decode: no copy of the whole sequence
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]


@dataclass(slots=True)
class RequestOutput:
    """One step's news about a request: what it added, and the whole answer once it has ended.

    Deltas, on every output (the final one included): `new_token_ids`, `new_text` and
    `new_logprobs` (one dict per new token; None when logprobs were not asked for) are what this
    output adds to the ones before it, so over a request's outputs each concatenates to its whole.
    The whole, on the final output only (`finished`: any end, abort and error included):
    `token_ids`, `text` and `logprobs` (None when not asked for), and `metrics`; None on every
    other output, so that a step never copies an answer so far (a long answer would cost O(n^2)).
    A consumer that needs the answer while it grows adds up the deltas."""

    request_id: str
    prompt_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    adapter: str | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[dict[int, float]] | None = None
    token_ids: list[int] | None = None               # the final output's: every generated id
    text: str | None = None                          # the final output's: the whole text
    logprobs: list[dict[int, float]] | None = None   # the final output's, when asked for
    error: str | None = None          # why it ended, when finish_reason is "error"
    error_code: str | None = None     # its kind: "invalid_adapter" (a load failed) or "request_failed"
    metrics: dict | None = None       # when finished: queue_s, adapter_wait_s, ttft_s, tpot_s...


def prompt_ids(prompt, tokenizer, vocab: int, model_path) -> list[int]:
    """A prompt's token ids: a string encoded by `tokenizer` (None: refused), or ids checked to
    be integers in [0, vocab); InvalidRequestError naming what is wrong."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError(f"{model_path} has no tokenizer.json: pass token ids")
        ids = tokenizer.encode(prompt)
    else:
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise InvalidRequestError("prompt must be a string or a list of token ids") from None
        if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise InvalidRequestError("prompt token ids must be integers")
    if not ids:
        raise InvalidRequestError("prompt is empty")
    if min(ids) < 0 or max(ids) >= vocab:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
    return ids
