"""The Hub's LFS files (weights) downloaded resumably across processes, for `hub.download`: into
a partial file that outlives the process (the store's `Partials`), asking for
`Range: bytes=<its length>-` when it holds some bytes, checking that a 206 answer's
Content-Range starts there (a 200 starts the file over), retrying a dropped connection the same
way, then checking the whole file against its sha256 (why by hand: see `hub.py`).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from lorafleet import __version__
from lorafleet.errors import HubError
from lorafleet.store.store import sha256_file

_RETRIES = 5  # dropped connections in a row, without a byte between them, before giving up
_RETRY_WAIT = 1.0  # seconds before asking again


def fetch(repo_id: str, commit: str, name: str, part: Path, sha256: str, size: int, where: str, *,
          endpoint: str, token: str | None, progress: bool) -> None:
    """Complete `part` (which may hold the file's first bytes) from the Hub and check it against
    `sha256`: a resumed file that does not match is fetched again from byte 0, once; a file that
    does not match after a whole transfer is deleted and refused."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(repo_id, name, revision=commit, endpoint=endpoint)
    headers = build_hf_headers(token=token, library_name="lorafleet", library_version=__version__)
    headers["Accept-Encoding"] = "identity"  # byte ranges of the file itself, not of an encoding
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    with open(fd, "r+b", buffering=0) as f:  # unbuffered: what was received is in the file
        if f.seek(0, os.SEEK_END) > size:
            f.truncate(0)  # not a beginning of this file
        started_over = False
        while True:
            resumed = f.seek(0, os.SEEK_END) > 0
            resumed = _transfer(f, url, headers, name, size, where, progress) or resumed
            actual = sha256_file(part)
            if actual == sha256:
                return
            if resumed and not started_over:
                f.truncate(0)  # bytes from before (a killed pull, a dropped connection) were wrong
                started_over = True
                continue
            f.close()
            part.unlink(missing_ok=True)
            raise HubError(f"{where}: {name} does not match the Hub's checksum (sha256 expected {sha256}, got "
                           f"{actual}); the bad copy was removed: pull again")


def _transfer(f, url: str, headers: dict, name: str, size: int, where: str, progress: bool) -> bool:
    """Append to `f` the bytes it lacks of a `size`-byte file, from `url`, resuming a dropped
    connection with a Range request (up to `_RETRIES` failures in a row without a byte between
    them). Returns whether any answer was a range (the file was put together from more than
    one transfer)."""
    import httpx2
    from huggingface_hub import constants, get_session
    from huggingface_hub.utils import hf_raise_for_status
    from huggingface_hub.utils import tqdm as hf_tqdm

    session, ranged, failures = get_session(), False, 0
    with hf_tqdm(total=size, initial=f.tell(), unit="B", unit_scale=True, unit_divisor=1024, desc=name,
                 disable=True if not progress else None) as bar:
        while (start := f.seek(0, os.SEEK_END)) < size:
            if failures > _RETRIES:
                raise HubError(f"{where}: the Hub's answers to a download of {name} held no bytes "
                               f"{failures} times in a row; pull again to resume it")
            asked = {**headers, "Range": f"bytes={start}-"} if start else headers
            got = 0
            try:
                with session.stream("GET", url, headers=asked, follow_redirects=True,
                                    timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as r:
                    if r.status_code == 200 and start:
                        f.truncate(0)  # the range was ignored: the whole file comes
                        f.seek(0)
                        bar.reset(total=size)
                    elif r.status_code == 206 and start:
                        if _content_range(r.headers.get("Content-Range")) != (start, size):
                            f.truncate(0)  # not the bytes asked for: start over, without a range
                            bar.reset(total=size)
                            failures += 1
                            continue
                        ranged = True
                    elif r.status_code == 416 and start:
                        f.truncate(0)  # the partial is longer than the file the Hub has
                        bar.reset(total=size)
                        failures += 1
                        continue
                    elif r.status_code != 200:
                        hf_raise_for_status(r)
                        raise HubError(f"{where}: the Hub answered {r.status_code} to a download of {name}")
                    for chunk in r.iter_bytes():
                        if f.tell() + len(chunk) > size:
                            f.truncate(0)
                            raise HubError(f"{where}: the Hub sent more than the {size} bytes it says {name} has")
                        _write_all(f, chunk)
                        got += len(chunk)
                        bar.update(len(chunk))
            except httpx2.TransportError:  # refused, timed out, dropped mid-body
                if not got and failures >= _RETRIES:
                    raise
            failures = 0 if got else failures + 1
            if f.tell() < size:
                time.sleep(_RETRY_WAIT)
    return ranged


def _content_range(value: str | None) -> tuple[int, int] | None:
    """(first byte, the file's size) of `bytes a-b/size`; None if not of that form."""
    m = re.fullmatch(r"\s*bytes\s+(\d+)-(\d+)/(\d+)\s*", value or "")
    return (int(m[1]), int(m[3])) if m else None


def _write_all(f, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[f.write(view):]
