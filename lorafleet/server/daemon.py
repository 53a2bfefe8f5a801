"""The daemon's life: claim the socket, build the engine, serve, drain, clean up.

1. Claim: the pid file beside the socket is created exclusively and locked (flock) for the
   daemon's whole life, so a second daemon on the same socket refuses at once, naming the first
   one's pid. An existing pid file is replaced only when it is a dead daemon's: a pid file whose
   lock nobody holds (see `PidLock`); anything else there is refused, never overwritten. A socket
   file nobody answers on is stale (its daemon died) and is removed.
2. Build the engine, load the start-up adapters, then bind: directories created for the socket
   are 0700, an existing one keeps its mode if safe (`paths.socket_dir`), and the socket is
   created 0600 (under a umask, so it is never briefly open to others).
3. Serve with uvicorn on the pre-bound sockets (the Unix socket, and TCP when asked), through
   `uvicorn.Server.run`, so on uvloop (a dependency; uvicorn's "auto" picks it: the event loop's
   CPU per streamed token measured lower than on asyncio's loop) and httptools, whose protocol
   `connections.guarded_protocol` bounds: a header timeout for every connection, a cap on TCP
   connections, the open-file limit raised.
4. SIGTERM or SIGINT: stop admitting (new requests get 503), let in-flight requests finish for
   up to `drain_timeout` seconds, answer what is left with 503 (a stream gets an error event;
   either way the engine aborts it), stop the engine thread, remove the socket and the pid
   file, exit 0. A second signal stops waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import logging
import os
import signal
import socket
import stat
import threading
from pathlib import Path

import uvicorn

from lorafleet import openmp
from lorafleet.config import ServerConfig
from lorafleet.errors import ConfigError, DaemonRunningError
from lorafleet.model.grammar import Constraint
from lorafleet.model.config import generation_defaults
from lorafleet.paths import PID_FILE, check_socket_path, command_for, pidfile_path, socket_dir
from lorafleet.server.app import create_app
from lorafleet.server import renders
from lorafleet.server.connections import guarded_protocol, raise_fd_limit
from lorafleet.server.state import ServerState
from lorafleet.server.worker import EngineWorker

WARM_GRAMMAR = Constraint("choice", '["x"]', "warm-up")
log = logging.getLogger("lorafleet.server")
FLUSH_TIMEOUT = 5.0  # after the drain: seconds for the last answers to reach their clients


class PidLock:
    """The daemon's pid file: created exclusively and flock'ed while the daemon lives (the kernel
    drops the lock if it dies). An existing file is replaced only when it is a dead daemon's: a
    regular file holding just a pid and a newline, whose lock nobody holds. The lock decides, not
    whether a process of that pid runs: a dead daemon's pid may be reused by any process. Anything
    else is refused, so a typo'd --socket never clobbers someone's file."""

    FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def acquire(self, socket_path: Path) -> PidLock:
        try:
            fd = os.open(self.path, self.FLAGS, 0o600)
        except FileExistsError:
            self._remove_stale(socket_path)
            try:
                fd = os.open(self.path, self.FLAGS, 0o600)
            except FileExistsError:
                raise DaemonRunningError(f"another daemon claimed {self.path} while lorafleet replaced it; "
                                         "check with `lorafleet status` or choose another --socket") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # only fails if another serve is inspecting it
        except OSError:
            self.fd = fd
            self.release()
            raise DaemonRunningError(f"another daemon is starting on {socket_path}; "
                                     "check with `lorafleet status` or choose another --socket") from None
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def _remove_stale(self, socket_path: Path) -> None:
        """Unlink the existing pid file if it is a dead daemon's; raise saying why not otherwise."""
        not_ours = ConfigError(f"{self.path} exists and is not a lorafleet pid file; remove it or "
                               "choose another --socket")
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return  # gone meanwhile: the exclusive create decides
        except OSError:  # a symlink (ELOOP) or unreadable
            raise not_ours from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise not_ours
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = False
            except BlockingIOError:
                locked = True
            content = os.read(fd, 32)
            if locked:
                pid = content.decode(errors="replace").strip() or "?"
                raise DaemonRunningError(f"a lorafleet daemon (pid {pid}) already serves {socket_path}; "
                                         f"stop it with `{command_for(socket_path, 'stop')}` or choose another --socket")
            if not PID_FILE.fullmatch(content):
                raise not_ours
            now = os.lstat(self.path)
            if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
                raise DaemonRunningError(f"{self.path} changed while lorafleet inspected it; "
                                         "check with `lorafleet status` or choose another --socket")
            log.info("removing stale pid file %s (its daemon, pid %d, is gone: nobody holds its lock)",
                     self.path, int(content))
            self.path.unlink()
        finally:
            os.close(fd)

    def release(self) -> None:
        """Delete the pid file only if it is still the one we created (someone may have replaced
        it meanwhile), then drop the lock."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            ours, now = os.fstat(self.fd), os.lstat(self.path)
            if (ours.st_ino, ours.st_dev) == (now.st_ino, now.st_dev):
                self.path.unlink()
        os.close(self.fd)
        self.fd = None


def clear_stale_socket(path: Path) -> None:
    """Remove a socket file that no daemon answers on; refuse if one does."""
    if not path.exists() and not path.is_symlink():
        return
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise ConfigError(f"{path} exists and is not a socket; choose another --socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        log.info("removing stale socket %s", path)
        path.unlink()
        return
    finally:
        probe.close()
    raise DaemonRunningError(f"a daemon already answers on {path}; stop it with `{command_for(path, 'stop')}` "
                             "or choose another --socket")


def bind_unix(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class DaemonServer(uvicorn.Server):
    """uvicorn's server with our signal handling: drain, then return (uvicorn's own handler
    re-raises the signal after shutdown, which would end the process with a non-zero status)."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handle(sig, frame):
            if self.should_exit:
                log.warning("second %s: not waiting for in-flight requests", signal.Signals(sig).name)
                self.force_exit = True
            else:
                log.info("%s: draining %d in-flight request(s) (up to %gs), then exiting",
                         signal.Signals(sig).name, self.state.pending, self.state.config.drain_timeout)
            self.state.draining = True
            self.should_exit = True
        originals = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in originals.items():
                signal.signal(s, h)

    async def startup(self, sockets=None):
        loop = type(asyncio.get_running_loop())
        log.info("event loop: %s.%s", loop.__module__, loop.__qualname__)  # uvloop.Loop: point 3
        await super().startup(sockets)

    async def shutdown(self, sockets=None):
        """Close the listeners, wait up to drain_timeout for in-flight requests, answer what is
        left with 503, then let uvicorn close the connections."""
        for server in self.servers:
            server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.state.config.drain_timeout
        while self.state.pending and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.state.pending:
            log.warning("drain timeout: cutting %d request(s) short", self.state.pending)
            self.state.cut_short()
        await super().shutdown(sockets)
        renders.pool().close()  # its zygote and idle render processes end with their sockets


