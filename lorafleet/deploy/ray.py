"""lorafleet replicas behind Ray Serve's model multiplexing (`pip install 'lorafleet[ray]'`).

Ray Serve routes a request tagged with a multiplexed model id to a replica that already holds
that model, and each replica keeps at most `max_num_models_per_replica` of them (least recently
used out). Here the model id is the adapter's name, and each replica runs one lorafleet engine
with the daemon's own routes in-process (`deploy/inprocess.py`):

    client --HTTP--> Ray Serve proxy --> Router (ingress: reads `model` from the body)
                        --handle(multiplexed_model_id=adapter, stream=True)--> Replica x N
                                                     (Engine + the daemon's FastAPI app)

- `Router`: the OpenAI-compatible HTTP front (`/v1/completions`, `/v1/chat/completions`,
  `/v1/models`, `/health`), on the Serve proxy. It reads `model` from the body and calls a
  replica through a handle with that adapter as the multiplexed model id (none for the base:
  any replica), streaming the replica's bytes back as they come. A mix (the `adapters` field)
  goes by its first adapter (by name): its requests meet on the replicas that hold it, and
  the replica registers the others as it serves the request.
- `Replica`: one Engine. `get_adapter` (Serve's `@serve.multiplexed`) registers the adapter
  with the engine the first time this replica sees it (from the paths given at deploy time, or
  the store), which is what Serve's router learns residency from; lorafleet's own tiers and pool
  decide what stays on the device. Each replica answers `stats()` (`/v1/stats` of its engine,
  with the replica's id).

`build_app(...)` returns the Serve application (`serve.run(build_app(...))`);
`lorafleet deploy ray` starts a local Ray cluster and runs it. Ray is imported here only: the
rest of lorafleet never needs it.
"""

# no `from __future__ import annotations`: FastAPI reads the routes' annotations (Request) at
# runtime, through Serve's ingress wrapper, which string annotations do not survive
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from lorafleet.errors import AdapterNotFoundError, InvalidRequestError
from lorafleet.adapters.mix import FIELD as MIX_FIELD
from lorafleet.adapters.mix import Mix
from lorafleet.server.errors import error_body

log = logging.getLogger("lorafleet.deploy")

DEFAULT_MAX_ADAPTERS_PER_REPLICA = 64
_HOP = {"content-length", "transfer-encoding", "connection"}  # set by the proxy for the new response


def replica_class(max_adapters_per_replica: int):
    """The Replica deployment's class, with Serve's multiplexing bound to its capacity (the
    decorator takes it at class-definition time)."""

    class Replica:
        def __init__(self, model: str, adapters: dict[str, str], engine_options: dict,
                     served_model_name: str | None, store_home: str | None):
            from lorafleet.deploy.inprocess import InProcessServer
            from lorafleet.engine.engine import Engine

            self.adapters = {name: Path(path) for name, path in adapters.items()}
            resolver = None
            if store_home:
                from lorafleet.store.resolver import StoreResolver
                from lorafleet.store.store import Store

                resolver = StoreResolver(Store(Path(store_home)))
            engine = Engine(model, **engine_options)
            self.base_name = served_model_name or Path(model).name
            self.server = InProcessServer(engine, self.base_name, model, resolver=resolver)
            # the engine thread keeps the replica's only OpenMP team (`lorafleet/openmp.py`)
            from lorafleet import openmp

            openmp.serial_thread()
            self.replica_id = serve.get_replica_context().replica_id.unique_id

        @serve.multiplexed(max_num_models_per_replica=max_adapters_per_replica)
        async def get_adapter(self, name: str) -> str:
            """Make `name` known to this replica's engine (disk tier: its weights are read when a
            request needs them): from the folders given at deploy time, else the store. Serve
            calls this once per adapter until it falls out of the replica's multiplexing LRU;
            the engine keeps the registration (it costs no pool memory)."""
            if not await self.register(name):
                raise AdapterNotFoundError(f"model {name!r} does not exist: it is neither the base "
                                           f"({self.base_name!r}), an adapter given at deploy time, nor in the store")
            return name

        async def register(self, name: str) -> bool:
            """Whether this replica's engine knows `name` now (registered from the folders given
            at deploy time, or the store, when it did not)."""
            path, resolver = self.adapters.get(name), self.server.worker.resolver

            def known(engine) -> bool:
                if engine.adapter_path(name) is None:
                    if path is not None:
                        engine.register_adapter(name, path)
                    elif resolver is not None:
                        resolver.resolve(engine, name)
                return engine.adapter_path(name) is not None
            return await self.server.run(known)

        async def handle(self, method: str, path: str, body: bytes):
            """The daemon's route for `path` on this replica: yields {"status", "headers"}, then
            the body's chunks."""
            model, mix = serve.get_multiplexed_model_id(), route_of(body)[1]
            if model:
                try:
                    await self.get_adapter(model)
                except AdapterNotFoundError as missing:  # the daemon's answer to an unknown model
                    e = AdapterNotFoundError(f"adapters: adapter {model!r} is neither an adapter given at deploy "
                                             "time nor in the store") if mix else missing
                    e.code, e.param = "model_not_found", "adapters" if mix else "model"
                    yield {"status": e.http_status, "headers": [("content-type", "application/json")]}
                    yield json.dumps(error_body(e)).encode()
                    return
            for name in mix[1:]:  # a mix's others (an unknown one: the app's 404 names it)
                await self.register(name)
            async for item in self.server.request(method, path, body):
                yield item

        async def stats(self) -> dict:
            from lorafleet.server.metrics import engine_snapshot

            snapshot = await self.server.run(engine_snapshot)
            return {"replica_id": self.replica_id, "server": self.server.state.info(), "engine": snapshot}

        def __del__(self):
            server = getattr(self, "server", None)
            if server is not None:
                server.close()

    return Replica


