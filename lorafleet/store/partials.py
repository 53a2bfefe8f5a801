"""The store's file locks, and its partial downloads (`tmp/partial/`): the files Hub pulls are
downloading, kept when a pull fails or dies so that the next pull of the same file resumes it
(see `store.py`'s layout).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import time
from pathlib import Path
from typing import overload

from lorafleet.errors import StoreError

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
PARTIAL_SUFFIX = ".part"


@overload
def flock(path: Path, timeout: float, busy: str) -> int: ...
@overload
def flock(path: Path, timeout: None, busy: str) -> int | None: ...


def flock(path: Path, timeout: float | None, busy: str) -> int | None:
    """An open descriptor of `path` (created if missing) holding its exclusive flock, which the
    kernel releases when the descriptor is closed or its process dies. Waits up to `timeout`
    seconds for another holder, then raises `StoreError(busy)`; with `timeout=None` it does not
    wait and returns None when the lock is held. A lock file removed (by `gc`) while this waited
    is not the one the path names any more: the lock is then taken again, on the new file."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline is None:
                        os.close(fd)
                        return None
                    if time.monotonic() > deadline:
                        raise StoreError(busy) from None
                    time.sleep(0.05)
            held = os.fstat(fd)
            try:
                now = os.stat(path)
                if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                    return fd
            except FileNotFoundError:
                pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


class Partials:
    """The files Hub pulls are downloading into this store (`tmp/partial/`), which outlive a
    pull that fails or is killed so that the next pull of the same file resumes it.

    `claim(source, name, sha256)` takes the file's lock (`<key>.lock`, key: a digest of source
    and name; waiting up to `timeout` s for another live pull downloading it, never for a dead
    one: an flock dies with its holder), discards the key's partials of another sha256 (the file
    changed upstream: stale), and returns the path its bytes go to, `<key>.<sha256>.part`, which
    may hold its first bytes already. The locks are held until `close()` (or the end of the
    `with`), so that a claimed file stays this pull's until it is installed or given up. What a
    partial holds is unverified: the downloader checks the whole file against the sha256 before
    anything uses it."""

    def __init__(self, folder: Path, timeout: float = 600.0):
        self.folder = Path(folder)
        self.timeout = timeout
        self._held: dict[str, int] = {}

    def __enter__(self) -> Partials:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()

    @staticmethod
    def key(source: str, name: str) -> str:
        return hashlib.sha256(f"{source}\0{name}".encode()).hexdigest()[:32]

    def claim(self, source: str, name: str, sha256: str) -> Path:
        if not SHA256_RE.match(sha256 or ""):
            raise StoreError(f"{source}: {name} has no sha256 to download it against (got {sha256!r})")
        key = self.key(source, name)
        for attempt in range(3) if key not in self._held else ():
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            try:
                self._held[key] = flock(self.folder / f"{key}.lock", self.timeout,
                                         f"another pull has been downloading {name} of {source} into this "
                                         f"store for over {self.timeout:.0f} s; try again once it is done")
                break
            except FileNotFoundError:  # a gc removed the empty folder between the two calls
                if attempt == 2:
                    raise
        path = self.folder / f"{key}.{sha256}{PARTIAL_SUFFIX}"
        for other in self.folder.glob(f"{key}.*{PARTIAL_SUFFIX}"):
            if other != path:
                other.unlink(missing_ok=True)
        return path

    @staticmethod
    def sweep(folder: Path) -> tuple[int, int]:
        """Remove the partials (and lock files) no live pull holds: (files removed, their bytes)."""
        count = size = 0
        if not folder.is_dir():
            return count, size
        for key in sorted({p.name.split(".", 1)[0] for p in folder.iterdir()}):
            fd = flock(folder / f"{key}.lock", None, "")
            if fd is None:
                continue  # a live pull is downloading it
            try:
                for p in folder.iterdir():
                    if p.name.split(".", 1)[0] != key or p.name == f"{key}.lock":
                        continue
                    if p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p, ignore_errors=True)
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        n = p.lstat().st_size
                        p.unlink()
                        count, size = count + 1, size + n
                (folder / f"{key}.lock").unlink(missing_ok=True)
            finally:
                os.close(fd)
        with contextlib.suppress(OSError):
            folder.rmdir()  # unless a pull still holds something
        return count, size
