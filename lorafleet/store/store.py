"""The local store: bases and adapters, content-addressed, installed atomically.

Layout under `<LORAFLEET_HOME>/store/`:
    blobs/sha256/<hex>                 every file once, by the sha256 of its bytes (read-only)
    snapshots/<id>/<file>              a folder per stored item: symlinks to its blobs, what the
                                       engine loads (an adapter or model folder like any other)
    manifests/models/<name>.json       one per base
    manifests/adapters/<name>.json     one per adapter
    tmp/                               staging, on the same filesystem (renames are atomic)
    tmp/partial/<key>.<sha256>.part    a file a pull is downloading from the Hub, kept when the
    tmp/partial/<key>.lock             pull dies so that the next one resumes it (`partials.py`)
    lock                               an flock held by whoever writes (pull, rm, gc)

A manifest is the item's whole record: name, kind, files (name -> sha256, size), the snapshot
id, the content digest (an adapter's: `lora.adapter` digest of config + tensors, computed once
at pull), what it was validated against (an adapter's base: name and digest), ranks and
modules, size, source, revision and pull time. `ls` lists manifests and nothing else.

Crash safety: an install writes blobs (temp file, fsync, rename to its digest), then the
snapshot (built in tmp/, renamed into place), then the manifest (temp file, fsync, rename over
the old one, directory fsync). Killed at any point, the store holds the old manifest or the new
one, each pointing at complete blobs; what a killed install leaves (tmp/ files, blobs and
snapshots no manifest names) is invisible and removed by `gc`. `check()` verifies every
manifest against its snapshot and blobs (sizes; sha256 too with `deep`).

Partial downloads: a Hub pull writes each weight file into `tmp/partial/` under a name fixed by
(repo, file name, expected sha256), holding that file's own flock while it writes, and keeps it
when it fails or dies, so that the next pull of the same file asks only for the missing bytes.
A partial is never a blob: only its verified bytes are moved into blobs/, by an install. `gc`
removes the partials no live pull holds.

Names: 1-128 of letters, digits, `.`, `_`, `-`, starting with a letter or digit, never `..`:
a name becomes a file name, so nothing else is accepted.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lorafleet import paths
from lorafleet.errors import StoreError, StoreNotFoundError, shown
from lorafleet.store.partials import SHA256_RE, Partials, flock

KINDS = ("models", "adapters")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
FORMAT = 1


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name) or ".." in name:
        raise StoreError(f"invalid name {shown(name)}: use 1-128 letters, digits and . _ -, starting with a "
                         "letter or digit, without '..'")
    return name


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Store:
    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else paths.home() / "store"
        self.blobs = self.root / "blobs" / "sha256"
        self.snapshots = self.root / "snapshots"
        self.tmp = self.root / "tmp"
        self.partial = self.tmp / "partial"

    # -- reading (no lock: manifests are replaced atomically) ---------------------------------
    def manifest_path(self, kind: str, name: str) -> Path:
        assert kind in KINDS
        return self.root / "manifests" / kind / f"{check_name(name)}.json"

    def get(self, kind: str, name: str) -> dict:
        path = self.manifest_path(kind, name)
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            what = "model" if kind == "models" else "adapter"
            raise StoreNotFoundError(f"no {what} named {name!r} in the store ({self.root})") from None

    def has(self, kind: str, name: str) -> bool:
        return self.manifest_path(kind, name).is_file()

    def list(self, kind: str) -> list[dict]:
        folder = self.root / "manifests" / kind
        out = []
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            with contextlib.suppress(OSError, json.JSONDecodeError):
                out.append(json.loads(path.read_text()))
        return out

    def folder(self, manifest: dict) -> Path:
        """The folder the engine loads: the item's snapshot (symlinks to its blobs)."""
        return self.snapshots / manifest["snapshot"]

    def base_folder(self, base: dict) -> Path:
        """Where an adapter manifest's base is: a stored base's snapshot, or the folder of the base
        a daemon served when the adapter was pulled (not in the store: `pull.choose_base`)."""
        return self.snapshots / base["snapshot"] if base.get("snapshot") else Path(base["folder"])

    def blob(self, sha256: str, size: int | None = None) -> Path | None:
        """The stored file of that sha256 (and size), if the store has it."""
        if not SHA256_RE.match(sha256 or ""):
            return None
        path = self.blobs / sha256
        try:
            st = path.stat()
        except OSError:
            return None
        return path if path.is_file() and (size is None or st.st_size == size) else None

    def partials(self, timeout: float = 600.0) -> Partials:
        """The store's partial downloads (`with store.partials() as p: p.claim(...)`)."""
        return Partials(self.partial, timeout)

    # -- writing (under the lock) --------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, timeout: float = 600.0):
        """The writers' flock (released by the kernel if its holder dies)."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = flock(self.root / "lock", timeout, f"the store {self.root} is locked by another pull, rm or gc "
                                                f"for over {timeout:.0f} s")
        try:
            yield
        finally:
            os.close(fd)

    def _staging(self) -> Path:
        self.tmp.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=self.tmp))

    def add_blob(self, source: Path, stage: Path, take: bool = False) -> tuple[str, int]:
        """Copy `source` in as a blob (hashing while copying); returns (sha256, size). A source
        that is a blob already is used as it is; with `take`, a source in this store's tmp/ (a
        finished partial download) is moved in, not copied."""
        real = Path(os.path.realpath(source))
        if real.parent == Path(os.path.realpath(self.blobs)) and SHA256_RE.match(real.name):
            return real.name, real.stat().st_size  # trusted as any existing blob is (check --deep hashes)
        if take and Path(os.path.realpath(self.tmp)) in real.parents:
            return self._take_blob(real)
        h, size = hashlib.sha256(), 0
        tmp = stage / f"blob-{os.urandom(6).hex()}"
        with open(source, "rb") as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                dst.write(chunk)
                size += len(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        digest = h.hexdigest()
        final = self.blobs / digest
        if final.is_file() and final.stat().st_size == size:
            tmp.unlink()
        else:
            self.blobs.mkdir(parents=True, exist_ok=True)
            os.chmod(tmp, 0o444)
            os.replace(tmp, final)
            _fsync_dir(self.blobs)
        return digest, size

    def _take_blob(self, source: Path) -> tuple[str, int]:
        """Move `source` (in tmp/) in as a blob: hashed where it is, synced, renamed."""
        h, size = hashlib.sha256(), 0
        with open(source, "rb+") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
                size += len(chunk)
            os.fsync(f.fileno())
        digest = h.hexdigest()
        final = self.blobs / digest
        if final.is_file() and final.stat().st_size == size:
            source.unlink()
            return digest, size
        self.blobs.mkdir(parents=True, exist_ok=True)
        os.chmod(source, 0o444)
        os.replace(source, final)  # tmp/ and blobs/ share the store's filesystem
        _fsync_dir(self.blobs)
        return digest, size

    def install(self, kind: str, name: str, files: dict[str, Path], record: dict,
                take: Iterable[Path] = ()) -> dict:
        """Store `files` (file name in the item's folder -> the file to copy in) under `name`
        with `record` (the kind's fields) as one atomic install; returns the manifest. Files in
        `take` that lie in this store's tmp/ (finished partial downloads) are moved in rather
        than copied. The caller holds `lock()`."""
        check_name(name)
        taken = {os.path.realpath(p) for p in take}
        stage = self._staging()
        try:
            entries: dict[str, dict[str, Any]]
            entries = {f: dict(zip(("sha256", "size"),
                                   self.add_blob(files[f], stage, take=os.path.realpath(files[f]) in taken)))
                       for f in sorted(files)}
            snapshot = hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()[:32]
            final = self.snapshots / snapshot
            if not final.is_dir():
                snap = stage / "snapshot"
                snap.mkdir()
                for f, e in entries.items():
                    os.symlink(os.path.relpath(self.blobs / e["sha256"], final), snap / f)
                self.snapshots.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(FileExistsError, OSError):
                    os.rename(snap, final)  # a concurrent identical install may have won: same content
                _fsync_dir(self.snapshots)
            manifest = {"format": FORMAT, "kind": kind[:-1], "name": name, "snapshot": snapshot, "files": entries,
                        "size": sum(e["size"] for e in entries.values()),
                        "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **record}
            target = self.manifest_path(kind, name)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = stage / "manifest.json"
            with open(tmp, "w") as out:
                json.dump(manifest, out, indent=1, sort_keys=True)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, target)
            _fsync_dir(target.parent)
            return manifest
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    def remove(self, kind: str, name: str) -> dict:
        """Drop the manifest (the caller holds `lock()`); blobs go at the next `gc`."""
        manifest = self.get(kind, name)
        self.manifest_path(kind, name).unlink()
        _fsync_dir(self.manifest_path(kind, name).parent)
        return manifest

    def gc(self) -> dict:
        """Remove staging leftovers, partial downloads no live pull holds, and snapshots and blobs
        no manifest names (caller holds the lock)."""
        manifests = [m for kind in KINDS for m in self.list(kind)]
        snaps = {m["snapshot"] for m in manifests}
        blobs = {e["sha256"] for m in manifests for e in m["files"].values()}
        removed = {"snapshots": 0, "blobs": 0, "bytes": 0, "partials": 0, "partial_bytes": 0}
        for entry in self.tmp.iterdir() if self.tmp.is_dir() else ():
            if entry == self.partial:
                removed["partials"], removed["partial_bytes"] = Partials.sweep(entry)
            elif entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.tmp.rmdir()  # unless a pull is downloading into tmp/partial/
        for snap in self.snapshots.iterdir() if self.snapshots.is_dir() else ():
            if snap.name not in snaps:
                shutil.rmtree(snap, ignore_errors=True)
                removed["snapshots"] += 1
        for blob in self.blobs.iterdir() if self.blobs.is_dir() else ():
            if blob.name not in blobs:
                removed["bytes"] += blob.stat().st_size
                blob.unlink()
                removed["blobs"] += 1
        return removed

    def check(self, deep: bool = False) -> builtins.list[str]:  # builtins': `list` is a method here
        """Every manifest against its snapshot and blobs: the problems found (none: consistent)."""
        problems = []
        for kind in KINDS:
            folder = self.root / "manifests" / kind
            for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
                try:
                    m = json.loads(path.read_text())
                except (OSError, json.JSONDecodeError) as err:
                    problems.append(f"{path}: unreadable manifest ({err})")
                    continue
                for f, e in m["files"].items():
                    blob, link = self.blobs / e["sha256"], self.snapshots / m["snapshot"] / f
                    if not blob.is_file() or blob.stat().st_size != e["size"]:
                        problems.append(f"{kind}/{m['name']}: blob of {f} missing or of the wrong size")
                    elif deep and sha256_file(blob) != e["sha256"]:
                        problems.append(f"{kind}/{m['name']}: blob of {f} does not match its sha256")
                    if not link.is_file() or link.resolve() != blob.resolve():
                        problems.append(f"{kind}/{m['name']}: snapshot entry {f} missing or wrong")
        return problems
