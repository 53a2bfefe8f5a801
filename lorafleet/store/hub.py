"""Fetch an adapter or a base model from the Hugging Face Hub, verified, for `lorafleet pull`.

What: `download(repo_id, kind=...)` fetches only the files lorafleet loads (an adapter's config
and safetensors weights; a base's config, safetensors weights and tokenizer files; never pickled
`.bin`/`.pt` files) into the Hub cache and returns the snapshot folder with, per file, its
sha256 and size: what the store records. `is_repo_id` tells a repo id from a local path.

Why through `huggingface_hub`: its client brings what users already set up (HF_TOKEN or a saved
login, HF_ENDPOINT mirrors, a client factory with proxies, the cache transformers shares) and
skips files already in the cache. It resumes a dropped transfer only within one call: the
version in use (2.4) downloads into a temporary file whose name is unique to the call
(`<etag>.<random>.incomplete`, file_download.py `_download_to_tmp_and_move`), opened afresh, and
deletes it when the call fails, so a pull killed outright (SIGKILL, Ctrl-C) would start the file
over. Hence, given `partials` (the store's partial downloads, `store.Partials`), `download`
fetches the LFS files (weights: few, large, with a published sha256) itself (`hub_fetch.py`),
through the library's own HTTP session and headers: into a partial file that outlives the
process, keyed by (repo, file name, sha256), asking for `Range: bytes=<its length>-` when it holds some bytes,
checking that a 206 answer's Content-Range starts there (a 200 starts the file over), retrying a
dropped connection the same way, then checking the whole file against the sha256. A partial
whose bytes turn out wrong (a resumed file that does not match) is started over once from byte
0; a file the Hub itself serves wrong is refused and its partial deleted. Before downloading,
an LFS file is looked up in the store (`have`: its blob by sha256) and in the Hub cache, so a
second pull transfers nothing. Everything else (metadata, small files) goes through
`huggingface_hub` as before, and without `partials` so does every file.

How files are verified: one metadata call (`model_info(files_metadata=True)`) resolves the
revision to a commit and gives each file's size and digest at that commit: the sha256 of LFS
files (weights), the git blob id of the others (small text files: sha1 of b"blob <size>\\0" +
bytes). The files are then downloaded pinned to that commit, and every one is hashed and
compared (huggingface_hub itself only checks sizes on plain HTTP downloads). A mismatch raises
`HubError` naming the file and both digests, and deletes the bad copy from the Hub cache so that
the next pull downloads it again.

Endpoint and cache: huggingface_hub reads HF_ENDPOINT and HF_HOME / HF_HUB_CACHE once, at import.
`download` reads them when called (unless given `endpoint=` / `cache_dir=`) and passes them
explicitly, so that settings made after import (tests, embedding programs) are honoured.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lorafleet import __version__
from lorafleet.errors import HubError
from lorafleet.store import hub_fetch

KINDS = ("adapter", "model")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# an adapter that added tokens brings its own tokenizer (`adapters/heads.py`); taken where present
ADAPTER_OPTIONAL = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
MODEL_INDEX = "model.safetensors.index.json"
# what a base holds beside config.json and its safetensors weights, when it has them
MODEL_OPTIONAL = ("generation_config.json", MODEL_INDEX, "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "chat_template.jinja")
MODEL_PATTERNS = ("config.json", "*.safetensors", *MODEL_OPTIONAL)
# pickled weights run code when loaded: never fetched, whatever the patterns say
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.pickle", "*.ckpt")

# a Hub repo id: "name" or "namespace/name", each part of letters, digits, "_", "-", "." that
# starts and ends with a letter, digit or "_"; no ".." or "--"; 96 characters at most
_ID_PART = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_CHUNK = 1 << 20


def is_repo_id(source: str) -> bool:
    """Whether `source` names a Hub repo ("org/name" or "name") rather than a local path: it has
    the shape of a repo id and no file or folder of that name exists here."""
    if not _is_id_shaped(source):
        return False
    try:
        return not Path(source).exists()
    except OSError:
        return False


def _is_id_shaped(source: object) -> bool:
    if not isinstance(source, str) or not source or len(source) > 96:
        return False
    if source.startswith(("/", "~")) or "\\" in source or ".." in source or "--" in source:
        return False
    parts = source.split("/")
    return len(parts) <= 2 and all(_ID_PART.match(p) for p in parts)


def download(repo_id: str, *, revision: str | None = None, kind: str = "adapter", token: str | None = None,
             progress: bool = True, endpoint: str | None = None, cache_dir: str | os.PathLike | None = None,
             partials=None, have: Callable[[str, int], Path | None] | None = None) -> tuple[Path | None, dict]:
    """Download what lorafleet needs of `repo_id` at `revision` (default: the repo's default
    branch) into the Hub cache and verify it.

    `kind` is "adapter" (adapter_config.json, adapter_model.safetensors) or "model" (config,
    safetensors weights — the shards its index names, when it has one — and tokenizer files).
    `token` overrides HF_TOKEN / the saved login. `endpoint` and `cache_dir` default to HF_ENDPOINT
    and HF_HUB_CACHE (else HF_HOME/hub) as set now, else huggingface_hub's own defaults.

    With `partials` (a `store.Partials`, open), LFS files are taken from `have(sha256, size)` (a
    file already stored) or the Hub cache when there, else downloaded resumably into a partial
    file (see above), which stays claimed until `partials` is closed; the rest as without it.

    Returns (the snapshot folder in the Hub cache: every file without `partials`, only those
    huggingface_hub fetched with it, None if none; {"repo_id", "revision": the commit sha,
    "files": {name: {"sha256", "size"}}, "paths": {name: where the verified file is}}). Raises
    `HubError`, with a one-line message, on any failure.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    if not _is_id_shaped(repo_id):
        raise HubError(f"{repo_id!r} is not a Hugging Face repo id: use 'namespace/name'")
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    endpoint = _endpoint(endpoint)
    cache = _cache_dir(cache_dir)
    where = f"{repo_id}@{revision}" if revision else repo_id
    agent: dict[str, Any]
    agent = dict(library_name="lorafleet", library_version=__version__)
    api = HfApi(endpoint=endpoint, token=token, **agent)
    with _hub_errors(repo_id, revision, endpoint):
        meta = api.model_info(repo_id, revision=revision, files_metadata=True)
    commit = meta.sha or ""
    if not _COMMIT.match(commit):
        raise HubError(f"the Hub at {endpoint} did not name the commit of {where} (got {commit!r})")
    siblings = {s.rfilename: s for s in meta.siblings or ()}
    common: dict[str, Any]
    common = dict(revision=commit, cache_dir=cache, endpoint=endpoint, token=token,
                  tqdm_class=None if progress else _silent_tqdm(), **agent)

    index = None
    if kind == "model" and MODEL_INDEX in siblings:
        # the index names the shards to fetch: a repo may also hold the same weights in another
        # layout (consolidated.safetensors...), which would double the download
        with _hub_errors(repo_id, revision, endpoint):
            index_path = hf_hub_download(repo_id, MODEL_INDEX, **common)
        _verify(Path(index_path), MODEL_INDEX, siblings[MODEL_INDEX], where, cache)
        index = _read_index(Path(index_path), where)
    wanted = _select(kind, siblings, index, where)
    ours = [n for n in wanted if partials is not None and getattr(siblings[n], "lfs", None) is not None]
    theirs = [n for n in wanted if n not in ours]

    files, paths, folder = {}, {}, None
    if theirs:
        with _hub_errors(repo_id, revision, endpoint):
            folder = Path(snapshot_download(repo_id, allow_patterns=[_literal(n) for n in theirs],
                                            ignore_patterns=list(PICKLE_PATTERNS), **common))
        for name in theirs:
            files[name], paths[name] = _verify(folder / name, name, siblings[name], where, cache), folder / name
    for name in ours:
        with _hub_errors(repo_id, revision, endpoint):
            paths[name], files[name] = _obtain(repo_id, commit, name, siblings[name], where, partials, have,
                                               endpoint=endpoint, cache=cache, token=token, progress=progress)
    return folder, {"repo_id": repo_id, "revision": commit, "files": {n: files[n] for n in wanted},
                    "paths": {n: paths[n] for n in wanted}}