def route_of(body: bytes) -> tuple[object, tuple[str, ...]]:
    """The body's `model`, and the adapters of the mix its `adapters` field names (in the mix's
    order), from one parse; (None, ()) for a body that is no JSON object, and no mix for one
    named wrongly (the replica answers both with its 400)."""
    try:
        payload = json.loads(body) if body else {}
        model, value = payload.get("model"), payload.get(MIX_FIELD)
    except (ValueError, AttributeError):
        return None, ()
    try:
        return model, Mix.from_json(value).names if value is not None else ()
    except InvalidRequestError:
        return model, ()


router_app = FastAPI(title="lorafleet on Ray Serve", docs_url=None, redoc_url=None, openapi_url=None)


@serve.deployment
@serve.ingress(router_app)
class Router:
    def __init__(self, replicas, base_name: str, adapters: dict[str, str]):
        self.replicas = replicas
        self.base_name = base_name
        self.adapters = adapters

    async def _forward(self, request: Request, path: str) -> Response:
        body = await request.body()
        model, mix = route_of(body)  # a malformed body: neither (the replica answers it with its 400)
        handle = self.replicas.options(stream=True)
        if mix:
            handle = handle.options(multiplexed_model_id=mix[0])
        elif isinstance(model, str) and model and model != self.base_name:
            handle = handle.options(multiplexed_model_id=model)
        gen = handle.handle.remote(request.method, path, body)
        head = await gen.__anext__()
        headers = {k: v for k, v in head["headers"] if k.lower() not in _HOP}
        if headers.get("content-type", "").startswith("text/event-stream"):
            async def chunks():
                async for chunk in gen:
                    yield chunk
            return StreamingResponse(chunks(), status_code=head["status"], headers=headers)
        content = b"".join([chunk async for chunk in gen])
        return Response(content, status_code=head["status"], headers=headers)

    @router_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._forward(request, "/v1/completions")

    @router_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._forward(request, "/v1/chat/completions")

    @router_app.get("/v1/models")
    async def models(self) -> Response:
        """The base and the adapters given at deploy time (a replica knows only those it has
        served; store adapters are served by name, not listed)."""
        created = int(time.time())
        cards = [{"id": self.base_name, "object": "model", "created": created, "owned_by": "lorafleet",
                  "root": None, "parent": None}]
        cards += [{"id": name, "object": "model", "created": created, "owned_by": "lorafleet", "root": path,
                   "parent": self.base_name} for name, path in sorted(self.adapters.items())]
        return JSONResponse({"object": "list", "data": cards})

    @router_app.get("/health")
    async def health(self) -> Response:
        return JSONResponse({"status": "ok"})


def build_app(model: str | Path, adapters: Mapping[str, str | Path] | None = None, *, replicas: int = 2,
              max_adapters_per_replica: int = DEFAULT_MAX_ADAPTERS_PER_REPLICA, pool_bytes: int | None = None,
              device: str = "cpu", served_model_name: str | None = None, store_home: str | None = None,
              engine_options: dict | None = None, replica_cpus: float = 1.0, replica_gpus: float = 0.0):
    """The Serve application: `replicas` engines on `model` behind one router. `adapters`:
    name -> PEFT folder, known to every replica (each registers one when a request first names
    it there); `store_home`: a lorafleet store whose adapters are served by name too."""
    options = {"device": device, **({"pool_bytes": pool_bytes} if pool_bytes else {}), **(engine_options or {})}
    replica = serve.deployment(name="Replica", num_replicas=replicas,  # the decorator's form: typed as it returns
                               ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus}
                               )(replica_class(max_adapters_per_replica))
    base_name = served_model_name or Path(model).name
    folders = {k: str(v) for k, v in (adapters or {}).items()}
    bound = replica.bind(str(model), folders, options, base_name, store_home)
    router = cast(serve.Deployment, Router)  # made one by @serve.deployment (mypy keeps a decorated class's type)
    return router.options(ray_actor_options={"num_cpus": 0}).bind(bound, base_name, folders)
