"""Chat templates as Hugging Face renders them: jinja2's immutable sandbox with trim_blocks and
lstrip_blocks, loop controls, a `tojson` that keeps non-ASCII and HTML as is, `raise_exception`
and `strftime_now`; the template found in `chat_template.jinja`, `tokenizer_config.json` or
`chat_template.json`."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from lorafleet.errors import InvalidRequestError, ModelLoadError


def _read_json(path: Path) -> dict:
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


def _find_chat_template(folder: Path, cfg: dict) -> tuple[str | None, str]:
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
    if (template := _pick_template(_read_json(json_path).get("chat_template"))) is not None:
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


@lru_cache(maxsize=1)
def _jinja_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    # Sandboxed and immutable: templates come from downloaded model folders.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _compile_template(source_text: str, source: str) -> jinja2.Template:
    try:
        return _jinja_env().from_string(source_text)
    except jinja2.TemplateError as e:
        raise ModelLoadError(f"{source}: chat template does not compile: {e}") from e


def _check_messages(messages: Any) -> list[dict]:
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