# -- LFS files, resumable across processes --------------------------------------------------------

def _obtain(repo_id: str, commit: str, name: str, sibling, where: str, partials, have, *, endpoint: str,
            cache: str, token: str | None, progress: bool) -> tuple[Path, dict]:
    """(the verified file, {"sha256", "size"}) for an LFS file: stored already, in the Hub cache,
    or downloaded into its partial file."""
    from huggingface_hub import try_to_load_from_cache

    sha256, size = sibling.lfs.sha256, sibling.lfs.size
    record = {"sha256": sha256, "size": size}
    stored = have(sha256, size) if have is not None else None
    if stored is not None:
        return stored, record  # the store's blobs are named by their sha256
    part = partials.claim(repo_id, name, sha256)  # waits for a live pull fetching the same file
    stored = have(sha256, size) if have is not None else None  # which may have stored it meanwhile
    cached = try_to_load_from_cache(repo_id, name, cache_dir=cache, revision=commit)
    if stored is not None or isinstance(cached, str):
        part.unlink(missing_ok=True)
        if stored is not None:
            return stored, record
        assert isinstance(cached, str)  # the other way in
        return Path(cached), _verify(Path(cached), name, sibling, where, cache)
    hub_fetch.fetch(repo_id, commit, name, part, sha256, size, where, endpoint=endpoint, token=token,
                    progress=progress)
    return part, record


