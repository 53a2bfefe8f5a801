"""A daemon serving a base from the store by name resolves store adapters on their first
request (no load call, no restart), and after a re-pull under the same name serves the new
weights: two demo-fleet skills swapped under one name change the answer's skill. With
--no-resolve a store adapter is unknown (404)."""

from __future__ import annotations

import pytest

from lorafleet.demo import default_fleet
from lorafleet.errors import StoreError
from lorafleet.store.pull import pull
from lorafleet.store.store import Store
from tests.daemons import Daemon


def ask(daemon: Daemon, model: str, text: str) -> tuple[int, str]:
    with daemon.http() as c:
        r = c.post("/v1/chat/completions", json={"model": model, "max_tokens": 40,
                                                  "messages": [{"role": "user", "content": text}]})
    return r.status_code, (r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    root = tmp_path_factory.mktemp("resolver")
    fleet = default_fleet()
    store = Store(root / "home" / "store")
    pull(str(fleet.model), name="demo", base=True, store=store)
    pull(str(fleet.adapters["reverse"]), name="skill", store=store)
    return root, store, fleet


def test_store_adapters_serve_on_first_request_and_a_repull_serves_the_new_weights(stored):
    root, store, fleet = stored
    daemon = Daemon.start(root / "a", model="demo", env={"LORAFLEET_HOME": str(store.root.parent)})
    try:
        with daemon.http() as c:  # served by its store name; the stored adapter listed before its first use
            cards = c.get("/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in cards] == [("demo", None), ("skill", "demo")]
        assert cards[1]["lorafleet"]["tier"] == "store" and cards[1]["root"] == str(store.folder(store.get("adapters", "skill")))
        assert ask(daemon, "skill", "hello world") == (200, "dlrow olleh")
        with daemon.http() as c:  # now the engine's, listed once
            skill = [m for m in c.get("/v1/models").json()["data"] if m["id"] == "skill"]
        assert len(skill) == 1 and skill[0]["lorafleet"]["tier"] != "store"
        pull(str(fleet.adapters["upper"]), name="skill", store=store)              # re-pulled: other weights
        assert ask(daemon, "skill", "hello world") == (200, "HELLO WORLD")
        pull(str(fleet.adapters["title"]), name="fresh", store=store)              # pulled after the start
        assert ask(daemon, "fresh", "hello world") == (200, "Hello World")
        status, body = ask(daemon, "missing", "hello world")
        assert status == 404 and "nor in the store" in body and "lorafleet pull SOURCE --name missing" in body
    finally:
        daemon.kill()


def test_an_adapter_pulled_with_no_base_stored_fits_the_base_the_daemon_serves(tmp_path):
    """An empty store, a daemon serving a base from its folder: `pull` validates the adapter against
    that base (recorded by folder), and the daemon lists it and serves it. With no daemon either,
    the refusal names both ways out."""
    fleet = default_fleet()
    store = Store(tmp_path / "home" / "store")
    with pytest.raises(StoreError, match="no daemon serves one"):
        pull(str(fleet.adapters["reverse"]), name="skill", store=store)
    manifest = pull(str(fleet.adapters["reverse"]), name="skill", store=store, served=("demo", fleet.model))
    assert manifest["base"] == {"name": "demo", "snapshot": None, "folder": str(fleet.model.resolve())}
    assert store.list("models") == []
    daemon = Daemon.start(tmp_path / "d", env={"LORAFLEET_HOME": str(store.root.parent)})  # the demo fleet's folder
    try:
        with daemon.http() as c:
            ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert "skill" in ids
        assert ask(daemon, "skill", "hello world") == (200, "dlrow olleh")
    finally:
        daemon.kill()


def test_no_resolve_leaves_store_adapters_unknown(stored):
    root, store, _ = stored
    daemon = Daemon.start(root / "b", "--no-resolve", model="demo", env={"LORAFLEET_HOME": str(store.root.parent)})
    try:
        status, body = ask(daemon, "skill", "hello world")
        assert status == 404 and "skill" in body
    finally:
        daemon.kill()


def test_a_pulled_alora_serves_over_the_bases_prefix(stored):
    """The demo's aLoRA `shout`, pulled and served from the store on its first request: it answers
    its skill, and after the base has answered the same turn, its call finds every whole block of
    the user turn in the prefix cache (counted in the usage and in /v1/stats' `alora`)."""
    from lorafleet.demo.skills import expected

    root, store, fleet = stored
    pull(str(fleet.adapters["shout"]), name="loud", store=store)
    assert store.get("adapters", "loud") is not None
    daemon = Daemon.start(root / "alora", model="demo", env={"LORAFLEET_HOME": str(store.root.parent)})
    try:
        assert ask(daemon, "loud", "hello world") == (200, expected("shout", "hello world"))
        turn = [{"role": "user", "content": "a user turn long enough for two whole blocks of the cache"}]
        with daemon.http() as c:
            c.post("/v1/chat/completions", json={"model": "demo", "max_tokens": 4, "messages": turn}).raise_for_status()
            r = c.post("/v1/chat/completions", json={"model": "loud", "max_tokens": 4, "messages": turn})
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 32 and cached % 16 == 0, r.json()["usage"]
        alora = daemon.stats()["engine"]["alora"]
        assert alora["requests"] == 2 and alora["reused_tokens"] == cached
    finally:
        daemon.kill()


def test_an_adapter_that_added_tokens_is_pulled_with_its_tokenizer_and_served_with_it(tmp_path):
    """Pulled with its tokenizer files; on its first request (resolved from the store, its files
    checked off the engine thread) the prompt is read with its tokenizer, where the added token
    is one id past the base's vocabulary, and the answer is the in-process engine's."""
    from lorafleet import Engine, SamplingParams
    from tests.engine.test_heads import vocab_adapter
    from tests.fixtures import build_chat_model

    base = build_chat_model(tmp_path / "base")
    adapter = vocab_adapter(base, tmp_path / "tools")
    store = Store(tmp_path / "home" / "store")
    pull(str(base), name="chat", base=True, store=store)
    pull(str(adapter), name="tools", store=store)
    assert (store.folder(store.get("adapters", "tools")) / "tokenizer.json").is_file()
    engine = Engine(base, pool_bytes=8 << 20)
    engine.register_adapter("tools", adapter)
    text = "hello <|tool|> world"
    ids = engine.tokenizer_for("tools").encode(text)
    want = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                           adapters=["tools"])[0]
    daemon = Daemon.start(tmp_path / "d", model="chat", env={"LORAFLEET_HOME": str(store.root.parent)})
    try:
        with daemon.http() as c:
            r = c.post("/v1/completions", json={"model": "tools", "prompt": text, "max_tokens": 8,
                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids) < len(engine.tokenizer.encode(text))
        assert r.json()["choices"][0]["text"] == want.text
    finally:
        daemon.kill()
