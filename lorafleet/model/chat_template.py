"""Chat templates as Hugging Face renders them: jinja2's immutable sandbox with trim_blocks and
lstrip_blocks, loop controls, a `tojson` that keeps non-ASCII and HTML as is, `raise_exception`
and `strftime_now`; the template found in `chat_template.jinja`, `tokenizer_config.json` or
`chat_template.json`."""

from __future__ import annotations

import ctypes
import json
import threading
import time
from collections.abc import Sized
from datetime import datetime
from functools import lru_cache, wraps
from pathlib import Path
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from lorafleet.errors import InvalidRequestError, ModelLoadError


def read_json(path: Path) -> dict:
    """The JSON object in `path`, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: malformed JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _pick_template(value: Any) -> str | None:
    """A template as configs store it: a string, or a list of {name, template} (we use "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default":
                return entry.get("template") if isinstance(entry.get("template"), str) else None
    return None


def find_chat_template(folder: Path, cfg: dict) -> tuple[str | None, str]:
    """The chat template and the file it came from. Same priority as transformers: the separate
    .jinja file wins over tokenizer_config.json; chat_template.json (a processor file) comes last."""
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        try:
            return jinja_path.read_text(encoding="utf-8"), str(jinja_path)
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{jinja_path}: unreadable chat template: {e}") from e
    if (template := _pick_template(cfg.get("chat_template"))) is not None:
        return template, str(folder / "tokenizer_config.json")
    json_path = folder / "chat_template.json"
    if (template := _pick_template(read_json(json_path).get("chat_template"))) is not None:
        return template, str(json_path)
    return None, ""


# -- chat templates ------------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    """Templates call this to refuse a conversation (e.g. roles that don't alternate)."""
    raise InvalidRequestError(f"chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# -- bounded rendering -----------------------------------------------------------------------------
# A template is foreign code that renders on the server's threads: its time and output are bounded,
# so a hostile one fails its own request with a 400 instead of holding a thread, a core or memory.

RENDER_TIMEOUT_S = 1.0  # real templates render in milliseconds; a render past this is refused


class RenderBoundError(Exception):
    """A render went past its time or size bound (the message names which)."""


_bounds = threading.local()  # the running render's output bound, for the operators below


def _limit() -> int | None:
    return getattr(_bounds, "max_chars", None)


def _check_size(size: int, what: str) -> None:
    limit = _limit()
    if limit is not None and size > limit:
        raise RenderBoundError(f"the chat template's {what} would be {size:,} characters, over the "
                               f"{limit:,} this request's context can hold")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


def _check_ints(args: tuple, kwargs: dict) -> None:
    """Widths and counts (`ljust`, `center`, `indent`...) past the bound would allocate in one call."""
    limit = _limit()
    for v in (*args, *kwargs.values()):
        if limit is not None and isinstance(v, int) and not isinstance(v, bool) and abs(v) > limit:
            raise RenderBoundError(f"the chat template passed {v:,} to a function, over the {limit:,} "
                                   "characters this request's context can hold")


def _bounded_filter(f):
    @wraps(f)  # its __dict__ too: jinja's pass_context / pass_environment marker
    def bounded(*args, **kwargs):
        _check_ints(args[1:], kwargs)  # args[0] is the value (or the context / environment)
        result = f(*args, **kwargs)
        _check_size(_size(result), "filter result")
        return result
    return bounded


class _BoundedCodeGenerator(jinja2.compiler.CodeGenerator):
    """`a ~ b` joins through the environment, so that its size is checked before it is built; and
    only literal text is computed at compile time (Jinja folds constant output expressions),
    everything else at render time, within the render's bounds."""

    def _output_child_to_const(self, node, frame, finalize):
        if not isinstance(node, jinja2.nodes.TemplateData):
            raise jinja2.nodes.Impossible()
        return super()._output_child_to_const(node, frame, finalize)

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox, with `*`, `+`, `**`, `~` and calls checked against the render's bound
    before they allocate (the sandbox's `range` is already capped)."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "+", "**"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, Sized) and _size(seq) and isinstance(n, int):
                    _check_size(_size(seq) * max(n, 0), "repetition")
        elif operator == "+":
            _check_size(_size(left) + _size(right), "concatenation")
        elif operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise RenderBoundError(f"the chat template raises to the power {right:,}")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        if __obj is not jinja2.sandbox.safe_range:  # the sandbox caps range's length itself
            _check_ints(args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        _check_size(_size(result), "call result")
        return result

    def bounded_join(self, parts: tuple) -> str:
        parts = tuple(map(str, parts))
        _check_size(sum(map(len, parts)), "concatenation")
        return "".join(parts)


class _Deadline:
    """Raises RenderBoundError in the rendering thread once `seconds` pass, wherever it is in the
    template's Python code (a loop that writes nothing included), so the thread is freed rather
    than left spinning. Asynchronous exceptions are delivered between bytecodes only; the size
    checks keep any single C call (a repetition, a join) small."""

    def __init__(self, seconds: float):
        self.seconds, self._lock, self._done = seconds, threading.Lock(), False
        self._thread = threading.get_ident()
        self._timer: threading.Thread = threading.Timer(seconds, self._fire)  # a subclass's may be a Thread
        self._timer.daemon = True

    def _fire(self) -> None:
        with self._lock:
            if not self._done:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread),
                                                           ctypes.py_object(_RenderTimeout))

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._done = True
        assert isinstance(self._timer, threading.Timer)  # this class's own (a subclass's exit stops its thread)
        self._timer.cancel()


class CpuDeadline(_Deadline):
    """A deadline on the rendering thread's CPU time, watched every POLL_S, with `on_slow()` called
    once that time passes `slow_s`: a render process given little CPU is not refused for waiting
    (`template_worker`)."""

    POLL_S = 0.005

    def __init__(self, seconds: float, slow_s: float, on_slow):
        super().__init__(seconds)
        self._slow_s, self._on_slow, self._stop = slow_s, on_slow, threading.Event()
        self._clock = time.pthread_getcpuclockid(self._thread)
        self._timer = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        start, slow = time.clock_gettime(self._clock), True
        while not self._stop.wait(self.POLL_S):
            used = time.clock_gettime(self._clock) - start
            if slow and used > self._slow_s:
                slow = False
                self._on_slow()
            if used > self.seconds:
                self._fire()
                return

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._done = True
        self._stop.set()


class _RenderTimeout(RenderBoundError):
    pass


def render_bounded(template: jinja2.Template, variables: dict, max_chars: int | None,
                   deadline: _Deadline | None = None) -> str:
    """`template.render(**variables)`, streamed and counted: RenderBoundError once the output passes
    `max_chars` or the render passes its `deadline` (RENDER_TIMEOUT_S from now by default)."""
    deadline = deadline or _Deadline(RENDER_TIMEOUT_S)
    _bounds.max_chars, chunks, total = max_chars, [], 0
    try:
        with deadline:
            for chunk in template.generate(**variables):
                total += len(chunk)
                if max_chars is not None and total > max_chars:
                    raise RenderBoundError(f"the chat template's output passed {max_chars:,} characters, "
                                           "more than this request's context can hold")
                chunks.append(chunk)
    except _RenderTimeout:  # a late delivery lands here too, never outside this function
        raise RenderBoundError(f"the chat template took over {deadline.seconds:g} s to render") from None
    finally:
        _bounds.max_chars = None
    return "".join(chunks)


@lru_cache(maxsize=1)
def _jinja_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    # Sandboxed and immutable: templates come from downloaded model folders.
    # Not optimized: constant folding would run a template's constant expressions at compile time,
    # outside the render's bounds.
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], optimized=False
    )
    env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
    env.filters["tojson"] = _bounded_filter(_tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_template(source_text: str, source: str) -> jinja2.Template:
    try:
        return _jinja_env().from_string(source_text)
    except jinja2.TemplateError as e:
        raise ModelLoadError(f"{source}: chat template does not compile: {e}") from e


def check_messages(messages: Any) -> list[dict]:
    """Validated copies of `messages`: each a dict with a string `role` and a `content` that is a
    string, a list of content-part dicts, or absent/null on an assistant message with tool_calls.
    Keys holding None are dropped, as transformers drops them (templates test for presence)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object with role and content")
        if not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{i}].role must be a string")
        content = message.get("content")
        parts_ok = isinstance(content, list) and all(isinstance(p, dict) for p in content)
        if not (isinstance(content, str) or parts_ok or (content is None and message.get("tool_calls"))):
            raise InvalidRequestError(f"messages[{i}].content must be a string")
        checked.append({k: v for k, v in message.items() if v is not None})
    return checked