# -- which files -------------------------------------------------------------------------------

def _select(kind: str, siblings: dict, index: dict | None, where: str) -> list[str]:
    names = set(siblings)
    if kind == "adapter":
        missing = [n for n in ADAPTER_FILES if n not in names]
        if missing:
            raise HubError(f"{where} is not a PEFT LoRA adapter in safetensors: it has no {', '.join(missing)}"
                           + _pickle_hint(names))
        return [*ADAPTER_FILES, *(n for n in ADAPTER_OPTIONAL if n in names)]
    top = sorted(n for n in names if "/" not in n and not _is_pickle(n))
    if "config.json" not in names:
        raise HubError(f"{where} is not a transformers model: it has no config.json")
    if index is not None:
        shards = sorted(set(index.values()))
        absent = [s for s in shards if s not in names]
        if absent:
            raise HubError(f"{where}: {MODEL_INDEX} names shards the repo does not have: {', '.join(absent[:3])}")
        weights = shards
    elif "model.safetensors" in names:
        weights = ["model.safetensors"]
    else:
        weights = [n for n in top if n.endswith(".safetensors")]
    if not weights:
        raise HubError(f"{where} has no safetensors weights" + _pickle_hint(names))
    others = [n for n in top if not n.endswith(".safetensors")
              and any(fnmatch.fnmatchcase(n, p) for p in MODEL_PATTERNS)]
    return sorted(set(others) | set(weights))


def _read_index(path: Path, where: str) -> dict:
    try:
        weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise HubError(f"{where}: {MODEL_INDEX} is not a safetensors index (no weight_map)")
    bad = [v for v in weight_map.values() if "/" in v or "\\" in v or v.startswith(".") or not v.endswith(".safetensors")]
    if bad:
        raise HubError(f"{where}: {MODEL_INDEX} names a shard lorafleet will not fetch: {bad[0]!r}")
    return weight_map


def _is_pickle(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in PICKLE_PATTERNS)


def _pickle_hint(names) -> str:
    pickles = sorted(n for n in names if _is_pickle(n))
    if not pickles:
        return ""
    return (f" (only pickled weights such as {pickles[0]}, which lorafleet does not load: "
            "convert them to safetensors)")


def _literal(name: str) -> str:
    """An fnmatch pattern matching exactly `name`."""
    return re.sub(r"([*?\[])", r"[\1]", name)


# -- verification ------------------------------------------------------------------------------

