"""A stand-in for the Hugging Face Hub on loopback, so that `lorafleet.store.hub` is tested
offline against the real `huggingface_hub` client.

It serves tiny model repos held in memory ({repo_id: {filename: bytes}}), all at one fixed fake
commit, and answers exactly the requests huggingface_hub 2.x makes for
`model_info(files_metadata=True)`, `snapshot_download` and `hf_hub_download` (read from its
source: hf_api.py, _snapshot_download.py, file_download.py, utils/_http.py):

    GET  /api/models/{repo}[/revision/{rev}][?blobs=True]   the repo's info: id, sha, siblings
                                                             (with blobs: size, blobId, lfs)
    GET  /api/models/{repo}/tree/{rev}[/{path}]?recursive=.  the listing snapshot_download caches
                                                             (one page: no Link header)
    HEAD /{repo}/resolve/{rev}/{path}                         the file's metadata: X-Repo-Commit,
                                                             ETag, X-Linked-Etag / X-Linked-Size
                                                             for LFS files, Content-Length
    GET  /{repo}/resolve/{rev}/{path}                         the file; `Range: bytes=a-b` -> 206

Errors carry the headers the client maps to its exceptions: 404 with `X-Error-Code:
RepoNotFound`, `RevisionNotFound` or `EntryNotFound` (with X-Repo-Commit), 401 with `GatedRepo`
for a repo added with a token when the request does not carry it, 416 for a bad range.
`.safetensors` (and pickle) files are LFS files: their metadata gives the sha256 and their ETag
is the sha256; other files are plain git blobs: blobId and ETag are the git blob id,
sha1(b"blob <size>\\0" + bytes). No X-Xet-* header and no xetHash is ever sent, so the client
takes its plain HTTP path even with hf_xet installed. Every response closes its connection, so
no connection outlives the server (a later server may get the same port).

Hooks for tests: `log` (every request: method, path, query, Range, Authorization),
`corrupt(repo, file)` (serve other bytes, same size, than the metadata describes), `uncorrupt`,
`cut_after(repo, file, nbytes)` (the next GET of that file sends its headers, then only `nbytes`
of the body, then closes the connection: an interrupted transfer), `stall_after(repo, file,
nbytes)` (the next GET of that file sends `nbytes` of the body, sets `stalled`, then holds the
connection open, sending nothing, until `release()` or 60 s: a transfer a test can kill the
client in the middle of, deterministically), `sent(path_contains)` (body bytes written so far
by the answers to GETs of matching paths), `ignore_ranges` (answer 200 and the whole file to a
Range request, as some proxies do) and `misrange(repo, file)` (the next Range request for that
file gets a 206 of other bytes than asked: from byte 0, with a Content-Range saying so).

Pointing the client here (`point_hf_at`, used by the `hub` fixture): huggingface_hub reads
HF_ENDPOINT and HF_HOME / HF_HUB_CACHE once, at import, so setting them later does not move the
library itself; `lorafleet.store.hub.download` reads them when called and passes `endpoint=` and
`cache_dir=` explicitly, which is what makes the fixture's monkeypatched environment reach it.
The fixture sets HF_ENDPOINT, HF_HOME and HF_HUB_CACHE (a tmp folder), HF_HUB_OFFLINE=0 and
HF_HUB_DISABLE_TELEMETRY=1, unsets HF_TOKEN, and patches the three constants the library consults
at call time: `constants.HF_HUB_OFFLINE` (offline mode), `constants.HF_HUB_DISABLE_TELEMETRY` (with
telemetry on, building the user agent fetches a list from huggingface.co) and
`constants.HF_TOKEN_PATH` (so that no token saved on this machine is sent).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

FAKE_COMMIT = "c0ffee" + "0123456789abcdef" * 2 + "42"  # 40 hex digits
assert re.fullmatch(r"[0-9a-f]{40}", FAKE_COMMIT)
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
            f"size {len(data)}\n").encode()


def is_lfs(name: str) -> bool:
    return name.endswith(LFS_SUFFIXES)


def corrupted(data: bytes) -> bytes:
    """Other bytes of the same size (a size check passes, a checksum does not)."""
    if not data:
        return data
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0x5A]) + data[i + 1:]


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: str
    range: str | None
    authorization: str | None


class StandInHub:
    """The server: `with StandInHub({repo: {file: bytes}}) as hub: ... hub.url ...`."""

    def __init__(self, repos: dict[str, dict[str, bytes]] | None = None, commit: str = FAKE_COMMIT):
        self.commit = commit
        self.repos: dict[str, dict[str, bytes]] = {}
        self.tokens: dict[str, str] = {}
        self.log: list[Request] = []
        self._corrupt: set[tuple[str, str]] = set()
        self._cuts: dict[tuple[str, str], int] = {}
        self._stalls: dict[tuple[str, str], int] = {}
        self._misranges: set[tuple[str, str]] = set()
        self._sent: dict[str, int] = {}
        self.ignore_ranges = False
        self.stalled = threading.Event()
        self._release = threading.Event()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        for repo_id, files in (repos or {}).items():
            self.add_repo(repo_id, files)

    # -- set-up and hooks --------------------------------------------------------------------

    def add_repo(self, repo_id: str, files: dict[str, bytes], *, token: str | None = None) -> None:
        """Serve `files` as `repo_id`; with `token`, the repo is gated: only requests with
        `Authorization: Bearer <token>` get in."""
        with self._lock:
            self.repos[repo_id] = dict(files)
            if token is not None:
                self.tokens[repo_id] = token

    def corrupt(self, repo_id: str, filename: str) -> None:
        with self._lock:
            self._corrupt.add((repo_id, filename))

    def uncorrupt(self, repo_id: str, filename: str) -> None:
        with self._lock:
            self._corrupt.discard((repo_id, filename))

    def cut_after(self, repo_id: str, filename: str, nbytes: int) -> None:
        with self._lock:
            self._cuts[(repo_id, filename)] = nbytes

    def stall_after(self, repo_id: str, filename: str, nbytes: int) -> None:
        with self._lock:
            self._stalls[(repo_id, filename)] = nbytes
            self.stalled.clear()
            self._release.clear()

    def release(self) -> None:
        """End a stalled answer (its connection closes without the rest of the body)."""
        self._release.set()

    def misrange(self, repo_id: str, filename: str) -> None:
        with self._lock:
            self._misranges.add((repo_id, filename))

    def sent(self, path_contains: str) -> int:
        with self._lock:
            return sum(n for path, n in self._sent.items() if path_contains in path)

    def requests(self, method: str | None = None, path_contains: str | None = None) -> list[Request]:
        with self._lock:
            return [r for r in self.log if (method is None or r.method == method)
                    and (path_contains is None or path_contains in r.path)]

    def clear_log(self) -> None:
        with self._lock:
            self.log.clear()
            self._sent.clear()

    # -- life --------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self._server is not None, "the stand-in is not running"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> StandInHub:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.daemon_threads = True
        server.hub = self  # type: ignore[attr-defined]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="stand-in-hub", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._server is None:
            return
        self._release.set()  # a stalled answer ends
        self._server.shutdown()  # returns once serve_forever has stopped (within a poll interval)
        self._server.server_close()
        self._thread.join(timeout=5)
        assert not self._thread.is_alive(), "the stand-in hub did not stop within 5 s"
        self._server = None

    def __enter__(self) -> StandInHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- what the handler asks ---------------------------------------------------------------

    def _record(self, request: Request) -> None:
        with self._lock:
            self.log.append(request)

    def _content(self, repo_id: str, filename: str) -> bytes:
        with self._lock:
            data = self.repos[repo_id][filename]
            return corrupted(data) if (repo_id, filename) in self._corrupt else data

    def _take_cut(self, repo_id: str, filename: str) -> int | None:
        with self._lock:
            return self._cuts.pop((repo_id, filename), None)

    def _take_stall(self, repo_id: str, filename: str) -> int | None:
        with self._lock:
            return self._stalls.pop((repo_id, filename), None)

    def _take_misrange(self, repo_id: str, filename: str) -> bool:
        with self._lock:
            found = (repo_id, filename) in self._misranges
            self._misranges.discard((repo_id, filename))
            return found

    def _count(self, path: str, nbytes: int) -> None:
        with self._lock:
            self._sent[path] = self._sent.get(path, 0) + nbytes

    def _find_repo(self, rest: str, sep: str) -> tuple[str, str] | None:
        """(repo_id, what follows it) for the longest known repo id that `rest` starts with,
        followed by `sep` (or nothing)."""
        with self._lock:
            ids = sorted(self.repos, key=len, reverse=True)
        for repo_id in ids:
            if rest == repo_id or rest.startswith(repo_id + sep):
                return repo_id, rest[len(repo_id):]
        return None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 10  # a client that stalls does not hold a thread forever
    server_version = "stand-in-hub/1"

    @property
    def hub(self) -> StandInHub:
        return self.server.hub  # type: ignore[attr-defined]

    def log_message(self, format, *args):  # noqa: A002 (the base class's name) - quiet
        pass

    def do_HEAD(self):
        self._route(head=True)

    def do_GET(self):
        self._route(head=False)

    # -- routing -----------------------------------------------------------------------------

    def _route(self, head: bool) -> None:
        split = urlsplit(self.path)
        path, query = split.path, split.query
        self.hub._record(Request(self.command, path, query, self.headers.get("Range"),
                                 self.headers.get("Authorization")))
        if path.startswith("/api/models/"):
            return self._api(path[len("/api/models/"):], parse_qs(query), head)
        if "/resolve/" in path:
            return self._resolve(path[1:], head)
        return self._error(404, head, "Not Found")

    def _gate(self, repo_id: str, head: bool) -> bool:
        """False (and the answer sent) when the repo is gated and the request lacks its token."""
        token = self.hub.tokens.get(repo_id)
        if token is None or self.headers.get("Authorization") == f"Bearer {token}":
            return True
        self._error(401, head, f"Access to model {repo_id} is restricted. You must have access to it and be "
                               "authenticated to access it. Please log in.", code="GatedRepo")
        return False

    def _revision(self, repo_id: str, quoted: str, head: bool) -> bool:
        if unquote(quoted) in ("main", self.hub.commit):
            return True
        self._error(404, head, f"Invalid rev id: {unquote(quoted)}", code="RevisionNotFound")
        return False

    def _repo(self, rest: str, sep: str, head: bool) -> tuple[str, str] | None:
        """(repo id, the rest of the path) for a known repo the caller may read; else the error
        is answered and None returned."""
        found = self.hub._find_repo(rest, sep)
        if found is None:
            self._error(404, head, "Repository not found", code="RepoNotFound")
            return None
        return found if self._gate(found[0], head) else None

    def _api(self, rest: str, query: dict, head: bool) -> None:
        found = self._repo(rest, "/", head)
        if found is None:
            return
        repo_id, tail = found
        parts = tail.split("/")[1:]  # tail is "" or "/revision/<rev>" or "/tree/<rev>[/<path>]"
        if not parts:
            return self._json(self._info(repo_id, blobs=_true(query.get("blobs"))), head)
        if parts[0] == "revision" and len(parts) == 2:
            if self._revision(repo_id, parts[1], head):
                self._json(self._info(repo_id, blobs=_true(query.get("blobs"))), head)
            return
        if parts[0] == "tree" and len(parts) >= 2:
            if self._revision(repo_id, parts[1], head):
                under = unquote("/".join(parts[2:]))
                self._json(self._tree(repo_id, under, recursive=_true(query.get("recursive"))), head)
            return
        return self._error(404, head, "Not Found")

    def _resolve(self, rest: str, head: bool) -> None:
        found = self._repo(rest, "/resolve/", head)
        if found is None:
            return
        repo_id, tail = found
        rev, _, quoted_name = tail[len("/resolve/"):].partition("/")
        if not self._revision(repo_id, rev, head):
            return
        filename = unquote(quoted_name)
        if filename not in self.hub.repos[repo_id]:
            return self._error(404, head, "Entry not found", code="EntryNotFound",
                               extra={"X-Repo-Commit": self.hub.commit})
        self._file(repo_id, filename, head)

    # -- answers -----------------------------------------------------------------------------

    def _info(self, repo_id: str, blobs: bool) -> dict:
        siblings = []
        for name, data in sorted(self.hub.repos[repo_id].items()):
            sibling = {"rfilename": name}
            if blobs:
                if is_lfs(name):
                    sibling.update(size=len(data), blobId=git_blob_id(lfs_pointer(data)),
                                   lfs={"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                                        "pointerSize": len(lfs_pointer(data))})
                else:
                    sibling.update(size=len(data), blobId=git_blob_id(data))
            siblings.append(sibling)
        return {"_id": "0" * 24, "id": repo_id, "modelId": repo_id, "sha": self.hub.commit, "private": False,
                "gated": "manual" if repo_id in self.hub.tokens else False, "disabled": False, "tags": [],
                "siblings": siblings}

    def _tree(self, repo_id: str, under: str, recursive: bool) -> list[dict]:
        prefix = f"{under.strip('/')}/" if under.strip("/") else ""
        entries, folders = [], set()
        for name, data in sorted(self.hub.repos[repo_id].items()):
            if not name.startswith(prefix):
                continue
            parts = name[len(prefix):].split("/")
            for i in range(1, len(parts) if recursive else min(len(parts), 2)):
                folders.add(prefix + "/".join(parts[:i]))
            if len(parts) > 1 and not recursive:
                continue
            entry = {"type": "file", "path": name, "size": len(data)}
            if is_lfs(name):
                entry["oid"] = git_blob_id(lfs_pointer(data))
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                "pointerSize": len(lfs_pointer(data))}
            else:
                entry["oid"] = git_blob_id(data)
            entries.append(entry)
        dirs = [{"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()} for d in sorted(folders)]
        return dirs + entries

    def _file(self, repo_id: str, filename: str, head: bool) -> None:
        data = self.hub._content(repo_id, filename)  # what is served (maybe corrupted)
        original = self.hub.repos[repo_id][filename]  # what the metadata says
        size = len(data)
        if is_lfs(filename):
            etag = hashlib.sha256(original).hexdigest()
            headers = {"ETag": f'"{etag}"', "X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(original))}
        else:
            headers = {"ETag": f'"{git_blob_id(original)}"'}
        headers.update({"X-Repo-Commit": self.hub.commit, "Accept-Ranges": "bytes",
                        "Content-Type": "application/octet-stream"})
        status, start, end = 200, 0, size - 1
        wanted = None if self.hub.ignore_ranges else self.headers.get("Range")
        if wanted is not None:
            span = _parse_range(wanted, size)
            if span == "unsatisfiable":
                headers["Content-Range"] = f"bytes */{size}"
                return self._send(416, b"", head, headers)
            if span is not None:
                status, (start, end) = 206, span
                if not head and self.hub._take_misrange(repo_id, filename):
                    start, end = 0, end - start  # as many bytes as asked, from the wrong place
                headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        body = data[start:end + 1]
        cut = None if head else self.hub._take_cut(repo_id, filename)
        stall = None if head else self.hub._take_stall(repo_id, filename)
        self._send(status, body, head, headers, cut=cut, stall=stall)

    def _json(self, obj, head: bool) -> None:
        self._send(200, json.dumps(obj).encode(), head, {"Content-Type": "application/json"})

    def _error(self, status: int, head: bool, message: str, code: str | None = None,
               extra: dict | None = None) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message, **(extra or {})}
        if code is not None:
            headers["X-Error-Code"] = code
        self._send(status, json.dumps({"error": message}).encode(), head, headers)

    def _send(self, status: int, body: bytes, head: bool, headers: dict, cut: int | None = None,
              stall: int | None = None) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))  # the full length, even when cut
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        if head:
            return
        part = body if cut is None and stall is None else body[:min(n for n in (cut, stall) if n is not None)]
        try:
            self.wfile.write(part)
            self.wfile.flush()
        except OSError:  # the client went away (killed)
            return
        finally:
            self.hub._count(urlsplit(self.path).path, len(part))
        if stall is not None:
            self.hub.stalled.set()
            self.hub._release.wait(60)


def _true(values: list[str] | None) -> bool:
    return bool(values) and values[-1].lower() in ("1", "true", "yes")


def _parse_range(header: str, size: int):
    """(start, end) inclusive; None to ignore the header (not a single byte range);
    "unsatisfiable" for a range outside the file."""
    m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header)
    if m is None or (m[1] == "" and m[2] == ""):
        return None
    if m[1] == "":  # the last N bytes
        n = int(m[2])
        return (max(size - n, 0), size - 1) if n > 0 and size > 0 else "unsatisfiable"
    start = int(m[1])
    end = min(int(m[2]), size - 1) if m[2] else size - 1
    return (start, end) if start < size and start <= end else "unsatisfiable"


# -- pointing huggingface_hub at it ------------------------------------------------------------

def point_hf_at(hub: StandInHub, monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """Send every Hub call made through `lorafleet.store.hub` to `hub`, caching under `home`."""
    from huggingface_hub import constants

    home.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # with telemetry on, the user-agent header fetches an "agent harnesses" list from the
    # endpoint the library saw at import (huggingface.co), up to 3 s when offline
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A running stand-in hub, empty (tests add repos), with huggingface_hub pointed at it and
    its cache in tmp_path/hf/hub."""
    with StandInHub() as server:
        point_hf_at(server, monkeypatch, tmp_path / "hf")
        yield server
