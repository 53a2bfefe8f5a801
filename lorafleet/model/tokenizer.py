"""Tokenizer: text <-> ids and chat templates for a Hugging Face model folder, without transformers.

`tokenizer.json` (the `tokenizers` serialization) is the source of truth for encoding, so
`encode(text)` gives the ids `transformers.AutoTokenizer.from_pretrained(folder)(text)` gives:
its post-processor adds the BOS where the model wants one. The side files add what tokenizer.json
does not hold: the chat template, the named special tokens and the ids that end generation.

Chat templates are rendered the way transformers renders them (same Jinja settings, filters and
globals), so a prompt built here is byte-for-byte the prompt the model was tuned on.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from lorafleet.errors import InvalidRequestError, ModelLoadError
from lorafleet.model.chat_template import (RenderBoundError, check_messages, compile_template, find_chat_template,
                                           read_json, render_bounded)

# The named special tokens transformers passes to every chat template (when set).
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Decoded text ending in this is an unfinished UTF-8 sequence (or, rarely, a real U+FFFD).
_REPLACEMENT = "\ufffd"
# A text's size is checked against the context before it is encoded, by the longest token's bytes
# with this floor: no real token is longer, so no text that fits is refused.
MIN_BYTES_PER_TOKEN = 64


class Tokenizer:
    """A loaded tokenizer. Immutable after construction, so one instance serves every request."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: dict[str, str | None] | None = None,
        eos_token_ids: Iterable[int] = (),
        source: str = "<memory>",
    ):
        """`backend` is used as is (callers add any missing special tokens first); `special_tokens`
        maps names from `_NAMED_TOKENS` to token strings; `eos_token_ids` adds to the id of
        `eos_token`; `source` names where the template came from in error messages."""
        self._backend = backend
        self._special = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._bos_id = self._named_id("bos_token")
        self._pad_id = self._named_id("pad_token")
        eos_id = self._named_id("eos_token")
        self._eos_ids = frozenset(eos_token_ids) | ({eos_id} if eos_id is not None else set())
        # Highest id + 1, not the count: added tokens may leave gaps, and callers size logits by it.
        self._vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self._template_text = chat_template
        self._template = compile_template(chat_template, source) if chat_template is not None else None

    def _named_id(self, name: str) -> int | None:
        token = self._special.get(name)
        return self.token_to_id(token) if token is not None else None

    # -- loading ---------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> Tokenizer:
        """Load `folder/tokenizer.json` plus the optional tokenizer_config.json, chat_template.jinja,
        chat_template.json, config.json and generation_config.json. Raises `ModelLoadError`, naming
        the file, when tokenizer.json is missing or any of these files is malformed."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: tokenizer.json not found in the model folder")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for any parse error
            raise ModelLoadError(f"{path}: malformed tokenizer.json: {e}") from e
        # Encoding one prompt never pads or truncates; the engine enforces lengths itself.
        json_pad = (backend.padding or {}).get("pad_token")
        backend.no_padding()
        backend.no_truncation()

        cfg_path = folder / "tokenizer_config.json"
        cfg = read_json(cfg_path)
        special = {name: _token_str(cfg.get(name)) for name in _NAMED_TOKENS}
        special["pad_token"] = special["pad_token"] or json_pad
        _add_missing_tokens(backend, cfg, special, cfg_path)
        _add_bos_eos_if_no_post_processor(backend, cfg, special)

        eos_ids: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            eos_ids |= _eos_ids(folder / name)

        template, source = find_chat_template(folder, cfg)
        return cls(
            backend, chat_template=template, special_tokens=special, eos_token_ids=eos_ids, source=source
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer | None:
        """The tokenizer a GGUF model file's metadata describes (`model.gguf_tokenizer.tokenizer_parts`: its
        vocabulary, merges or scores, special tokens, BOS/EOS and chat template), None when the file
        has none. Raises `UnsupportedModelError` for a tokenizer kind lorafleet does not read."""
        from lorafleet.model.gguf import GGUFFile
        from lorafleet.model.gguf_tokenizer import tokenizer_parts

        f = GGUFFile(path)
        parts = tokenizer_parts(f)
        if parts is None:
            return None
        backend, cfg = parts
        special = {name: _token_str(cfg.get(name)) for name in _NAMED_TOKENS}
        return cls(backend, chat_template=cfg.get("chat_template"), special_tokens=special,
                   eos_token_ids=f.eos_token_ids, source=f"{path} (tokenizer.chat_template)")

    # -- properties ------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """One past the highest id the tokenizer knows, added tokens included."""
        return self._vocab_size

    @property
    def bos_token(self) -> str | None:
        return self._special.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: `eos_token` and the model/generation configs' ids."""
        return self._eos_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_id

    @property
    def chat_template(self) -> str | None:
        """The Jinja source of the chat template, or None when the model has none."""
        return self._template_text

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes any one token's text takes (at least MIN_BYTES_PER_TOKEN): text longer
        than `max_model_len` times this cannot fit the context, whatever it encodes to."""
        vocab = self._backend.get_vocab(with_added_tokens=True)
        return max(MIN_BYTES_PER_TOKEN, max((len(t.encode("utf-8")) for t in vocab), default=0))

    def max_text_bytes(self, max_model_len: int) -> int:
        """The longest text (in UTF-8 bytes) that could encode to at most `max_model_len` tokens."""
        return max_model_len * self.max_token_bytes

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (what a grammar engine reads its vocabulary from)."""
        return self._backend.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    # -- text <-> ids ----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids for `text`; with `add_special_tokens` the post-processor adds what the model expects
        around a sequence (usually the BOS), exactly once."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for `ids`. No "clean up tokenization spaces" pass: it is wrong for BPE, and it
        would make streamed text differ from the final text."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def incremental_decoder(
        self, skip_special_tokens: bool = True, context_ids: Sequence[int] = ()
    ) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens, context_ids=context_ids)

    # -- chat ------------------------------------------------------------------------------------

    def chat_variables(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> dict:
        """The variables the chat template renders `messages` with; `extra` adds template variables
        (`tools=[...]`, `enable_thinking=False`...). Raises `InvalidRequestError` when the model has
        no template or the messages are malformed."""
        if self._template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead")
        return {
            **self._special,
            "tools": None,  # defined, as transformers does, so `tools is none` tests work
            "documents": None,
            **extra,
            "messages": check_messages(messages),
            "add_generation_prompt": add_generation_prompt,
        }

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        max_chars: int | None = None,
        **extra: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's chat template, in this thread; the text, or its ids
        when `tokenize` (the daemon renders in processes of its own: `server/renders.py`).

        Raises `InvalidRequestError` as `chat_variables` does, when the template refuses the
        messages (its `raise_exception`, or any failure while rendering), and when the render passes
        `max_chars` characters or its time bound (`chat_template.render_bounded`)."""
        variables = self.chat_variables(messages, add_generation_prompt, **extra)
        assert self._template is not None  # chat_variables refuses a model without one
        try:
            text = render_bounded(self._template, variables, max_chars)
        except InvalidRequestError:
            raise
        except RenderBoundError as e:
            raise InvalidRequestError(str(e)) from None
        except Exception as e:  # the template is foreign code: any failure means "these messages don't fit"
            message = f"chat template failed on these messages: {type(e).__name__}: {e}"
            raise InvalidRequestError(message) from e
        # The template already wrote every special token the model needs; adding them again would
        # double the BOS.
        return self.encode(text, add_special_tokens=False) if tokenize else text


class IncrementalDecoder:
    """Streams text as ids arrive: `step(id)` returns the new text, `flush()` whatever is held back.

    Concatenating every `step` result and then `flush()` gives the text the ids add after
    `context_ids` (with no context: exactly `tokenizer.decode(ids)`). Text is held back while the
    decoded tail ends in U+FFFD, i.e. a multi-byte character split across tokens, so characters
    come out whole.

    Each step decodes a short window, never the whole sequence: a few tokens already emitted
    (the prefix) plus the tokens not yet complete, and returns what the window's text gained past
    the prefix's. The prefix is there because decoders render a token differently at the start of
    a sequence (SentencePiece's drop its leading space); it is several tokens long so that a
    skipped special token alone cannot be the whole of it.
    """

    _PREFIX = 4  # tokens of context kept in the window
    _MAX_WINDOW = 32  # past this, the tail is garbage bytes that will never complete

    def __init__(
        self, tokenizer: Tokenizer, skip_special_tokens: bool = True, context_ids: Sequence[int] = ()
    ):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Invariant: the first `_emitted` characters of the window's text are accounted for
        # (the prefix's text, plus every delta returned since).
        self._ids = list(context_ids[-self._PREFIX :]) if context_ids else []
        self._emitted = len(self._decode(self._ids))

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def step(self, token_id: int) -> str:
        """Feed one id; return the text it completes (often "", never a split character)."""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        # A trailing U+FFFD may still become a character, everything before it is final.
        final = len(text.rstrip(_REPLACEMENT))
        delta = text[self._emitted : final]
        self._emitted = max(self._emitted, final)
        if final == len(text):
            if len(self._ids) > self._PREFIX:  # all emitted: the last tokens become the prefix
                self._ids = self._ids[-self._PREFIX :]
                self._emitted = len(self._decode(self._ids))
        elif len(self._ids) > self._MAX_WINDOW:
            # Invalid bytes that never complete: emit the head as it is (U+FFFD included) and
            # keep the last tokens, which hold any character still unfinished (<= 3 bytes). Only
            # when dropping the head shortens the text from the front, or `_emitted` is lost.
            keep = self._ids[-self._PREFIX :]
            head = len(text) - len(kept := self._decode(keep))
            if text.endswith(kept):
                delta += text[self._emitted : head]
                self._emitted = max(self._emitted, head) - head
                self._ids = keep
        return delta

    def flush(self) -> str:
        """The held-back tail (a character the ids left unfinished, as U+FFFD); call once at the end."""
        text = self._decode(self._ids)
        delta = text[self._emitted :]
        self._emitted = len(text)
        return delta


# -- loading helpers -----------------------------------------------------------------------------


def _token_str(value: Any) -> str | None:
    """A token as tokenizer_config.json writes it: a string, or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _added_token(value: Any) -> tokenizers.AddedToken | None:
    """An AddedToken from an `added_tokens_decoder` entry, keeping its flags."""
    if not (isinstance(value, dict) and isinstance(value.get("content"), str)):
        return None
    flags = ("single_word", "lstrip", "rstrip", "normalized", "special")
    return tokenizers.AddedToken(value["content"], **{k: bool(value[k]) for k in flags if k in value})


def _add_missing_tokens(
    backend: tokenizers.Tokenizer, cfg: dict, special: dict[str, str | None], path: Path
) -> None:
    """Register the config's tokens that tokenizer.json lacks as added tokens, as transformers does,
    so a `<|im_end|>` in the text encodes to its one id rather than to its pieces."""
    decoder = cfg.get("added_tokens_decoder") or {}
    try:  # lowest id first: a token missing from the vocab takes the next free id
        entries = [v for _, v in sorted(decoder.items(), key=lambda kv: int(kv[0]))]
    except (AttributeError, ValueError) as e:
        raise ModelLoadError(f"{path}: added_tokens_decoder must map ids to tokens: {e}") from e
    extras = cfg.get("additional_special_tokens") or cfg.get("extra_special_tokens") or []
    named = [special.get(name) for name in _NAMED_TOKENS]
    named += [_token_str(t) for t in extras] if isinstance(extras, list) else []
    wanted = [_added_token(v) for v in entries]
    wanted += [tokenizers.AddedToken(t, special=True, normalized=False) for t in named if t]
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    for token in wanted:
        if token is not None and token.content not in present:
            present.add(token.content)
            (backend.add_special_tokens if token.special else backend.add_tokens)([token])


def _add_bos_eos_if_no_post_processor(backend: tokenizers.Tokenizer, cfg: dict, special: dict) -> None:
    """A tokenizer.json without a post-processor cannot add the BOS that `add_bos_token: true`
    asks for; give it one that does, as the Llama tokenizer classes do. When tokenizer.json has a
    post-processor, it is authoritative and these flags are ignored, as transformers ignores them."""
    if backend.post_processor is not None:
        return
    wanted = [(special.get("bos_token") if cfg.get("add_bos_token") else None),
              (special.get("eos_token") if cfg.get("add_eos_token") else None)]
    bos, eos = (t if t is not None and backend.token_to_id(t) is not None else None for t in wanted)
    if bos is None and eos is None:
        return

    def pieces(sequence: str, type_id: int) -> list[str]:
        return [f"{t}:{type_id}" for t in (bos, sequence, eos) if t is not None]

    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single=" ".join(pieces("$A", 0)),
        pair=" ".join(pieces("$A", 0) + pieces("$B", 1)),
        special_tokens=[(t, backend.token_to_id(t)) for t in (bos, eos) if t is not None],
    )


def _eos_ids(path: Path) -> set[int]:
    """`eos_token_id` of a config file (an int, a list of ints, or absent)."""
    value = read_json(path).get("eos_token_id")
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelLoadError(f"{path}: eos_token_id must be an id or a list of ids, got {value!r}")
    return set(values)
