"""Typed errors. Every error a user can cause is a `LorafleetError` whose message names the
problem; each class carries the HTTP status the server answers with and the CLI exit code.

Invariants raise (asserts, our bugs); boundaries answer (these classes, the user's input).
"""

from __future__ import annotations


class LorafleetError(Exception):
    """Base of every error lorafleet raises on purpose."""

    http_status = 500
    exit_code = 1
    code = "internal_error"


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


class AdapterInUseError(AdapterError):
    """The adapter is used by a running or waiting request and cannot be unloaded now."""

    http_status = 409
    code = "adapter_in_use"


class PoolExhaustedError(LorafleetError):
    """The unified page pool cannot hold what was asked, even when everything idle is evicted."""

    http_status = 503
    code = "pool_exhausted"


class RequestNotFoundError(LorafleetError):
    """No request with that id is known to the engine."""

    http_status = 404
    code = "request_not_found"
