"""ServerState: what the routes share. It lives on the event loop's thread only (no locks): the
engine worker, the settings, and the admission count that bounds the queue."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from lorafleet.config import ServerConfig
from lorafleet.errors import QueueFullError, ShuttingDownError
from lorafleet.server.protocol import ANY_TOKEN_BYTES
from lorafleet.server.worker import EngineWorker
from lorafleet.snapshot import ServerInfo


@dataclass
class ServerState:
    worker: EngineWorker
    config: ServerConfig
    base_name: str                       # the base's name in `model` and /v1/models
    model_path: str
    sampling_defaults: dict = field(default_factory=dict)  # the model's generation_config.json
    started: float = field(default_factory=time.time)
    pid: int = field(default_factory=os.getpid)
    pending: int = 0                     # admitted requests (one per prompt) not yet answered
    draining: bool = False               # SIGTERM seen: answer what is in flight, admit nothing
    num_rejected: int = 0                # refused by the queue limit or while draining
    num_disconnects: int = 0             # clients that hung up before their answer
    runs: set = field(default_factory=set)  # the completions.Run of every request in flight

    def admit(self, n: int) -> None:
        """Count `n` new requests in, or refuse them: 503 while draining, 429 past the limit."""
        if self.draining:
            self.num_rejected += n
            raise ShuttingDownError("the daemon is shutting down and takes no new requests")
        if self.pending + n > self.config.max_pending:
            self.num_rejected += n
            raise QueueFullError(f"the daemon already holds {self.pending} requests (limit "
                                 f"{self.config.max_pending}, `serve --max-pending`); retry later")
        self.pending += n

    def release(self, n: int) -> None:
        self.pending -= n
        assert self.pending >= 0, "released more requests than admitted"

    def cut_short(self) -> None:
        """The drain timed out: answer every request still in flight with a 503 (a stream gets
        an error event), which aborts it in the engine."""
        for run in list(self.runs):
            run.sink.queue.put_nowait(ShuttingDownError("the daemon stopped before this request finished "
                                                        f"(drain timeout {self.config.drain_timeout:g}s)"))

    @property
    def tokenizer(self):
        return self.worker.engine.tokenizer  # immutable: safe to use off the engine thread

    @property
    def max_model_len(self) -> int:
        return self.worker.engine.max_model_len

    @property
    def max_text_bytes(self) -> int:
        """The most UTF-8 text any request's context could hold, whatever tokenizer it uses: longer
        strings are refused before a body is parsed (`protocol.decode_body`)."""
        tokenizer = self.tokenizer
        return self.max_model_len * max(ANY_TOKEN_BYTES, tokenizer.max_token_bytes if tokenizer is not None else 0)

    def info(self) -> ServerInfo:
        """`/v1/stats`'s `server`."""
        return {"pid": self.pid, "socket": self.config.socket, "model": self.base_name,
                "model_path": self.model_path, "sampling_defaults": self.sampling_defaults,
                "started": self.started, "uptime_s": time.time() - self.started,
                "tcp": f"{self.config.host}:{self.config.port}" if self.config.host else None,
                "pending": self.pending, "max_pending": self.config.max_pending,
                "draining": self.draining, "num_rejected": self.num_rejected,
                "num_disconnects": self.num_disconnects, "engine_alive": self.worker.alive,
                "engine_steps_failed": self.worker.steps_failed}
