"""A Hub pull that dies mid-transfer (SIGKILL, Ctrl-C) resumes on the next pull: the weight file
it was downloading is kept in the store's partial downloads (tmp/partial/), and the next pull
asks the Hub only for the bytes missing, then checks the whole file against the Hub's sha256.
A partial that turns out wrong is never installed. Against the loopback stand-in Hub
(tests/store/hub_server.py), through the real client; every wait has a deadline.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from lorafleet.errors import HubError, StoreError
from lorafleet.store import hub as hub_module, hub_fetch
from lorafleet.store.partials import PARTIAL_SUFFIX
from lorafleet.store.pull import pull as store_pull
from lorafleet.store.store import Store
from tests.fixtures import call_within
from tests.store.hub_server import FAKE_COMMIT, corrupted, hub  # noqa: F401 (the fixture)

REPO = "acme/big"
WEIGHTS = "model.safetensors"
SIZE = 8 << 20  # 8 MiB
STALL = 3 << 20  # where the first transfer stops


@pytest.fixture(scope="module")
def big() -> bytes:
    return random.Random(14).randbytes(SIZE)


@pytest.fixture
def repo(hub, llama_dir, big):  # noqa: F811 (the fixture)
    """A base repo of a real config and an 8 MiB weights file (a base pull validates only the
    config, so the weights can be any bytes)."""
    files = {"config.json": (llama_dir / "config.json").read_bytes(), WEIGHTS: big}
    hub.add_repo(REPO, files)
    return files


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(tmp_path / "home" / "store")


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(hub_fetch, "_RETRY_WAIT", 0.05)


def pull(store, deadline: float = 60.0):
    """The base pull of REPO, in this process, failing the test past `deadline` seconds."""
    return call_within(lambda: store_pull(REPO, name="big", base=True, store=store, progress=False), deadline,
                       "the pull")


def weight_gets(hub):  # noqa: F811
    return [r.range for r in hub.requests("GET", f"/resolve/{FAKE_COMMIT}/{WEIGHTS}")]


def served(hub) -> int:  # noqa: F811
    return hub.sent(f"/resolve/{FAKE_COMMIT}/{WEIGHTS}")


def partial_files(store) -> list:
    return sorted(store.partial.glob(f"*{PARTIAL_SUFFIX}")) if store.partial.is_dir() else []


def plant(store, data: bytes, sha256: str | None = None):
    """A partial download of WEIGHTS holding `data`, as a killed pull would leave it."""
    with store.partials() as partials:
        path = partials.claim(REPO, WEIGHTS, sha256 or hashlib.sha256(b"").hexdigest())
    path.write_bytes(data)
    return path


def wait_for(condition, deadline: float, what: str) -> None:
    end = time.monotonic() + deadline
    while not condition():
        assert time.monotonic() < end, f"{what}: not within {deadline:.0f}s"
        time.sleep(0.02)


def assert_installed(store, big) -> None:
    m = store.get("models", "big")
    assert m["files"][WEIGHTS] == {"sha256": hashlib.sha256(big).hexdigest(), "size": SIZE}
    assert (store.folder(m) / WEIGHTS).read_bytes() == big
    assert store.check(deep=True) == []
    assert partial_files(store) == []  # moved into the store, not left behind


# -- killed outright ---------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "Ctrl-C"])
def test_a_pull_killed_mid_transfer_resumes_where_it_stopped(hub, repo, store, big, tmp_path, sig):  # noqa: F811
    hub.stall_after(REPO, WEIGHTS, STALL)
    env = {**os.environ, "LORAFLEET_HOME": str(store.root.parent), "HF_TOKEN_PATH": str(tmp_path / "token"),
           "TMPDIR": str(tmp_path)}  # a killed pull's scratch folder stays in the test's own folder
    proc = subprocess.Popen([sys.executable, "-m", "lorafleet.cli.main", "pull", REPO, "--base", "--name", "big",
                             "--json"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert hub.stalled.wait(120), "the pull never reached the weights"
        # the first STALL bytes are sent; the signal lands once they are in the partial file
        wait_for(lambda: [p.stat().st_size for p in partial_files(store)] == [STALL], 30,
                 "the partial file holding the bytes sent")
        os.killpg(proc.pid, sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        hub.release()
    assert proc.returncode != 0
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    assert not store.has("models", "big") and store.check(deep=True) == []
    assert [p.stat().st_size for p in partial_files(store)] == [STALL]  # kept, even by a Ctrl-C

    t0 = time.monotonic()
    manifest = pull(store)

    assert time.monotonic() - t0 < 30  # no wait on the dead pull's lock
    assert manifest["revision"] == FAKE_COMMIT
    assert_installed(store, big)
    assert weight_gets(hub) == [None, f"bytes={STALL}-"]
    assert served(hub) == SIZE < 1.5 * SIZE  # STALL bytes, then the rest: nothing twice


# -- what a partial holds is checked -----------------------------------------------------------

def test_a_corrupted_partial_is_started_over_never_installed(hub, repo, store, big):  # noqa: F811
    plant(store, corrupted(big[:STALL]), hashlib.sha256(big).hexdigest())

    pull(store)

    # resumed, found wrong as a whole, fetched again from byte 0
    assert weight_gets(hub) == [f"bytes={STALL}-", None]
    assert_installed(store, big)


def test_a_file_the_hub_serves_wrong_is_refused_and_its_partial_removed(hub, repo, store, big):  # noqa: F811
    hub.corrupt(REPO, WEIGHTS)
    plant(store, big[:STALL], hashlib.sha256(big).hexdigest())

    with pytest.raises(HubError, match=f"{WEIGHTS} does not match the Hub's checksum") as caught:
        pull(store)

    assert hashlib.sha256(big).hexdigest() in str(caught.value)
    assert weight_gets(hub) == [f"bytes={STALL}-", None]  # resumed, then once from the start
    assert not store.has("models", "big") and store.check(deep=True) == []
    assert partial_files(store) == []
    assert store.blob(hashlib.sha256(big).hexdigest()) is None
    assert not (store.blobs.is_dir() and any(store.blobs.iterdir()))  # nothing of it reached the blobs

    hub.uncorrupt(REPO, WEIGHTS)
    hub.clear_log()
    pull(store)
    assert weight_gets(hub) == [None]
    assert_installed(store, big)


def test_a_stale_partial_of_another_digest_is_discarded(hub, repo, store, big):  # noqa: F811
    stale = plant(store, b"an older version of the file " * 1000, "ab" * 32)

    pull(store)

    assert not stale.exists()
    assert weight_gets(hub) == [None]
    assert_installed(store, big)


def test_a_partial_longer_than_the_file_is_discarded(hub, repo, store, big):  # noqa: F811
    plant(store, big + b"trailing junk", hashlib.sha256(big).hexdigest())

    pull(store)

    assert weight_gets(hub) == [None]
    assert_installed(store, big)


def test_a_complete_partial_is_installed_without_a_transfer(hub, repo, store, big):  # noqa: F811
    # a pull killed after its download, before its install
    plant(store, big, hashlib.sha256(big).hexdigest())

    pull(store)

    assert weight_gets(hub) == []
    assert_installed(store, big)


def test_a_second_pull_transfers_nothing(hub, repo, store, big):  # noqa: F811
    pull(store)
    hub.clear_log()

    pull(store)

    assert not hub.requests(path_contains="/resolve/")
    assert_installed(store, big)


def test_a_file_already_in_the_hub_cache_is_not_downloaded_again(hub, repo, store, big):  # noqa: F811
    folder, _ = hub_module.download(REPO, kind="model", progress=False)  # all through huggingface_hub
    hub.clear_log()

    pull(store)

    assert weight_gets(hub) == []
    assert_installed(store, big)
    assert (folder / WEIGHTS).read_bytes() == big  # copied from the cache, which keeps it


# -- what the Hub answers ----------------------------------------------------------------------

def test_a_dropped_connection_is_resumed_within_the_pull(hub, repo, store, big):  # noqa: F811
    hub.cut_after(REPO, WEIGHTS, STALL)

    pull(store)

    assert weight_gets(hub) == [None, f"bytes={STALL}-"] and served(hub) == SIZE
    assert_installed(store, big)


def test_a_hub_that_ignores_ranges_sends_the_whole_file_again(hub, repo, store, big):  # noqa: F811
    plant(store, big[:STALL], hashlib.sha256(big).hexdigest())
    hub.ignore_ranges = True

    pull(store)

    assert weight_gets(hub) == [f"bytes={STALL}-"] and served(hub) == SIZE  # a 200: written from byte 0
    assert_installed(store, big)


def test_a_range_answer_of_other_bytes_is_not_appended(hub, repo, store, big):  # noqa: F811
    plant(store, big[:STALL], hashlib.sha256(big).hexdigest())
    hub.misrange(REPO, WEIGHTS)

    pull(store)

    assert weight_gets(hub) == [f"bytes={STALL}-", None]  # the wrong Content-Range: started over
    assert_installed(store, big)


# -- locks and gc ------------------------------------------------------------------------------

def test_a_partial_a_live_pull_holds_is_waited_for_and_kept_by_gc(store, big):
    with store.partials() as mine:
        path = mine.claim(REPO, WEIGHTS, hashlib.sha256(big).hexdigest())
        path.write_bytes(big[:100])
        with store.partials(timeout=0.3) as other, pytest.raises(StoreError, match="another pull"):
            other.claim(REPO, WEIGHTS, hashlib.sha256(big).hexdigest())
        with store.lock():
            assert store.gc()["partials"] == 0
        assert path.read_bytes() == big[:100]
    with store.lock():
        removed = store.gc()
    assert (removed["partials"], removed["partial_bytes"]) == (1, 100)
    assert not store.tmp.exists()
    with store.partials(timeout=0.3) as later:  # gc removed the lock file: a claim makes another
        assert not later.claim(REPO, WEIGHTS, hashlib.sha256(big).hexdigest()).exists()
