"""OpenAI's error body for every refusal: {"error": {"message", "type", "param", "code"}}, with
the HTTP status the LorafleetError class names. Rendered ASCII-only, so that no message (it may
quote a client's value) can fail to encode and take the connection down with it."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from lorafleet.errors import LorafleetError


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(e: LorafleetError) -> dict:
    return {"error": {"message": str(e), "type": error_type(e.http_status),
                      "param": getattr(e, "param", None), "code": e.code}}


class ErrorResponse(JSONResponse):
    def __init__(self, e: LorafleetError, headers: dict | None = None):
        super().__init__(error_body(e), status_code=e.http_status, headers=headers)

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")