def _stop_starting(signum, frame) -> None:
    log.info("stopped while starting (SIGTERM)")
    raise SystemExit(0)


def serve(engine_factory, config: ServerConfig, base_name: str, model_path: str,
          adapters: dict[str, Path] | None = None, resolver=None) -> None:
    """Run the daemon until SIGTERM/SIGINT. `engine_factory()` builds the Engine (after the
    socket is claimed, so a second daemon refuses before spending time on the model).
    `resolver`: serves store adapters on their first request (`store.resolver`), or None."""
    sock_path = check_socket_path(Path(config.socket))
    socket_dir(sock_path.parent)
    # SIGTERM while starting (`lorafleet stop` of a daemon not answering yet) unwinds through the
    # `finally` below, so the pid file goes with it; the server's own handlers replace this one.
    # Set before the pid file names this process, which is when `stop` may signal it.
    signal.signal(signal.SIGTERM, _stop_starting)
    lock = PidLock(pidfile_path(sock_path)).acquire(sock_path)
    worker = engine = None
    sockets: list[socket.socket] = []
    try:
        clear_stale_socket(sock_path)
        engine = engine_factory()
        if engine.tokenizer is not None:  # structured output's view of the base's vocabulary (a trivial
            engine.grammar(WARM_GRAMMAR)  # grammar builds it): seconds under the GIL, so before serving
        for name, path in (adapters or {}).items():
            engine.load_adapter(name, path)
            log.info("adapter %s loaded from %s", name, path)
        sockets.append(bind_unix(sock_path))
        if config.host:
            assert config.port is not None  # ServerConfig gives both or neither
            sockets.append(bind_tcp(config.host, config.port))
        worker = EngineWorker(engine, resolver=resolver)
        worker.start()
        # the engine's thread keeps the process's only OpenMP team (`lorafleet/openmp.py`): this
        # thread, which built the engine, serves HTTP from now on and gives its team up
        openmp.serial_thread()
        state = ServerState(worker, config, base_name, model_path,
                            sampling_defaults={**generation_defaults(Path(model_path)), **config.sampling})
        if state.sampling_defaults:
            log.info("sampling defaults where a request names none (the model's, then serve's flags): %s",
                     state.sampling_defaults)
        files = raise_fd_limit()
        log.info("open files: up to %d; TCP connections: up to %d", files, config.max_tcp_connections)
        server = DaemonServer(uvicorn.Config(
            create_app(state), log_config=None, access_log=config.access_log, lifespan="off",
            http=guarded_protocol(config.header_timeout, config.max_tcp_connections),
            timeout_graceful_shutdown=FLUSH_TIMEOUT, timeout_keep_alive=config.idle_timeout), state)  # type: ignore[arg-type]  # float seconds: uvicorn takes them
        # Everything built so far lives as long as the daemon: out of the collector's sight, a
        # full collection stays short instead of walking torch's and the web stack's objects,
        # which would otherwise stall every stream.
        gc.freeze()
        where = f"{sock_path}" + (f" and http://{config.host}:{config.port}" if config.host else "")
        log.info("serving %s as %r on %s (pid %d)", model_path, base_name, where, os.getpid())
        server.run(sockets=sockets)
        log.info("stopped")
    finally:
        if worker is not None:
            worker.stop()
        if engine is not None and hasattr(engine, "close"):
            engine.close()
        for s in sockets:
            s.close()
        if sockets:  # only ours: a socket we never bound may belong to someone else
            with contextlib.suppress(OSError):
                sock_path.unlink()
        lock.release()
