"""Typed errors. Every error a user can cause is a `LorafleetError` whose message names the
problem; each class carries the HTTP status the server answers with and the CLI exit code.

Invariants raise (asserts, our bugs); boundaries answer (these classes, the user's input).
"""

from __future__ import annotations

import reprlib

SHOWN_CHARS = 64  # of a client's value quoted in a message (`shown`)
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = SHOWN_CHARS
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4
_REPR.maxlevel = 3


def shown(value: object) -> str:
    """A client's value as a message quotes it: its repr, but of a long string only the first
    SHOWN_CHARS characters, then "…" and its length (an error must not echo a 200,000-character
    name back whole); other values bounded the same way (`reprlib`, then cut)."""
    if isinstance(value, str):
        if len(value) <= SHOWN_CHARS:
            return repr(value)
        return f"{value[:SHOWN_CHARS]!r}… ({len(value)} characters)"
    text = _REPR.repr(value)
    return text if len(text) <= 2 * SHOWN_CHARS else text[:2 * SHOWN_CHARS] + "…"


class LorafleetError(Exception):
    """Base of every error lorafleet raises on purpose."""

    http_status = 500
    exit_code = 1
    code = "internal_error"
    param: str | None = None  # the request field at fault, where one is (OpenAI's error body's `param`)

    def __init__(self, *args, param: str | None = None):
        super().__init__(*args)
        if param is not None:
            self.param = param


class ConfigError(LorafleetError):
    """A setting, config file or constructor argument is invalid."""

    http_status = 400
    code = "invalid_config"


class UnsupportedModelError(LorafleetError):
    """The model folder names an architecture or feature lorafleet does not serve."""

    http_status = 400
    code = "unsupported_model"


class ModelLoadError(LorafleetError):
    """A model folder is missing files, or its weights are truncated, malformed or mismatched."""

    http_status = 400
    code = "model_load_error"


class SelfCheckError(LorafleetError):
    """The served kernels disagree with the torch reference on the same weights at start
    (`engine/selfcheck.py`): the message names the kernels and the difference."""

    code = "self_check_failed"


class InvalidRequestError(LorafleetError):
    """A request is malformed: bad sampling values, prompt too long, empty prompt..."""

    http_status = 400
    code = "invalid_request_error"


class AdapterError(LorafleetError):
    """An adapter was refused: bad format, incompatible with the base, unreadable file."""

    http_status = 400
    code = "invalid_adapter"


class AdapterNotFoundError(AdapterError):
    """No adapter is registered under that name."""

    http_status = 404
    code = "adapter_not_found"
    adapter: str | None = None  # which one, where known (a mix names several)


class AdapterInUseError(AdapterError):
    """The adapter is used by a running or waiting request and cannot be unloaded now."""

    http_status = 409
    code = "adapter_in_use"


class AdapterTooLargeError(AdapterError):
    """The adapter needs more pages than the whole pool has: no retry can succeed."""

    http_status = 400
    code = "adapter_too_large"


class PoolExhaustedError(LorafleetError):
    """The unified page pool cannot hold what was asked now (running requests hold the rest);
    retrying later can succeed."""

    http_status = 503
    code = "pool_exhausted"


class RequestFailedError(LorafleetError):
    """The engine could not finish this request (its logits were not finite, its output could
    not be processed); other requests were not affected."""

    code = "request_failed"


class RequestNotFoundError(LorafleetError):
    """No request with that id is known to the engine."""

    http_status = 404
    code = "request_not_found"


# -- the daemon and its clients ----------------------------------------------------------------

class QueueFullError(LorafleetError):
    """The daemon holds as many requests as it admits (`--max-pending`); retry later."""

    http_status = 429
    code = "queue_full"


class ShuttingDownError(LorafleetError):
    """The daemon is draining its in-flight requests before it exits; it takes no new ones."""

    http_status = 503
    code = "shutting_down"


class UnauthorizedError(LorafleetError):
    """A TCP request without the daemon's API key (`Authorization: Bearer KEY`)."""

    http_status = 401
    code = "invalid_api_key"


class DaemonRunningError(LorafleetError):
    """Another daemon already serves on that socket."""

    code = "daemon_running"


class DaemonUnreachableError(LorafleetError):
    """No daemon answers on the socket."""

    http_status = 503
    exit_code = 3
    code = "daemon_unreachable"


class DaemonStartingError(DaemonUnreachableError):
    """A daemon holds the socket's pid file but does not answer yet: it is loading its model (and,
    on a machine's first start, building the CPU kernels)."""

    code = "daemon_starting"

    def __init__(self, message: str, pid: int):
        super().__init__(message)
        self.pid = pid


class StoreError(LorafleetError):
    """A store operation was refused: a bad name, a missing item, an inconsistent file."""

    http_status = 400
    code = "store_error"


class StoreNotFoundError(StoreError):
    http_status = 404
    code = "not_in_store"


class HubError(LorafleetError):
    """A pull from the Hugging Face Hub failed: repo or revision not found, gated, unreachable,
    no loadable files, or a downloaded file that does not match the Hub's checksum."""

    http_status = 400
    code = "hub_error"


class ServerError(LorafleetError):
    """An error the daemon answered with, as the client sees it: the daemon's status, code and
    message."""

    def __init__(self, message: str, http_status: int = 500, code: str = "internal_error",
                 param: str | None = None):
        super().__init__(message)
        self.http_status = http_status
        self.code = code
        self.param = param
