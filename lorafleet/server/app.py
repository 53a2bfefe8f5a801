"""The HTTP app: OpenAI- and vLLM-compatible routes over one EngineWorker.

Routes: POST /v1/completions, /v1/chat/completions (completions.py); GET /v1/models,
/v1/models/{name}; POST /v1/load_lora_adapter, /v1/unload_lora_adapter (vLLM's bodies:
{"lora_name", "lora_path"}); POST /reset_prefix_cache (vLLM's: forget cached prefixes); GET
/v1/stats (JSON for `status` and `top`); GET /metrics (Prometheus); GET /health.

Every error is OpenAI's body, {"error": {"message", "type", "param", "code"}}, with the status
its LorafleetError class names (4xx for anything a client can cause). An unexpected exception
answers 500 with the same body and is logged; the daemon keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from lorafleet import __version__
from lorafleet.errors import AdapterError, LorafleetError, UnauthorizedError, shown
from lorafleet.memory.residency import check_name
from lorafleet.server import metrics
from lorafleet.server.completions import pull_hint, read_json, router as completions_router, state_of
from lorafleet.server.errors import ErrorResponse
from lorafleet.server.protocol import bad
from lorafleet.server.state import ServerState

log = logging.getLogger("lorafleet.server")


def require_key(request: Request) -> None:
    """On TCP, /v1 routes need `Authorization: Bearer KEY`; the socket is guarded by its mode."""
    st = state_of(request)
    server = request.scope.get("server")
    over_tcp = server is not None and server[1] is not None
    if not over_tcp or not st.config.api_key:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), st.config.api_key.encode()):
        raise UnauthorizedError("missing or wrong API key: send `Authorization: Bearer KEY`")


v1 = APIRouter(dependencies=[Depends(require_key)])
v1.include_router(completions_router)


async def on_engine(request: Request, fn):
    """Run `fn(engine)` on the engine thread between two steps."""
    return await asyncio.wrap_future(state_of(request).worker.call(fn))


def model_card(st: ServerState, name: str, adapter: dict | None) -> dict:
    card = {"id": name, "object": "model", "created": int(st.started), "owned_by": "lorafleet",
            "root": st.model_path if adapter is None else adapter.get("path"),
            "parent": None if adapter is None else st.base_name,
            "max_model_len": st.max_model_len}
    if adapter is not None:
        card["lorafleet"] = adapter
    return card


async def all_adapters(request: Request, st: ServerState) -> list[dict]:
    """The engine's adapters, then the store's that fit the served base and that the engine does not
    hold yet (`tier` "store": the resolver registers one on its first request)."""
    adapters = await on_engine(request, lambda engine: engine.list_adapters())
    resolver = st.worker.resolver
    if resolver is None:
        return adapters
    held = {a["name"] for a in adapters}
    stored = await asyncio.to_thread(resolver.available, st.model_path)
    return adapters + [a for a in stored if a["name"] not in held]


@v1.get("/v1/models")
async def list_models(request: Request):
    st = state_of(request)
    adapters = await all_adapters(request, st)
    cards = [model_card(st, st.base_name, None)] + [model_card(st, a["name"], a) for a in adapters]
    return {"object": "list", "data": cards}


@v1.get("/v1/models/{name:path}")
async def show_model(request: Request, name: str):
    st = state_of(request)
    if name == st.base_name:
        return model_card(st, name, None)
    for a in await all_adapters(request, st):
        if a["name"] == name:
            return model_card(st, name, a)
    e = LorafleetError(f"model {shown(name)} does not exist (GET /v1/models lists them){pull_hint(st, name)}")
    e.http_status, e.code, e.param = 404, "model_not_found", "model"
    raise e


def _lora_body(body, need_path: bool) -> tuple[str, str | None]:
    if not isinstance(body, dict):
        raise bad(None, "the body must be a JSON object like {\"lora_name\": ..., \"lora_path\": ...}")
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name:
        raise bad("lora_name", "lora_name must be a non-empty string")
    if need_path and (not isinstance(path, str) or not path):
        raise bad("lora_path", "lora_path must be a non-empty string: the adapter's folder on the daemon's machine")
    return name, path


@v1.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request):
    """Load (or, with {"lazy": true}, only register) a PEFT adapter under `lora_name`. Loading a
    name again with the same weights is a no-op; with new weights it replaces them once they are
    in the pool (the old ones serve until then, and finish the requests that use them). The
    files are read and hashed on a prefetch worker: running streams keep their pace."""
    st = state_of(request)
    body = await read_json(request)
    path: str | Path | None
    name, path = _lora_body(body, need_path=True)
    assert path is not None  # need_path
    if name == st.base_name:
        raise bad("lora_name", f"{name!r} is the base model's name; choose another adapter name")
    path = await asyncio.to_thread(st.worker.engine.adapter_folder, path)  # a GGUF adapter, converted once
    if isinstance(body, dict) and body.get("lazy") is True:
        # the files' checks on a worker (a config's patterns and a header are the file's to make
        # expensive), then only the bookkeeping on the engine thread
        check_name(name)
        inspected = await asyncio.to_thread(st.worker.engine.inspect_adapter, name, path)
        info = await on_engine(request, lambda engine: engine.register_adapter(name, path, inspected=inspected))
    else:
        info = await asyncio.wrap_future(await on_engine(request, lambda engine: engine.load_adapter_async(name, path)))
    log.info("adapter %s %s from %s", name, "loaded" if info["tier"] == "device" else "registered", path)
    return {"object": "lora_adapter", "message": f"Success: LoRA adapter '{name}' added successfully.",
            "adapter": info}


@v1.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    name, _ = _lora_body(await read_json(request), need_path=False)
    await on_engine(request, lambda engine: engine.unload_adapter(name))
    log.info("adapter %s unloaded", name)
    return {"object": "lora_adapter", "message": f"Success: LoRA adapter '{name}' removed successfully."}


@v1.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request):
    """Forget every cached prefix (vLLM's route of the same name): the next prompts are computed
    in full. Running requests keep their KV."""
    pages = await on_engine(request, lambda engine: engine.reset_prefix_cache())
    return {"object": "prefix_cache", "message": f"Success: {pages} cached pages freed.", "pages_freed": pages}


@v1.get("/v1/stats")
async def stats(request: Request):
    st = state_of(request)
    snapshot = await on_engine(request, metrics.engine_snapshot)
    return Response(metrics.stats_body(__version__, st.info(), snapshot), media_type="application/json")


def create_app(state: ServerState) -> FastAPI:
    # max_body_size: a body announced larger is refused (413) before a byte of it is read, one
    # without a length the moment it passes the limit: no body larger than that is ever held
    app = FastAPI(title="lorafleet", version=__version__, docs_url=None, redoc_url=None, openapi_url=None,
                  max_body_size=state.config.max_body_bytes)
    app.state.lorafleet = state
    app.include_router(v1)

    @app.get("/health")
    async def health():
        if not state.worker.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "draining" if state.draining else "ok"}

    @app.get("/metrics")
    async def prometheus(request: Request):
        snapshot = await on_engine(request, metrics.engine_snapshot)
        return Response(metrics.render(snapshot, state.info(), state.base_name), media_type=metrics.CONTENT_TYPE)

    @app.exception_handler(LorafleetError)
    async def lorafleet_error(request: Request, e: LorafleetError):
        if e.http_status >= 500 and not isinstance(e, AdapterError):
            log.warning("%s %s: %s", request.method, request.url.path, e)
        return ErrorResponse(e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        if e.status_code == 413:
            err = LorafleetError(f"the request body is larger than {state.config.max_body_bytes} bytes, "
                                 "the daemon's limit (`serve --max-body-bytes`)")
        else:
            err = LorafleetError(f"{request.method} {request.url.path}: {e.detail}")
        err.http_status = e.status_code
        err.code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            e.status_code, "http_error")
        return ErrorResponse(err, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return ErrorResponse(bad(None, f"invalid request: {e.errors()}"))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return ErrorResponse(LorafleetError(f"internal error: {type(e).__name__}"))

    return app
