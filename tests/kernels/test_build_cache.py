"""The CPU kernel build cache (`lorafleet.kernels.build`): one build per (source, torch build,
flags, compiler, CPU) whatever environment asks, a killed build never blocks a later start, a
held build lock times out with a message, and no compiler means one line and the torch reference.

Every start is a real Python process with its own empty cache (LORAFLEET_KERNEL_CACHE under
tmp_path), building a tiny extension (about 40 s on two cores; three builds in this file). The
second environment is a `venv --without-pip` that sees this environment's packages through a
symlink, so its torch lives at another path, as a second environment's own install of the same
torch build would: torch's build step alone would rebuild there (its compile command changed).
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import shutil
import signal
import site
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorafleet.kernels import build

pytestmark = pytest.mark.heavy  # real builds of the C++ kernels

FUNCTION = "add_one"
BUILD_S = 600  # the most one start that compiles may take here
LOAD_S = 120  # the most one start that only loads may take (import torch included)

START = r"""
import json, sys, time
import torch
from lorafleet.kernels import build

name, source = sys.argv[1], open(sys.argv[2]).read()
start = time.monotonic()
module = build.compile_inline(name, source, "add_one")
seconds = time.monotonic() - start
if module is None:
    print(json.dumps({"module": None}))
    sys.exit(3)
assert module.add_one(torch.zeros(3)).tolist() == [1.0, 1.0, 1.0]
print(json.dumps({"module": module.__file__, "seconds": seconds, "prefix": sys.prefix, "torch": torch.__file__}))
"""

KEY = r"""
import sys
from lorafleet.kernels import build

print(build.build_key(sys.argv[1], open(sys.argv[2]).read(), ["add_one"]))
"""


def source(tag: str) -> str:
    return (f"// lorafleet build-cache test: {tag}\n"
            f"torch::Tensor {FUNCTION}(torch::Tensor x) {{ return x + 1; }}\n")


def _compiler_missing() -> str | None:
    cxx = shlex.split(os.environ.get("CXX") or "c++")[0]
    return None if shutil.which(cxx) else f"no C++ compiler ({cxx})"


def _toolchain_missing() -> str | None:
    return _compiler_missing() or (None if shutil.which("ninja", path=_path()) else "no ninja")


def _path() -> str:
    """PATH with this environment's bin first (ninja comes with the package, not the system)."""
    return os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])


# with LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI) these run, and fail, where kernels cannot be built
needs_toolchain = pytest.mark.skipif(_toolchain_missing() is not None and not build.required(),
                                     reason=f"cannot build C++ kernels here: {_toolchain_missing()}")
needs_compiler = pytest.mark.skipif(_compiler_missing() is not None and not build.required(),
                                    reason=f"the build lock is only reached with a compiler: {_compiler_missing()}")


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LORAFLEET_KERNELS", "LORAFLEET_REQUIRE_CPU_KERNELS", "LORAFLEET_KERNEL_BUILD_TIMEOUT",
                        "LORAFLEET_KERNEL_CACHE", "VIRTUAL_ENV")}
    env.update(LORAFLEET_KERNEL_CACHE=str(cache), PATH=_path(), **extra)
    return env


