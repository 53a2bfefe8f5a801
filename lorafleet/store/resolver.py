"""The daemon's resolver: a request that names an adapter the engine does not hold, but the
store does, is served without a load call or a restart (as vLLM's LoRA resolvers do).

Before a request with an adapter is queued, the daemon looks at that name's manifest off the
engine thread (`prepare`: one `stat` when nothing changed; else the files' checks and the
adapter's own tokenizer), and the engine thread only records the result (`install`); `resolve()`,
both in one, serves callers that have no other thread (the Ray replica). Unknown to the engine
and in the store: registered from the store's snapshot folder (the disk tier: config checked,
no device memory), then prefetched like any other adapter. Registered by the resolver and
re-pulled since (the manifest changed): registered again from the new snapshot, which replaces
the old entry, so requests already running finish on the old weights and every later one gets
the new (the registry's replacement rule: no state of the old weights is reused). A name the
engine got otherwise (`--adapter`, the load endpoint) is never shadowed by the store. When the
daemon serves the very base the adapter was validated against at pull, its loads trust the
manifest: they map the weights laid out at pull and copy them into pages (no parsing, hashing or
re-validation: `memory.host_cache.build_host_adapter`); against another base they validate as any
load does.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from lorafleet.errors import StoreError
from lorafleet.store.store import Store, check_name

if TYPE_CHECKING:
    from lorafleet.engine.api import EngineAPI

log = logging.getLogger("lorafleet.server")


class StoreResolver:
    def __init__(self, store: Store):
        self.store = store
        # name -> (its manifest's (mtime_ns, size), the folder registered) when we registered it
        self._known: dict[str, tuple[tuple[int, int], Path]] = {}

    def resolve(self, engine: EngineAPI, name: str) -> None:
        """On the engine thread: register `name` from the store where it should be (`prepare`
        and `install` in one)."""
        self.install(engine, name, self.prepare(engine, name))

    def prepare(self, engine: EngineAPI, name: str):
        """Any thread: what registering `name` from the store takes, its files inspected here
        (config, header, an own tokenizer: `Engine.inspect_adapter`), or None when there is
        nothing to register. The daemon prepares on a worker before a request's first use of a
        stored adapter, so the engine thread only records it (`install`)."""
        try:
            path = self.store.manifest_path("adapters", check_name(name))
            st = path.stat()
        except (StoreError, OSError):
            return  # not a store name, or not in the store: the engine answers (404)
        seen = (st.st_mtime_ns, st.st_size)
        registered = engine.adapter_path(name)
        if registered is not None:
            known = self._known.get(name)
            if known is None or known[1] != registered or known[0] == seen:
                return  # the engine's own (or loaded over ours since), or ours and unchanged
        try:
            manifest = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return  # replaced while read: the next request sees the new one
        same_base = self.store.base_folder(manifest["base"]).resolve() == Path(engine.model_path).resolve()
        folder = self.store.folder(manifest)
        return seen, folder, manifest, same_base, engine.inspect_adapter(name, folder)

    def install(self, engine: EngineAPI, name: str, prepared) -> None:
        """On the engine thread: register what `prepare` found (nothing for None)."""
        if prepared is None:
            return
        seen, folder, manifest, same_base, inspected = prepared
        engine.register_adapter(name, folder, manifest["digest"] if same_base else None, inspected)
        self._known[name] = (seen, folder)
        log.info("adapter %s resolved from the store (%s, digest %s)", name, manifest.get("source"),
                 str(manifest.get("digest"))[:12])

    def available(self, model_path: str | Path) -> list[dict]:
        """The stored adapters validated against the base at `model_path` (the daemon's): what
        /v1/models lists beside the engine's adapters before their first request. Reads the
        store's manifests: called off the event loop and the engine thread."""
        here = Path(model_path).resolve()
        try:
            adapters = self.store.list("adapters")
        except (StoreError, OSError):
            return []
        return [{"name": m["name"], "path": str(self.store.folder(m)), "ranks": m["ranks"], "tier": "store",
                 "digest": m["digest"]} for m in adapters if self.store.base_folder(m["base"]).resolve() == here]
