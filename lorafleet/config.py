"""Engine settings as one frozen dataclass, validated once.

Sizes that other engines make start-up knobs (max adapters, max rank) do not exist here: the
unified pool's byte size is the only memory knob, and KV and adapters share it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from lorafleet.errors import ConfigError

DEFAULT_CPU_POOL_BYTES = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"
    dtype: str | None = None            # None: fp32 on CPU, the checkpoint's dtype on GPU
    pool_bytes: int | None = None       # the unified pool; None: 1 GiB on CPU, most free memory on GPU
    block_size: int = 16                # tokens per KV page
    max_num_seqs: int = 256             # sequences in one step
    max_num_batched_tokens: int = 2048  # tokens in one step (the chunked-prefill budget)
    max_model_len: int | None = None    # None: the model's limit
    seed: int = 0                       # the generator of requests that bring no seed
    debug_checks: bool = False          # check_integrity() after every step (tests turn it on)

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.pool_bytes is not None and (not isinstance(self.pool_bytes, int) or self.pool_bytes < 1):
            raise ConfigError(f"pool_bytes must be a positive integer, got {self.pool_bytes!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        if os.environ.get("LORAFLEET_DEBUG_CHECKS") == "1":
            kwargs.setdefault("debug_checks", True)
        unknown = set(kwargs) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return cls(**kwargs)