def _script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _start(python: str, tmp_path: Path, name: str, src: Path, cache: Path, timeout: float, **extra: str):
    """One start: a process that loads kernel `name` (building it if need be). Returns the
    completed process and its report (the JSON line it printed, or None)."""
    script = _script(tmp_path, "start.py", START)
    done = subprocess.run([python, str(script), name, str(src)], cwd=tmp_path, env=_env(cache, **extra),
                          capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    report = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    return done, report


def _wait_for(condition, deadline_s: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + deadline_s
    while not condition():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the process exited (rc {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {deadline_s} s waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def env2(tmp_path_factory) -> str:
    """The python of a second virtual environment using this one's packages (torch, lorafleet)
    through another path."""
    root = tmp_path_factory.mktemp("env2")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    python = str(root / "venv" / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    lines = []
    for i, packages in enumerate(site.getsitepackages()):
        if os.path.isdir(packages):
            link = root / f"shared-site-{i}"
            link.symlink_to(packages, target_is_directory=True)
            lines.append(f"import site; site.addsitedir({str(link)!r})")  # runs its .pth files too (editable installs)
    (Path(purelib) / "lorafleet-shared.pth").write_text("\n".join(lines) + "\n")
    return python


@needs_toolchain
def test_two_environments_starting_in_turn_build_the_kernel_once(tmp_path, env2):
    cache = tmp_path / "cache"
    src = _script(tmp_path, "kernel.cpp", source("two environments"))
    reports = []
    for i, python in enumerate([sys.executable, env2, sys.executable, env2]):
        done, report = _start(python, tmp_path, "t_two_envs", src, cache, BUILD_S if i == 0 else LOAD_S,
                              LORAFLEET_REQUIRE_CPU_KERNELS="1")
        assert done.returncode == 0 and report, f"start {i + 1} failed:\n{done.stderr[-4000:]}"
        compiled = "lorafleet: compiling CPU kernel t_two_envs" in done.stderr
        assert compiled == (i == 0), f"start {i + 1}: compiled={compiled}\n{done.stderr[-4000:]}"
        if i == 0:
            assert "lorafleet: built t_two_envs in" in done.stderr
            library = Path(report["module"])
            built = library.stat().st_mtime_ns
        else:
            assert "lorafleet:" not in done.stderr, done.stderr  # loading says nothing
            assert report["module"] == str(library) and library.stat().st_mtime_ns == built
        reports.append(report)
    # two environments indeed: other prefixes, torch imported from other paths
    assert reports[0]["prefix"] != reports[1]["prefix"] and reports[0]["torch"] != reports[1]["torch"]
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [library.parent.name]
    print("load times after the build:", [round(r["seconds"], 3) for r in reports[1:]])


@needs_toolchain
def test_a_start_killed_mid_build_does_not_block_the_next_start(tmp_path):
    cache = tmp_path / "cache"
    src = _script(tmp_path, "kernel.cpp", source("killed mid-build"))
    script = _script(tmp_path, "start.py", START)
    with open(tmp_path / "first.out", "w") as out, open(tmp_path / "first.err", "w") as err:
        first = subprocess.Popen([sys.executable, str(script), "t_killed", str(src)], cwd=tmp_path,
                                 env=_env(cache), stdout=out, stderr=err, start_new_session=True)
    try:
        def compiling() -> bool:  # torch wrote its ninja file: the compiler runs next
            return any((d / "build.ninja").exists() for d in cache.glob("t_killed-*"))
        _wait_for(compiling, 120, "the build to start", first)
        time.sleep(1.0)
        assert first.poll() is None, "the build finished before it could be killed"
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)  # the process and its ninja and compiler
        first.wait(timeout=30)
    (build_dir,) = [d for d in cache.glob("t_killed-*") if d.is_dir()]
    assert not (build_dir / build.STAMP).exists()
    baton = build_dir / build.TORCH_BATON
    if not baton.exists():  # the worst case: torch's baton left behind (torch alone waits on it forever)
        baton.touch()

    done, report = _start(sys.executable, tmp_path, "t_killed", src, cache, BUILD_S,
                          LORAFLEET_REQUIRE_CPU_KERNELS="1", LORAFLEET_KERNEL_BUILD_TIMEOUT="60")
    assert done.returncode == 0 and report, done.stderr[-4000:]
    assert "lorafleet: compiling CPU kernel t_killed" in done.stderr and "waiting" not in done.stderr
    assert (build_dir / build.STAMP).exists() and not baton.exists()


def test_the_key_covers_source_and_flags_and_is_the_same_in_every_process(tmp_path, env2, monkeypatch):
    name, src = "t_key", source("key")
    key = build.build_key(name, src, [FUNCTION])
    assert len(key) == 64 and key == build.build_key(name, src, [FUNCTION], build.CFLAGS, build.LDFLAGS)
    others = {
        build.build_key(name, src + "// edited\n", [FUNCTION]),
        build.build_key(name, src, [FUNCTION], cflags=["-O2", "-march=native", "-fopenmp"]),
        build.build_key(name, src, [FUNCTION], cflags=["-O3", "-fopenmp"]),
        build.build_key(name, src, [FUNCTION], ldflags=[]),
        build.build_key(name, src, [FUNCTION, "other"]),
    }
    monkeypatch.setattr(build, "cpu_identity", lambda: "another CPU; flags: sse2")
    others.add(build.build_key(name, src, [FUNCTION]))
    monkeypatch.undo()
    assert key not in others and len(others) == 6

    script = _script(tmp_path, "key.py", KEY)
    path = _script(tmp_path, "kernel.cpp", src)
    for python in (sys.executable, sys.executable, env2):
        done = subprocess.run([python, str(script), name, str(path)], cwd=tmp_path, env=_env(tmp_path / "cache"),
                              capture_output=True, text=True, timeout=LOAD_S)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == key


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LORAFLEET_KERNEL_CACHE", str(tmp_path / "k"))
    assert build.cache_dir() == tmp_path / "k"
    monkeypatch.delenv("LORAFLEET_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.cache_dir() == tmp_path / "xdg" / "lorafleet" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert build.cache_dir() == Path.home() / ".cache" / "lorafleet" / "kernels"


@needs_compiler
def test_a_build_lock_held_too_long_gives_up_with_a_message(tmp_path):
    cache = tmp_path / "cache"
    src_text = source("lock timeout")
    src = _script(tmp_path, "kernel.cpp", src_text)
    cache.mkdir()
    key = build.build_key("t_lock", src_text, [FUNCTION])  # this process probes the same compiler and CPU
    fd = os.open(cache / f"t_lock-{key}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{os.getpid()}\n".encode())
        started = time.monotonic()
        done, report = _start(sys.executable, tmp_path, "t_lock", src, cache, LOAD_S,
                              LORAFLEET_KERNEL_BUILD_TIMEOUT="1")
        assert done.returncode == 3 and report == {"module": None}, done.stderr
        unavailable = [line for line in done.stderr.splitlines() if "unavailable" in line]
        assert len(unavailable) == 1, done.stderr
        assert unavailable[0].startswith("lorafleet: CPU kernel t_lock unavailable (gave up after 1 s")
        assert f"pid {os.getpid()}" in unavailable[0] and "LORAFLEET_KERNEL_BUILD_TIMEOUT" in unavailable[0]
        assert unavailable[0].endswith("; using the torch reference")
        assert "lorafleet: waiting for another process" in done.stderr
        assert "lorafleet: compiling" not in done.stderr

        done, report = _start(sys.executable, tmp_path, "t_lock", src, cache, LOAD_S,
                              LORAFLEET_KERNEL_BUILD_TIMEOUT="1", LORAFLEET_REQUIRE_CPU_KERNELS="1")
        assert done.returncode == 1 and report is None
        assert "KernelUnavailableError: CPU kernel t_lock unavailable" in done.stderr
        assert "gave up after 1 s" in done.stderr and "using the torch reference" not in done.stderr
        assert time.monotonic() - started < LOAD_S
    finally:
        os.close(fd)
    assert not any(cache.glob("t_lock-*/*.so"))  # nothing was built behind the lock


def test_without_a_compiler_one_line_says_the_torch_reference_is_used(tmp_path):
    cache = tmp_path / "cache"
    src = _script(tmp_path, "kernel.cpp", source("no compiler"))
    done, report = _start(sys.executable, tmp_path, "t_no_cxx", src, cache, LOAD_S,
                          CXX=str(tmp_path / "no-such-dir" / "c++"))
    assert done.returncode == 3 and report == {"module": None}, done.stderr
    lines = [line for line in done.stderr.splitlines() if "lorafleet" in line or "unavailable" in line]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("lorafleet: CPU kernel t_no_cxx unavailable (no C++ compiler: ")
    assert lines[0].endswith("; using the torch reference")
    assert "Traceback" not in done.stderr and not cache.exists()
