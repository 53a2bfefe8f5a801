"""Activated LoRA (aLoRA, PEFT's `alora_invocation_tokens`, peft >= 0.17): an adapter whose LoRA
applies only from the start of the last occurrence of its invocation token sequence in the prompt
onward, and to every generated token; the tokens before it run as the base, so their KV is the
base's (`memory/kv.py` keys those blocks as the base's).

PEFT's rules, mirrored (peft 0.22, `tuners/lora/variants.py`: `ALoraLinearVariant`,
`calculate_alora_offsets`; `tuners/lora/layer.py`: `resolve_lora_variant`):

* aLoRA is a variant of LoRA on linear layers that combines with no other variant: `use_dora`
  (or any other variant, which lorafleet refuses anyway) is refused, and so is a LoRA on the
  embedding (PEFT's `Embedding` has no aLoRA variant). lora_bias, use_rslora, rank_pattern and
  alpha_pattern combine (the bias is lora_B's: masked with it), and a LoRA on the LM head is
  masked like any linear layer.
* `modules_to_save` is refused (lorafleet's rule): PEFT applies a saved module to every token,
  so the history would no longer be the base's, which is aLoRA's point and what the prefix
  cache's keys rely on.
* A null or empty `alora_invocation_tokens` is plain LoRA, as in PEFT (its variant is chosen by
  the field's truth).
* The activation: the start of the last occurrence of the sequence in the prompt (PEFT counts it
  back from the end; the same position). Generated tokens always use the adapter: PEFT computes
  the offset once from the prompt and every decode step is at or after it.
* A prompt without the sequence: PEFT serves the whole request as the base, generated tokens
  included. lorafleet refuses it (`InvalidRequestError` on `prompt`, naming the missing
  sequence) instead: that answer would come back under the adapter's name with the adapter never
  applied, which almost always means the prompt or its chat template lost the invocation; a
  caller who wants the base names the base.
"""

from __future__ import annotations

from pathlib import Path

from lorafleet.errors import AdapterError, InvalidRequestError
from lorafleet.adapters.heads import EMBED

FIELD = "alora_invocation_tokens"
MAX_INVOCATION_TOKENS = 256  # real invocation strings are a role marker of a few tokens


def invocation_tokens(cfg: dict) -> tuple[int, ...] | None:
    """The adapter's invocation sequence from its (checked) config; None: plain LoRA."""
    tokens = cfg.get(FIELD)
    return tuple(tokens) if tokens else None


def check_config(cfg: dict, source: Path) -> None:
    """The field's form and the options it combines with; AdapterError naming the field."""
    tokens = cfg.get(FIELD)
    if tokens is None or tokens == []:
        return
    if not (isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                for t in tokens)):
        raise AdapterError(f"{source}: {FIELD}: must be a list of token ids (non-negative integers)")
    if len(tokens) > MAX_INVOCATION_TOKENS:
        raise AdapterError(f"{source}: {FIELD}: at most {MAX_INVOCATION_TOKENS} token ids")
    if cfg.get("use_dora"):
        raise AdapterError(f"{source}: use_dora: DoRA cannot be combined with aLoRA ({FIELD}); PEFT has no "
                           "variant that is both")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{source}: modules_to_save: not supported with aLoRA ({FIELD}): a saved module "
                           "applies to every token, so the tokens before the invocation would not run as the base")


def check_base(cfg: dict, heads: set[str], vocab_size: int, source: Path) -> None:
    """Against the base: its invocation tokens in the base's vocabulary, no LoRA on its embedding."""
    tokens = invocation_tokens(cfg)
    if tokens is None:
        return
    if max(tokens) >= vocab_size:
        raise AdapterError(f"{source}: {FIELD}: every token id must be below the base's vocabulary size "
                           f"({vocab_size})")
    if EMBED in heads:
        raise AdapterError(f"{source}: target_modules: selects 'embed_tokens', which aLoRA ({FIELD}) cannot "
                           "adapt (PEFT serves aLoRA on linear layers only)")


def activation(prompt: list[int], tokens: tuple[int, ...]) -> int | None:
    """The position where the last occurrence of `tokens` in `prompt` starts; None: it does not occur."""
    n, first = len(tokens), tokens[0]
    for start in range(len(prompt) - n, -1, -1):
        if prompt[start] == first and tuple(prompt[start:start + n]) == tokens:
            return start
    return None


def request_activation(members, prompt: list[int]) -> int | None:
    """Where a request's adapters take over: `members` its (entry, scale) pairs, an entry's
    `invocation` its aLoRA sequence (None: plain). None: from its first token (no aLoRA member
    at a nonzero scale; a mix only holds one alone at scale 1: `engine/mixes.py`).
    InvalidRequestError (on `prompt`) when the prompt lacks an aLoRA member's sequence."""
    for entry, scale in members:
        tokens = entry.invocation
        if tokens is None or scale == 0.0:
            continue
        at = activation(prompt, tokens)
        if at is None:
            raise InvalidRequestError(
                f"prompt: adapter {entry.name!r} is an activated LoRA: the prompt must contain its invocation "
                f"sequence {list(tokens)} ({FIELD}); it applies from that sequence's last occurrence on",
                param="prompt")
        return at
    return None
