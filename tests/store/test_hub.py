"""`lorafleet.store.hub`: pulls from the Hugging Face Hub, through the real `huggingface_hub`
client, against a stand-in Hub on loopback (tests/store/hub_server.py): offline and fast.

Every download runs under a deadline (`pull`), so that a hang fails the test instead of the run.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from lorafleet.errors import LorafleetError
from lorafleet.adapters.layout import LAYOUT_FILE
from lorafleet.errors import HubError
from lorafleet.store.hub import ADAPTER_FILES, download, is_repo_id
from tests.fixtures import build_adapter, call_within
from tests.store.hub_server import FAKE_COMMIT, StandInHub, git_blob_id, hub  # noqa: F401 (the fixture)

REPO = "acme/tiny-lora"
WEIGHTS = "adapter_model.safetensors"
PICKLE = "pytorch_model.bin"


def pull(*args, deadline: float = 30.0, **kwargs):
    """`download(...)`, failing the test if it takes longer than `deadline` seconds."""
    kwargs.setdefault("progress", False)
    return call_within(lambda: download(*args, **kwargs), deadline, f"download{args}")


@pytest.fixture(scope="module")
def adapter_files(llama_dir, tmp_path_factory) -> dict[str, bytes]:
    """A real tiny PEFT adapter's files, plus files a pull must leave alone."""
    folder = build_adapter(llama_dir, tmp_path_factory.mktemp("adapter"), r=2, lora_alpha=4,
                           target_modules=["q_proj", "v_proj"])
    files = {name: (folder / name).read_bytes() for name in ADAPTER_FILES}
    files[PICKLE] = b"\x80\x04 a pickle nobody should load " * 40
    files["README.md"] = b"# tiny-lora\n"
    return files


@pytest.fixture
def repo(hub, adapter_files):  # noqa: F811 (the fixture)
    hub.add_repo(REPO, adapter_files)
    return adapter_files


def cache_root() -> Path:
    return Path(os.environ["HF_HUB_CACHE"])


def file_gets(hub, name: str):  # noqa: F811
    return hub.requests("GET", f"/resolve/{FAKE_COMMIT}/{name}")


# -- downloading -------------------------------------------------------------------------------

def test_download_fetches_only_the_adapter_files_and_verifies_them(hub, repo):  # noqa: F811
    folder, info = pull(REPO)

    assert folder.is_relative_to(cache_root()) and folder.name == FAKE_COMMIT
    assert sorted(p.name for p in folder.iterdir()) == sorted(ADAPTER_FILES)
    assert info["repo_id"] == REPO and info["revision"] == FAKE_COMMIT
    assert set(info["files"]) == set(ADAPTER_FILES)
    for name in ADAPTER_FILES:
        assert (folder / name).read_bytes() == repo[name]
        assert info["files"][name] == {"sha256": hashlib.sha256(repo[name]).hexdigest(), "size": len(repo[name])}
        assert len(file_gets(hub, name)) == 1
    # the pickle and the README were never asked for, not even their metadata
    assert not [r for r in hub.log if PICKLE in r.path or "README" in r.path]


def test_a_second_download_transfers_nothing(hub, repo):  # noqa: F811
    folder, info = pull(REPO)
    hub.clear_log()

    again, info_again = pull(REPO)

    assert (again, info_again) == (folder, info)
    assert not hub.requests(path_contains="/resolve/"), hub.log  # no file, no HEAD: the cache answered
    assert [r.path for r in hub.log] == [f"/api/models/{REPO}"]  # only the metadata to verify against


def test_a_revision_pins_the_commit(hub, repo):  # noqa: F811
    _, by_branch = pull(REPO, revision="main")
    _, by_sha = pull(REPO, revision=FAKE_COMMIT)
    assert by_branch == by_sha
    assert hub.requests("GET", f"/api/models/{REPO}/revision/main")


