"""Building and loading lorafleet's C++ CPU kernels: once per machine, whatever environment asks.

The kernels are C++ sources compiled on first use with torch's `cpp_extension.load_inline` (the
machine's C++ compiler and ninja). Left to itself torch keys its build directory by the
extension's name only (`~/.cache/torch_extensions/py311_cpu/<name>`), which went wrong in three
ways: two virtual environments on one machine rebuilt the kernels in turn, forever (each
environment's torch lives at its own path, so the compile command differs, so ninja rebuilds and
the other environment then rebuilds again); a build killed midway left torch's `lock` file behind,
and every later start waited on it forever without a word; and `-march=native` objects in a
shared home directory could be loaded by a different CPU. This module replaces that.

The cache: `LORAFLEET_KERNEL_CACHE`, else `$XDG_CACHE_HOME/lorafleet/kernels`
(`~/.cache/lorafleet/kernels`), never inside a virtual environment. A kernel is built in
`<cache>/<name>-<key[:16]>`, where the key (`build_key`) is a sha256 over everything the binary
depends on: the source and the bound function names; the compiler flags; torch's build (version,
git revision, C++11 ABI flag, CUDA/HIP version); the Python ABI (cache tag, extension suffix,
machine); the compiler's identity (first line of `$CXX --version`, default `c++`); and the CPU
(model name and feature flags from /proc/cpuinfo; platform.processor() elsewhere), because of
`-march=native`. The install path of torch is deliberately not in the key: two environments with
the same torch build share one binary.

Loading: a finished build leaves a stamp file (`lorafleet-built.json`, naming the library)
written after the library is complete. When the stamp is there the library is imported directly,
without torch's build step, so an environment whose torch lives elsewhere loads the binary
another environment built instead of rebuilding it (which is what ninja would do: the include
paths in its command changed). Loading prints nothing.

Locking: builds of one key are serialised by an exclusive `fcntl.flock` on `<cache>/<name>-<key>.lock`.
The kernel releases a flock when its holder dies, so a builder killed at any point blocks nobody.
Whoever holds it first looks for the stamp again (another process may just have built it), then
deletes torch's own baton (`lock` in the build directory: left by a killed torch build, torch
would wait on it forever; under our flock no live torch build can own it), then builds. A start
that cannot take the flock within LORAFLEET_KERNEL_BUILD_TIMEOUT seconds (default 600: a builder
that hangs) gives up with a message naming the lock and its holder's pid: the torch reference, or
`KernelUnavailableError` under LORAFLEET_REQUIRE_CPU_KERNELS=1. It never waits forever.

Messages go to stderr (and to the `lorafleet.kernels` logger where logging is set up; once when
that logger already writes to stderr): before a real build, what is compiled, where, and how long
that usually takes; after it, how long it took; and one line when a kernel is unavailable (no
compiler, a failed build, the lock timeout) and the torch reference is used instead.

`LORAFLEET_KERNELS=torch` chooses the torch reference without building anything (`backend.select`,
the one place a backend is chosen); LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI) makes a kernel that cannot
be loaded an error (`KernelUnavailableError`, with the build error).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; builds there are not serialised across processes
    fcntl = None  # type: ignore[assignment]  # the module or None: checked where used

log = logging.getLogger("lorafleet.kernels")

CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
DEFAULT_BUILD_TIMEOUT_S = 600.0
STAMP = "lorafleet-built.json"
TORCH_BATON = "lock"  # torch's FileBaton in the build directory

_lock = threading.Lock()
_modules: dict[str, object] = {}
_why_not: dict[str, BaseException | str] = {}  # name -> the build error, for kernels that are None
_compilers: dict[str, str] = {}  # $CXX -> its identity, probed once per process


class KernelUnavailableError(RuntimeError):
    """A CPU kernel could not be loaded while LORAFLEET_REQUIRE_CPU_KERNELS=1: where the kernels are
    expected (CI), a broken build must fail the run, not pass as skipped tests on the torch path."""


class CompilerMissingError(RuntimeError):
    """No C++ compiler to build a kernel with (`$CXX`, default `c++`, is not there or does not run)."""


def required() -> bool:
    """LORAFLEET_REQUIRE_CPU_KERNELS=1: every CPU kernel must load (`compile_inline` raises)."""
    return os.environ.get("LORAFLEET_REQUIRE_CPU_KERNELS", "0") == "1"


def compile_inline(name: str, source: str, function: str | Sequence[str], cflags: Sequence[str] = ()):
    """Build (once per source, torch build, flags, compiler and CPU, in lorafleet's cache) and load
    a C++ CPU kernel binding `function` (a name or a list of names); None when that is impossible
    here (`why_not` says why), unless LORAFLEET_REQUIRE_CPU_KERNELS=1, which raises
    KernelUnavailableError instead. `cflags` join
    CFLAGS (and the key); a build with other flags needs its own `name` (one module per name)."""
    if name not in _modules:
        with _lock:
            if name not in _modules:
                module = None
                functions = [function] if isinstance(function, str) else list(function)
                try:
                    module = _load_or_build(name, source, functions, tuple(cflags))
                except Exception as e:  # no compiler, headers or ninja; a timeout: the reference still works
                    _why_not[name] = e
                    if not required():
                        _say(logging.WARNING, f"lorafleet: CPU kernel {name} unavailable ({_first_line(e)}); "
                                              "using the torch reference")
                _modules[name] = module
    if _modules[name] is None and required():
        why = _why_not[name]
        cause = why if isinstance(why, BaseException) else None
        raise KernelUnavailableError(f"CPU kernel {name} unavailable and LORAFLEET_REQUIRE_CPU_KERNELS=1: {why}") from cause
    return _modules[name]


def why_not(name: str) -> str:
    """Why the kernel `name` did not load (its build error's first line), or "" where it did."""
    why = _why_not.get(name)
    return "" if why is None else _first_line(why)


def cache_dir() -> Path:
    """Where built kernels live: LORAFLEET_KERNEL_CACHE, else $XDG_CACHE_HOME/lorafleet/kernels
    (~/.cache/lorafleet/kernels)."""
    env = os.environ.get("LORAFLEET_KERNEL_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "lorafleet" / "kernels"


def build_key(name: str, source: str, functions: Sequence[str], cflags: Sequence[str] = CFLAGS,
              ldflags: Sequence[str] = LDFLAGS) -> str:
    """sha256 (hex) over everything a kernel binary depends on; see the module docstring."""
    import torch

    parts = {
        "name": name,
        "source": source,
        "functions": list(functions),
        "cflags": list(cflags),
        "ldflags": list(ldflags),
        "torch": [torch.__version__, torch.version.git_version, bool(torch._C._GLIBCXX_USE_CXX11_ABI),
                  torch.version.cuda, getattr(torch.version, "hip", None)],
        "python": [sys.implementation.cache_tag, sysconfig.get_config_var("EXT_SUFFIX"), platform.machine()],
        "compiler": compiler_identity(),
        "cpu": cpu_identity(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def compiler_identity() -> str:
    """The first line of `$CXX --version` (torch's compiler: CXX, default c++), probed once per
    process and value of CXX; 'missing: ...' when it does not run."""
    cxx = os.environ.get("CXX") or "c++"
    if cxx not in _compilers:
        try:
            out = subprocess.run([*shlex.split(cxx), "--version"], capture_output=True, text=True, timeout=30,
                                 check=True).stdout
            _compilers[cxx] = f"{cxx}: {out.strip().splitlines()[0] if out.strip() else '?'}"
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            _compilers[cxx] = f"missing: {cxx}: {_first_line(e)}"
    return _compilers[cxx]


def cpu_identity() -> str:
    """The CPU model and its feature flags (what -march=native compiles for)."""
    fields = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant", "CPU part")
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            found: dict[str, str] = {}
            for line in f:
                key, sep, value = line.partition(":")
                key = key.strip()
                if sep and key in fields and key not in found:
                    found[key] = value.strip()
        if found:
            return "; ".join(f"{k}: {found[k]}" for k in fields if k in found)
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _load_or_build(name: str, source: str, functions: list[str], extra: tuple[str, ...] = ()):
    compiler = compiler_identity()
    if compiler.startswith("missing: "):
        cxx = os.environ.get("CXX") or "c++"
        raise CompilerMissingError(f"no C++ compiler: {cxx!r} does not run ({compiler.split(': ', 2)[-1]}); "
                                   "install g++ or clang++, or point CXX at one")
    key = build_key(name, source, functions, CFLAGS + extra)
    root = cache_dir()
    build_dir = root / f"{name}-{key[:16]}"
    module = _load_built(build_dir)
    if module is not None:
        return module
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _exclusive(root / f"{name}-{key}.lock", name):
        module = _load_built(build_dir)  # built by another process while this one waited
        if module is not None:
            return module
        return _build(name, source, functions, build_dir, key, extra)


def _build(name: str, source: str, functions: list[str], build_dir: Path, key: str, extra: tuple[str, ...] = ()):
    from torch.utils import cpp_extension  # looked up at call time: tests replace load_inline

    if (build_dir / STAMP).exists():  # a finished build that no longer loads: start over
        shutil.rmtree(build_dir, ignore_errors=True)
    build_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    baton = build_dir / TORCH_BATON
    if baton.exists():  # under our flock no torch build can be running here: a killed one left it
        baton.unlink(missing_ok=True)
        log.info("removed the lock file a killed build of %s left in %s", name, build_dir)
    _say(logging.INFO, f"lorafleet: compiling CPU kernel {name} (first start on this machine and torch build; "
                       f"usually 30-90 s) into {build_dir}")
    start = time.monotonic()
    module = cpp_extension.load_inline(name=name, cpp_sources=[source], functions=functions,
                                       extra_cflags=[*CFLAGS, *extra], extra_ldflags=list(LDFLAGS),
                                       build_directory=str(build_dir), verbose=False)
    seconds = time.monotonic() - start
    library = Path(getattr(module, "__file__", "") or "")
    if library.parent == build_dir and library.is_file():
        stamp = {"module": module.__name__, "library": library.name, "key": key, "seconds": round(seconds, 1),
                 "built_by": sys.executable, "built_at": time.time()}
        tmp = build_dir / f"{STAMP}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(stamp, indent=1))
        os.replace(tmp, build_dir / STAMP)
    _say(logging.INFO, f"lorafleet: built {name} in {seconds:.1f} s")
    return module


def _load_built(build_dir: Path):
    """The module a finished build left in `build_dir`, imported without torch's build step; None
    when there is none (or it does not load: it is then rebuilt)."""
    try:
        stamp = json.loads((build_dir / STAMP).read_text())
        library = build_dir / stamp["library"]
        module_name = stamp["module"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not library.is_file():
        return None
    try:
        import torch  # noqa: F401  (the library links against the loaded libtorch)

        spec = importlib.util.spec_from_file_location(module_name, library)
        assert spec is not None and spec.loader is not None  # a file's (else: rebuilt, as below)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception as e:  # a damaged library: rebuild it
        log.warning("the cached CPU kernel %s does not load (%s); rebuilding it", library, _first_line(e))
        return None


@contextmanager
def _exclusive(path: Path, name: str) -> Iterator[None]:
    """Hold an exclusive flock on `path`, waiting at most LORAFLEET_KERNEL_BUILD_TIMEOUT seconds."""
    if fcntl is None:
        yield
        return
    timeout = _build_timeout()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            if not told:
                _say(logging.INFO, f"lorafleet: waiting for another process that is compiling CPU kernel {name} "
                                   f"(lock {path}, pid {_holder(path)})")
                told = True
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"gave up after {timeout:g} s waiting for another process (pid {_holder(path)}) "
                                   f"compiling it (lock {path}); LORAFLEET_KERNEL_BUILD_TIMEOUT sets the wait")
            time.sleep(min(0.2, left))
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


def _build_timeout() -> float:
    raw = os.environ.get("LORAFLEET_KERNEL_BUILD_TIMEOUT", "")
    try:
        return max(0.0, float(raw)) if raw.strip() else DEFAULT_BUILD_TIMEOUT_S
    except ValueError:
        log.warning("LORAFLEET_KERNEL_BUILD_TIMEOUT=%r is not a number of seconds; using %g",
                    raw, DEFAULT_BUILD_TIMEOUT_S)
        return DEFAULT_BUILD_TIMEOUT_S


def _first_line(e: BaseException | str) -> str:
    text = str(e).strip() or type(e).__name__
    line = text.splitlines()[0].strip()
    return line if len(line) <= 400 else line[:397] + "..."


def _say(level: int, message: str) -> None:
    """`message` on stderr, once: through the logger where logging is set up, printed besides
    unless that logging already reaches stderr (no duplicate line under `lorafleet serve`)."""
    logged = log.hasHandlers() and log.isEnabledFor(level)
    if logged:
        log.log(level, message)
    if not (logged and _logs_to_stderr(level)):
        print(message, file=sys.stderr, flush=True)


def _logs_to_stderr(level: int) -> bool:
    logger: logging.Logger | None = log
    while logger is not None:
        for handler in logger.handlers:
            if level < handler.level:
                continue
            stream = getattr(handler, "stream", None)
            console = getattr(handler, "console", None)  # rich's RichHandler
            if stream is not None and stream in (sys.stderr, sys.__stderr__):
                return True
            if console is not None and getattr(console, "stderr", False):
                return True
        logger = logger.parent if logger.propagate else None
    return False
