"""One registered adapter's record: its weights' identity and where they are (disk, host cache,
device pages), its holds and its counters. `memory/residency.py` is its one writer; every other
part reads it (the scheduler, the runner, the prefetcher through residency's interface, stats)."""

from __future__ import annotations

import itertools
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lorafleet.memory.host_cache import HostAdapter
from lorafleet.snapshot import AdapterInfo, Tier, Variant

if TYPE_CHECKING:
    from lorafleet.model.tokenizer import Tokenizer

RECENT = 64  # per adapter: the last loads' seconds and requests' exposed waits kept (for p50/p99)
_uids = itertools.count(1)


@dataclass(frozen=True)
class Inspected:
    """What registering an adapter reads of its files (`AdapterResidency.inspect`, on any thread)."""

    numel: int                   # elements it takes in pages
    vocab_size: int | None = None  # its own vocabulary's size (None: the base's)
    tokenizer: Tokenizer | None = None  # its own tokenizer, where it has its own vocabulary
    saved: tuple = ()            # the modules it has its own copy of
    invocation: tuple[int, ...] | None = None  # its aLoRA invocation sequence (`adapters/alora.py`); None: plain


@dataclass(eq=False)
class AdapterEntry:
    """One adapter's weights and where they are. Written by AdapterResidency only."""

    name: str
    path: Path
    owner: int                           # its pool owner id
    uid: int = field(default_factory=lambda: next(_uids))
    digest: str | None = None            # known once the weights have been read
    trusted_digest: str | None = None    # from the store: validated and hashed at pull, not again
    numel: int = 0                       # elements it takes in pages (weights, row table), from the file header
    vocab_size: int | None = None        # its own vocabulary's size (`adapters/heads.py`); None: the base's
    tokenizer: Tokenizer | None = None   # its own tokenizer (with its own vocabulary), read at registration
    host: HostAdapter | None = None      # set while in the host cache (or being copied)
    pages: list[int] | None = None       # device pages, allocated
    ready: bool = False                  # pages hold the weights
    row_table: int | None = None         # the pool's int64 index of its row table, while ready
    max_rank: int = 0                    # its largest rank, once loaded
    posts: dict | None = None            # (layer, module) -> "dora" | "bias", its epilogues, once loaded
    saved: tuple = ()                    # the modules it has its own copy of (embed_tokens, lm_head, norms): known at registration
    invocation: tuple[int, ...] | None = None  # its aLoRA invocation sequence: known at registration; None: plain LoRA
    copies: tuple | None = None          # those it serves its copy of, once loaded (copies equal to the base's dropped)
    heads: object = None                 # adapters.batch.HeadParts: its own embedding / LM head / norms in its pages, while ready
    kv_salt: bytes | None = None         # what names its KV blocks in the prefix cache (memory/kv.py), once ready
    loading: Future | None = None        # Future of the disk -> host load
    copying: Future | None = None        # Future of the host -> device copy
    error: str | None = None             # the last load failed with this message
    users: int = 0
    pins: int = 0
    last_used: float = 0.0               # a request used it, or it became ready: the eviction order's clock
    last_request: float = 0.0            # a request used it (0: none yet): what `ps` shows
    ready_step: int = 0
    served: bool = False                 # a request ran on it since it became ready
    ranks: dict[str, int] = field(default_factory=dict)
    num_params: int = 0
    hits: int = 0
    misses: int = 0
    disk_loads: int = 0
    device_loads: int = 0
    evictions: int = 0
    load_time_s: float = 0.0
    recent_loads: deque = field(default_factory=lambda: deque(maxlen=RECENT))  # seconds of each disk load
    recent_waits: deque = field(default_factory=lambda: deque(maxlen=RECENT))  # finished requests' exposed waits

    @property
    def variant(self) -> Variant | None:
        """"lora", "dora" or "lora_bias" once loaded (None before: its files have not been read)."""
        if self.posts is None:
            return None
        return "dora" if "dora" in self.posts.values() else "lora_bias" if self.posts else "lora"

    @property
    def tier(self) -> Tier:
        return "device" if self.ready else "host" if self.host is not None else "disk"

    def info(self) -> AdapterInfo:
        info = self._info()
        if self.invocation is not None:  # an aLoRA only: a plain adapter's record stays as it was
            info["invocation_tokens"] = list(self.invocation)
        return info

    def _info(self) -> AdapterInfo:
        return {"name": self.name, "path": str(self.path), "digest": self.digest, "tier": self.tier,
                "ranks": self.ranks, "modules": sorted(self.ranks), "variant": self.variant,
                "saved_modules": list(self.saved if self.copies is None else self.copies),  # once loaded: those served
                "vocab_size": self.vocab_size, "params": self.num_params,
                "pages": len(self.pages or ()), "users": self.users,
                "pinned": self.pins > 0, "hits": self.hits, "misses": self.misses,
                "loads": self.disk_loads, "device_loads": self.device_loads,
                "evictions": self.evictions, "load_time_s": self.load_time_s, "error": self.error,
                # seconds since a request last used it; None: no request has yet (its load is not a use)
                "idle_s": time.monotonic() - self.last_request if self.last_request else None}