def _verify(path: Path, name: str, sibling, where: str, cache: str) -> dict:
    """Hash `path` and compare it with the Hub's metadata for it; a mismatch removes the cached
    copy and raises."""
    if not path.is_file():
        raise HubError(f"{where}: {name} is missing from the downloaded snapshot")
    size = path.stat().st_size
    lfs = getattr(sibling, "lfs", None)
    blob_id = getattr(sibling, "blob_id", None)
    sha256 = hashlib.sha256()
    git = None if lfs is not None else hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha256.update(chunk)
            if git is not None:
                git.update(chunk)
    if lfs is not None:
        kind, expected, actual, expected_size = "sha256", lfs.sha256, sha256.hexdigest(), lfs.size
    elif blob_id and git is not None:  # (git: hashed wherever there is no LFS record)
        kind, expected, actual, expected_size = "git blob id", blob_id, git.hexdigest(), sibling.size
    else:
        raise HubError(f"{where}: the Hub gave no checksum for {name}, so it cannot be verified")
    if expected_size is not None and size != expected_size:
        _evict(path, cache)
        raise HubError(f"{where}: {name} is {size} bytes, the Hub says {expected_size}; the bad copy was "
                       "removed from the cache: pull again")
    if actual != expected:
        _evict(path, cache)
        raise HubError(f"{where}: {name} does not match the Hub's checksum ({kind} expected {expected}, "
                       f"got {actual}); the bad copy was removed from the cache: pull again")
    return {"sha256": sha256.hexdigest(), "size": size}


def _evict(path: Path, cache: str) -> None:
    """Remove a snapshot entry and the blob it points to (only ever inside the cache)."""
    blob = Path(os.path.realpath(path))
    for p in (path, blob):
        if p == path or Path(os.path.realpath(cache)) in p.parents:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


# -- settings, progress, errors ----------------------------------------------------------------

def _endpoint(endpoint: str | None) -> str:
    if not endpoint:
        from huggingface_hub import constants

        endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    return endpoint.rstrip("/")


def _cache_dir(cache_dir) -> str:
    if cache_dir:
        return os.fspath(cache_dir)
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _silent_tqdm():
    """A huggingface_hub progress bar class that never shows: scoped to one call, unlike
    `disable_progress_bars()`, which is process-wide."""
    from huggingface_hub.utils import tqdm

    class Silent(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None, endpoint: str):
    """huggingface_hub's and the HTTP stack's exceptions, as a one-line `HubError`."""
    from huggingface_hub import errors as hf

    where = f"{repo_id}@{revision}" if revision else repo_id
    token_hint = "set HF_TOKEN (or pass a token) to a token that has access"
    try:
        yield
    except HubError:
        raise
    except hf.GatedRepoError:
        raise HubError(f"{where} is gated: accept its conditions on the Hub, then {token_hint}") from None
    except hf.RevisionNotFoundError:
        raise HubError(f"revision {revision!r} not found in {repo_id} on {endpoint}") from None
    except hf.RepositoryNotFoundError:
        raise HubError(f"repo {repo_id} not found on {endpoint} (if it is private or gated, {token_hint})") from None
    except hf.RemoteEntryNotFoundError as e:
        raise HubError(f"{where}: a file it lists is not found on {endpoint} ({_first_line(e)})") from None
    except hf.OfflineModeIsEnabled:
        raise HubError(f"cannot pull {where}: HF_HUB_OFFLINE is set") from None
    except hf.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise HubError(f"the Hub at {endpoint} refused access to {where} ({status}): {token_hint}") from None
        raise HubError(f"the Hub at {endpoint} failed on {where}: {_first_line(e)}") from None
    except hf.LocalEntryNotFoundError as e:
        cause = e.__cause__ or e.__context__
        detail = _first_line(cause) if cause is not None else _first_line(e)
        raise HubError(f"cannot reach the Hub at {endpoint} for {where}: {detail}") from None
    except hf.HFValidationError as e:
        raise HubError(f"{where}: {_first_line(e)}") from None
    except OSError as e:  # a size check that failed after the retries, a full disk...
        raise HubError(f"downloading {where} from {endpoint} failed: {_first_line(e)}") from None
    except Exception as e:
        # the HTTP stack's own errors (connection refused, timeouts), whichever library it is
        if type(e).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "requests", "urllib3"):
            raise HubError(f"cannot reach the Hub at {endpoint} for {where}: {_first_line(e)}") from None
        raise