def test_an_interrupted_transfer_resumes_with_a_range_request(hub, repo, monkeypatch):  # noqa: F811
    # huggingface_hub resumes a dropped transfer within the same call (RemoteProtocolError ->
    # wait 1 s -> GET with `Range: bytes=<received>-`), counting only bytes its reader has
    # handed over, in DOWNLOAD_CHUNK_SIZE pieces (10 MB): shrink those so that the tiny file's
    # first bytes count.
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 512)
    hub.cut_after(REPO, WEIGHTS, 2048)

    folder, info = pull(REPO)

    assert (folder / WEIGHTS).read_bytes() == repo[WEIGHTS]
    assert info["files"][WEIGHTS]["sha256"] == hashlib.sha256(repo[WEIGHTS]).hexdigest()
    assert [r.range for r in file_gets(hub, WEIGHTS)] == [None, "bytes=2048-"]
    assert not list(cache_root().rglob("*.incomplete"))


@pytest.mark.parametrize("name", ADAPTER_FILES)
def test_a_corrupted_file_is_refused_and_removed_from_the_cache(hub, repo, name):  # noqa: F811
    hub.corrupt(REPO, name)

    with pytest.raises(HubError) as caught:
        pull(REPO)

    message = str(caught.value)
    expected = hashlib.sha256(repo[name]).hexdigest() if name == WEIGHTS else git_blob_id(repo[name])
    assert name in message and expected in message and "\n" not in message
    assert isinstance(caught.value, LorafleetError) and caught.value.http_status == 400
    snapshot = cache_root() / f"models--{REPO.replace('/', '--')}" / "snapshots" / FAKE_COMMIT
    assert not (snapshot / name).exists() and not (snapshot / name).is_symlink()
    assert {p.name for p in (snapshot.parent.parent / "blobs").iterdir()} == {
        hashlib.sha256(repo[WEIGHTS]).hexdigest() if n == WEIGHTS else git_blob_id(repo[n])
        for n in ADAPTER_FILES if n != name}

    hub.uncorrupt(REPO, name)
    hub.clear_log()
    folder, info = pull(REPO)

    assert (folder / name).read_bytes() == repo[name]
    assert len(file_gets(hub, name)) == 1  # fetched again
    assert info["files"][name]["sha256"] == hashlib.sha256(repo[name]).hexdigest()


# -- refusals ----------------------------------------------------------------------------------

def test_an_unknown_repo_or_revision_is_not_found(hub, repo):  # noqa: F811
    with pytest.raises(HubError, match="repo acme/nothing-here not found"):
        pull("acme/nothing-here")
    with pytest.raises(HubError, match="revision 'v9' not found in acme/tiny-lora"):
        pull(REPO, revision="v9")


def test_a_gated_repo_needs_its_token(hub, adapter_files, monkeypatch):  # noqa: F811
    hub.add_repo("acme/gated", adapter_files, token="hf_letmein")

    with pytest.raises(HubError, match="gated"):
        pull("acme/gated")
    folder, _ = pull("acme/gated", token="hf_letmein")
    assert (folder / WEIGHTS).read_bytes() == adapter_files[WEIGHTS]
    monkeypatch.setenv("HF_TOKEN", "hf_letmein")  # read by the library itself
    pull("acme/gated")
    assert {r.authorization for r in hub.requests(path_contains="acme/gated/")} <= {None, "Bearer hf_letmein"}


def test_a_repo_with_only_pickled_weights_is_refused(hub):  # noqa: F811
    hub.add_repo("acme/old-lora", {"adapter_config.json": b"{}", "adapter_model.bin": b"\x80\x04..."})

    with pytest.raises(HubError, match="has no adapter_model.safetensors .*only pickled weights"):
        pull("acme/old-lora")
    assert not hub.requests(path_contains="/resolve/")


def test_an_unreachable_hub_is_one_line(tmp_path):
    with StandInHub() as gone:
        endpoint = gone.url  # a port nothing listens on once it is closed
    with pytest.raises(HubError, match="cannot reach the Hub at http://127.0.0.1") as caught:
        pull(REPO, endpoint=endpoint, cache_dir=tmp_path)
    assert "\n" not in str(caught.value)


