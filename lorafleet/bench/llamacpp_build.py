"""What llama.cpp as a bench system (`llamacpp.py`) runs on: `llama-server` (and, for Q4_0,
`llama-quantize`) built once for this machine, and the bench's model and PEFT adapters converted
to GGUF once.

Where the server comes from. Built once from the llama.cpp sources that the pinned
llama-cpp-python source distribution vendors (`vendor/llama.cpp`): `pip download` fetches it
(its sha256 checked), cmake configures it for this CPU (GGML_NATIVE) with nothing fetched over
the network (no OpenSSL, no prebuilt web UI) and ninja builds the llama-server target only; the
llama-quantize target likewise, in a build of its own, the first time a Q4_0 model is wanted.
`LORAFLEET_LLAMA_SERVER=/path/to/llama-server` runs a binary of your own instead (the converters
still come from the sdist; the quantize tool is taken from beside it where it is there, else
from `LORAFLEET_LLAMA_QUANTIZE`, else built). When the server or a conversion cannot be had (no cmake, no
compiler, no registry, a converter's missing module), the system is reported skipped with the
reason.

Cache, outside the repository, under the bench's (`$LORAFLEET_HOME/bench/llama.cpp`, else
`~/.cache/lorafleet/bench/llama.cpp`):
  server-<key>/       llama-server and build.json; <key> digests everything that decides the
                      build: the sdist (version, sha256), the cmake flags, the versions of cmake
                      and of the C and C++ compilers, the machine and its CPU flags
  server-<key>.log    the last build's output
  quantize-<key>/     llama-quantize and build.json, <key> the same inputs and the target's name
                      (llama-server's key is unchanged by it: a cache built before the quantize
                      tool keeps its server, and builds the tool beside it when first needed)
  converters-<version>-<sha>/  the vendored converters and their gguf-py
  *.lock              the builders' flocks
Each is made in a temporary sibling renamed into place once complete, under an flock of its own
(the kernel releases it when its holder dies): a killed build leaves no half cache, and a second
builder waits for the first and uses its result.

The conversions to GGUF are `llamacpp_convert.py`'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable

from lorafleet.bench.fixtures import cache_root as bench_cache_root

SDIST_NAME, SDIST_VERSION = "llama-cpp-python", "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDORED = "vendor/llama.cpp"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_CCACHE=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON")
CONVERTERS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion", "gguf-py")
SERVER_ENV = "LORAFLEET_LLAMA_SERVER"
QUANTIZE_ENV = "LORAFLEET_LLAMA_QUANTIZE"
TOOLS = {"llama-server": "server", "llama-quantize": "quantize"}  # target -> its cache folder's prefix
LOCK_WAIT_S = 3600        # for another process's build (a build takes minutes on 2 cores)
STEP_TIMEOUT_S = 3600     # one step of a build: download, configure, compile


class LlamaCppUnavailable(RuntimeError):
    """llama-server or a conversion could not be had; the message says why (a skipped row's reason)."""


def cache_root() -> Path:
    return bench_cache_root() / "llama.cpp"


def quiet(message: str) -> None:
    pass


# -- llama-server ------------------------------------------------------------------------------

def server_binary(say: Callable[[str], None] = quiet) -> Path:
    """`$LORAFLEET_LLAMA_SERVER`, else the cached build for this machine, built first if need be."""
    own = os.environ.get(SERVER_ENV)
    if own:
        return _own_binary(SERVER_ENV, own)
    return _built("llama-server", say, also=("llama-quantize",))


def quantize_binary(say: Callable[[str], None] = quiet) -> Path:
    """llama.cpp's quantize tool (Q4_0 for `--quantize int4`): `$LORAFLEET_LLAMA_QUANTIZE`, else
    the `llama-quantize` beside `$LORAFLEET_LLAMA_SERVER` where there is one, else the cached
    build for this machine (the same sources and flags as llama-server's), built first if need be."""
    own = os.environ.get(QUANTIZE_ENV)
    if own:
        return _own_binary(QUANTIZE_ENV, own)
    server = os.environ.get(SERVER_ENV)
    if server and os.access(Path(server).with_name("llama-quantize"), os.X_OK):
        return Path(server).with_name("llama-quantize")
    beside = cache_root() / f"{TOOLS['llama-server']}-{build_key('llama-server')}" / "llama-quantize"
    if beside.is_file():  # built with llama-server, in its tree (a cache from before has none)
        return beside
    return _built("llama-quantize", say)


def build_key(target: str, inputs: dict | None = None) -> str:
    """The cache key of one tool's build: llama-server's digests `build_inputs()` alone (so the
    caches built before the quantize tool joined stay valid), any other target's names it too."""
    inputs = inputs if inputs is not None else build_inputs()
    return _digest_json(inputs if target == "llama-server" else {**inputs, "target": target})


def _own_binary(env: str, value: str) -> Path:
    path = Path(value)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise LlamaCppUnavailable(f"{env}={value} is not an executable file")
    return path


def _built(target: str, say: Callable[[str], None], also: tuple[str, ...] = ()) -> Path:
    """`target` (TOOLS' llama-server or llama-quantize) from the cache, built into it first if
    need be: `<TOOLS[target]>-<build_key>/<target>`; the tools `also` names are built in the same
    tree and kept beside it (llama-quantize with llama-server: the shared ggml compiles once)."""
    inputs = build_inputs()
    key = build_key(target, inputs)
    root = cache_root()
    final = root / f"{TOOLS[target]}-{key}"
    if (final / target).is_file():
        return final / target
    cmake, ninja = _tool("cmake"), _tool("ninja")
    missing = [name for name, path in (("cmake", cmake), ("ninja", ninja), ("a C++ compiler", inputs["cxx"]),
                                       ("a C compiler", inputs["cc"])) if path is None]
    if missing:
        raise LlamaCppUnavailable(f"cannot build {target}: {', '.join(missing)} not found "
                                  "(`pip install cmake ninja` gives cmake and ninja)")
    with _locked(root / f"{final.name}.lock", target):
        if (final / target).is_file():  # another process built it meanwhile
            return final / target
        say(f"building {target} from {SDIST_NAME} {SDIST_VERSION}'s llama.cpp into {final} "
            f"(once; minutes on {os.cpu_count()} cores)")
        log = root / f"{final.name}.log"
        log.write_text("")
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
        try:
            started = time.perf_counter()
            src = _extract(_download_sdist(tmp / "sdist", log), tmp / "src")
            _step([cmake, "-S", str(src), "-B", str(tmp / "build"), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
                   *CMAKE_FLAGS], log, "configuring llama.cpp")
            _step([cmake, "--build", str(tmp / "build"), "--target", target, *also, "-j", str(os.cpu_count() or 1)],
                  log, f"building {' and '.join((target, *also))}")
            done = tmp / "done"
            done.mkdir()
            for tool in (target, *also):
                shutil.copy2(tmp / "build" / "bin" / tool, done / tool)
            seconds = time.perf_counter() - started
            (done / "build.json").write_text(json.dumps({**inputs, "target": target, "build_seconds": seconds,
                                                         "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1))
            os.rename(done, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        say(f"built {target} in {seconds:.0f} s")
    return final / target


def build_inputs() -> dict:
    """Everything that decides the build (the cache key's digest covers it all)."""
    cc, cxx = os.environ.get("CC", "cc"), os.environ.get("CXX", "c++")
    cmake = _tool("cmake")
    return {"sdist": [SDIST_NAME, SDIST_VERSION, SDIST_SHA256], "cmake_flags": list(CMAKE_FLAGS),
            "cmake": _version(cmake) if cmake else None, "cc": _version(cc), "cxx": _version(cxx),
            "machine": platform.machine(), "cpu_flags": _cpu_flags()}


def converters(say: Callable[[str], None] = quiet) -> Path:
    """The vendored converters (and the gguf-py they import), extracted once from the sdist."""
    root = cache_root()
    final = root / f"converters-{SDIST_VERSION}-{SDIST_SHA256[:12]}"
    if (final / "convert_hf_to_gguf.py").is_file():
        return final
    with _locked(root / f"{final.name}.lock", "the converters"):
        if (final / "convert_hf_to_gguf.py").is_file():
            return final
        say(f"fetching {SDIST_NAME} {SDIST_VERSION} for llama.cpp's converters")
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
        try:
            _extract(_download_sdist(tmp / "sdist", tmp / "download.log"), tmp / "done", CONVERTERS)
            os.rename(tmp / "done", final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _download_sdist(into: Path, log: Path) -> Path:
    into.mkdir(parents=True)
    # the source distribution of this one package only: with `--no-binary :all:` pip also built the
    # sdist's build requirements from source to read its metadata (CMake itself, very slowly)
    _step([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SDIST_NAME, "--disable-pip-version-check",
           "-d", str(into), f"{SDIST_NAME}=={SDIST_VERSION}"], log, f"downloading {SDIST_NAME} {SDIST_VERSION}")
    [tarball] = into.glob("*.tar.gz")
    digest = file_digest(tarball)
    if digest != SDIST_SHA256:
        raise LlamaCppUnavailable(f"{tarball.name} has sha256 {digest}, expected {SDIST_SHA256}")
    return tarball


def _extract(tarball: Path, dest: Path, parts: tuple[str, ...] | None = None) -> Path:
    """The vendored llama.cpp tree of the sdist (only its top-level `parts`, when given) into dest."""
    prefix = f"{tarball.name.removesuffix('.tar.gz')}/{VENDORED}/"
    with tarfile.open(tarball) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name.removeprefix(prefix)
            if rel == m.name or not rel or (parts is not None and rel.split("/")[0] not in parts):
                continue
            members.append(m.replace(name=rel))
        if not members:
            raise LlamaCppUnavailable(f"{tarball.name} has no {VENDORED}")
        tar.extractall(dest, members=members, filter="data")
    return dest


def _step(cmd: list, log: Path, what: str) -> None:
    """Run one step of a build, its output appended to `log`; its failure is the reason given."""
    with open(log, "a") as out:
        out.write(f"$ {' '.join(map(str, cmd))}\n")
        out.flush()
        try:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=STEP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise LlamaCppUnavailable(f"{what} took over {STEP_TIMEOUT_S} s (log: {log})")
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1]
        raise LlamaCppUnavailable(f"{what} failed (exit {proc.returncode}): {tail} (log: {log})")


@contextlib.contextmanager
def _locked(path: Path, what: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LlamaCppUnavailable(f"waited {LOCK_WAIT_S} s for another process making {what} ({path})")
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _tool(name: str) -> str | None:
    """A tool on PATH or beside this Python (a virtual environment's `pip install cmake ninja`)."""
    return shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


def _version(tool: str) -> str | None:
    try:
        proc = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[0] if proc.returncode == 0 and lines else None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _digest_json(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def file_digest(path: Path, h=None) -> str:
    h = h or hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
