"""Models of a local Ollama store (issue 63, `store/ollama.py`), laid out here as Ollama lays it
out (manifests by registry/namespace/name/tag, blobs by sha256): `serve ollama:NAME[:TAG]` and
`pull ollama:NAME[:TAG]` take its GGUF base and its GGUF adapters, read where Ollama keeps them
(linked, never copied), and serve what the same files serve given by path; bad names, missing
blobs and changed blobs are refused by name."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from lorafleet import Engine, SamplingParams
from lorafleet.errors import StoreError, StoreNotFoundError
from lorafleet.store import ollama
from lorafleet.store.pull import pull
from lorafleet.store.store import Store
from tests.engine.test_parity import prompts_of_lengths
from tests.fixtures import build_adapter, build_chat_model, build_model
from tests.unit.test_gguf import write_gguf
from tests.unit.test_gguf_adapters import TARGETS, write_gguf_adapter

MEDIA = "application/vnd.ollama.image."


def add_blob(root: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def add_model(root: Path, ref: str, layers: dict[str, list[bytes]]) -> None:
    registry, namespace, name, tag = ollama.parse(ref)
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": add_blob(root, b"{}"),
                "layers": [{"mediaType": MEDIA + kind, **add_blob(root, data)}
                           for kind, blobs in layers.items() for data in blobs]}
    path = root / "manifests" / registry / namespace / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def ollama_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("ollama")
    base = build_model(root / "hf", "llama")
    cfg = json.loads((base / "config.json").read_text())
    model = write_gguf(base, root / "model.gguf").read_bytes()
    peft = build_adapter(base, root / "peft", r=4, lora_alpha=8, target_modules=TARGETS)
    adapter = write_gguf_adapter(peft, root / "adapter.gguf", "llama",
                                 (cfg["num_attention_heads"], cfg["num_key_value_heads"])).read_bytes()
    store = root / "models"
    add_model(store, "tiny:1b", {"model": [model], "template": [b"{{ .Prompt }}"],
                                 "params": [json.dumps({"temperature": 0.2, "stop": ["<|end|>"]}).encode()]})
    add_model(store, "me/sql-bot", {"model": [model], "adapter": [adapter]})
    return store, root, peft


@pytest.fixture
def env(ollama_store, monkeypatch, tmp_path):
    store, root, peft = ollama_store
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    monkeypatch.setenv("LORAFLEET_HOME", str(tmp_path / "home"))
    return store, root, peft


def test_a_model_resolves_to_links_to_its_blobs(env):
    store, root, _ = env
    m = ollama.resolve("ollama:tiny:1b")
    assert m.name == "tiny-1b" and m.adapters == [] and m.params == {"temperature": 0.2, "stop": ["<|end|>"]}
    assert m.model.suffix == ".gguf" and m.model.is_symlink()
    assert m.model.resolve().parent == (store / "blobs").resolve()  # read in place, not copied
    bot = ollama.resolve("me/sql-bot")
    assert bot.name == "sql-bot" and len(bot.adapters) == 1 and bot.adapters[0].resolve().parent.name == "blobs"


def test_an_ollama_model_serves_what_its_files_serve(env):
    _, root, peft = env
    bot = ollama.resolve("ollama:me/sql-bot")
    engine = Engine(bot.model, pool_bytes=8 << 20)
    engine.load_adapter("bot", bot.adapters[0])
    direct = Engine(root / "model.gguf", pool_bytes=8 << 20)
    direct.load_adapter("peft", peft)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = prompts_of_lengths([5, 11], seed=21)
    assert [o.token_ids for o in engine.generate(prompts, params, adapters=["bot"] * 2)] == \
        [o.token_ids for o in direct.generate(prompts, params, adapters=["peft"] * 2)]


def test_pull_stores_the_base_and_its_adapters(env, tmp_path):
    store = Store(tmp_path / "store")
    m = pull("ollama:me/sql-bot", store=store)
    assert m["name"] == "sql-bot-base" and m["format"] == "gguf"
    (adapter,) = m["ollama_adapters"]
    assert adapter["name"] == "sql-bot" and adapter["base"]["name"] == "sql-bot-base" and adapter["format"] == "gguf"
    assert pull("ollama:tiny:1b", store=store)["name"] == "tiny-1b"


def test_the_command_line_serves_an_ollama_model_with_its_adapter(env, tmp_path):
    from lorafleet.cli.serve import model_folder

    folder, name, adapters, _ = model_folder(Path("ollama:me/sql-bot"))
    assert folder.suffix == ".gguf" and name == "sql-bot-base" and adapters[0].startswith("sql-bot=")
    assert model_folder(Path("ollama:tiny:1b"))[3] == {"temperature": 0.2}  # its params: serve's defaults


@pytest.mark.parametrize("ref, error, words", [
    ("ollama:nothing", StoreNotFoundError, "no such model in the Ollama store"),
    ("ollama:../etc/passwd", StoreError, "is not an Ollama name"),
    ("ollama:a/b/c/d", StoreError, "NAME[:TAG]"),
])
def test_bad_names_and_missing_models_are_refused(env, ref, error, words):
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        ollama.resolve(ref)


def test_a_missing_or_changed_blob_is_refused(env, tmp_path, monkeypatch):
    store, _, _ = env
    copy = tmp_path / "models"
    shutil.copytree(store, copy)
    monkeypatch.setenv("OLLAMA_MODELS", str(copy))
    manifest = json.loads((copy / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "1b").read_text())
    blob = copy / "blobs" / ("sha256-" + manifest["layers"][0]["digest"].split(":")[1])
    with open(blob, "ab") as f:
        f.write(b"x")
    with pytest.raises(StoreError, match="a partial or changed blob"):
        ollama.resolve("ollama:tiny:1b")
    blob.unlink()
    with pytest.raises(StoreNotFoundError, match="is missing"):
        ollama.resolve("ollama:tiny:1b")


def test_serve_ollama_name_from_the_command_line(env, tmp_path):
    from tests.daemons import Daemon

    store, _, _ = env
    daemon = Daemon.start(tmp_path / "d", model=Path("ollama:me/sql-bot"), env={"OLLAMA_MODELS": str(store)})
    try:
        with daemon.http() as c:
            names = {m["id"] for m in c.get("/v1/models").json()["data"]}
            assert {"sql-bot-base", "sql-bot"} <= names
            r = c.post("/v1/completions", json={"model": "sql-bot", "prompt": [5, 6, 7], "max_tokens": 4})
            assert r.status_code == 200 and r.json()["model"] == "sql-bot"
    finally:
        daemon.kill()


def test_a_gguf_without_jinja_serves_its_ollama_go_template(tmp_path, monkeypatch):
    """Ollama's own conversions carry no `tokenizer.chat_template`: the manifest's Go template is
    then the chat template, translated; one the translator refuses leaves the model without one."""
    import gguf

    from lorafleet.model.tokenizer import Tokenizer

    base = build_chat_model(tmp_path / "hf")  # with a tokenizer
    with monkeypatch.context() as m:
        m.setattr(gguf.GGUFWriter, "add_chat_template", lambda self, template: None)
        model = write_gguf(base, tmp_path / "model.gguf").read_bytes()
    store = tmp_path / "models"
    go = (b'{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}'
          b'<|im_start|>assistant\n')
    add_model(store, "plain", {"model": [model], "template": [go]})
    add_model(store, "odd", {"model": [model], "template": [b"{{ with .System }}{{ . }}{{ end }}"]})
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    monkeypatch.setenv("LORAFLEET_HOME", str(tmp_path / "home"))
    served = Tokenizer.from_gguf(ollama.resolve("ollama:plain").model)
    assert Tokenizer.from_gguf(tmp_path / "model.gguf").chat_template is None  # the file alone has none
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert served.apply_chat_template(messages) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi"
                                                    "<|im_end|>\n<|im_start|>assistant\n")
    stored = pull("ollama:plain", store=Store(tmp_path / "store"))  # pulled: the translation in tokenizer_config
    folder = Store(tmp_path / "store").folder(stored)
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == served.chat_template
    assert Tokenizer.from_gguf(ollama.resolve("ollama:odd").model).chat_template is None