def test_a_bad_repo_id_or_kind_is_refused_before_any_request(hub):  # noqa: F811
    with pytest.raises(HubError, match="not a Hugging Face repo id"):
        pull("../etc")
    with pytest.raises(ValueError):
        pull(REPO, kind="dataset")
    assert hub.log == []


# -- base models -------------------------------------------------------------------------------

def test_a_model_pull_takes_the_shards_its_index_names(hub):  # noqa: F811
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.dumps({"metadata": {"total_size": 8}, "weight_map": {"a": shards[0], "b": shards[1]}}).encode()
    files = {"config.json": b'{"model_type": "llama"}', "generation_config.json": b"{}",
             "model.safetensors.index.json": index, shards[0]: b"shard-1!", shards[1]: b"shard-2!",
             "consolidated.safetensors": b"the same weights again", "pytorch_model.bin": b"pickle",
             "tokenizer.json": b"{}", "tokenizer_config.json": b"{}", "special_tokens_map.json": b"{}",
             "chat_template.jinja": b"{{ messages }}", "original/consolidated.00.pth": b"pickle",
             "onnx/model.safetensors": b"other", "README.md": b"# model"}
    hub.add_repo("acme/base", files)

    folder, info = pull("acme/base", kind="model")

    wanted = {"config.json", "generation_config.json", "model.safetensors.index.json", *shards, "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"}
    assert {p.name for p in folder.iterdir()} == wanted == set(info["files"])
    for name in wanted:
        assert (folder / name).read_bytes() == files[name]
    fetched = {r.path.rsplit(f"{FAKE_COMMIT}/", 1)[1] for r in hub.requests(path_contains="/resolve/")}
    assert fetched == wanted


def test_a_single_file_model_pull(hub, llama_dir):  # noqa: F811
    files = {p.name: p.read_bytes() for p in Path(llama_dir).iterdir() if p.is_file()}
    hub.add_repo("acme/llama-tiny", files)

    folder, info = pull("acme/llama-tiny", kind="model")

    assert "model.safetensors" in info["files"] and "config.json" in info["files"]
    assert all((folder / n).read_bytes() == files[n] for n in info["files"])


# -- telling a repo id from a path -------------------------------------------------------------

@pytest.mark.parametrize("source", ["org/name", "name", "Org-1/na_me.v2", "meta-llama/Llama-3.2-1B", "gpt2"])
def test_is_repo_id_accepts_hub_ids(source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_repo_id(source)


@pytest.mark.parametrize("source", ["../x", "/abs", "/abs/path", "a/b/c", "~/x", "~user", "a\\b", "", ".", "./x",
                                    "org/..", "org/.hidden", "a--b/c", "org/name/", "/", "org//name",
                                    "-org/name", "x" * 97])
def test_is_repo_id_refuses_paths_and_malformed_ids(source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not is_repo_id(source)


def test_is_repo_id_prefers_an_existing_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    (tmp_path / "adapter").write_text("")
    assert not is_repo_id("org/name") and not is_repo_id("adapter")
    assert is_repo_id("org/other")


def test_pull_from_the_hub_lands_in_the_store_validated_and_a_second_pull_transfers_nothing(hub, repo, llama_dir,
                                                                                          tmp_path):
    from lorafleet.store.pull import pull as store_pull
    from lorafleet.store.store import Store

    store = Store(tmp_path / "store")
    store_pull(str(llama_dir), name="base", base=True, store=store)
    m = store_pull(REPO, store=store, progress=False)
    assert (m["name"], m["source"], m["revision"]) == ("tiny-lora", f"hf:{REPO}", FAKE_COMMIT)
    assert set(m["files"]) == {*ADAPTER_FILES, LAYOUT_FILE} and m["ranks"] == {"q_proj": 2, "v_proj": 2}
    assert m["files"][WEIGHTS]["sha256"] == hashlib.sha256(repo[WEIGHTS]).hexdigest()
    assert store.check(deep=True) == []
    hub.clear_log()
    assert store_pull(REPO, store=store, progress=False)["digest"] == m["digest"]
    assert not hub.requests(path_contains="/resolve/")  # no file transferred again
