"""Engine settings as one frozen dataclass, validated once.

Sizes that other engines make start-up knobs (max adapters, max rank) do not exist here: the
unified pool's byte size is the only memory knob, and KV and adapters share it.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from lorafleet.errors import ConfigError

DEFAULT_CPU_POOL_BYTES = 1 << 30
# `kernels.backend.CHOICES`, spelt here so that the config stays free of torch (a test keeps them equal)
KERNELS = ("auto", "triton", "cpu", "avx2", "avx512", "avx512-panels", "amx", "torch")
# `model.loader.DTYPES`' names (and "auto"), spelt here for the same reason (a test keeps them equal)
DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"
    dtype: str | None = None            # None: fp32 on CPU, the checkpoint's dtype on GPU
    quantize: str | None = None         # int8 | int4: quantize a full-precision base's weights at load
    lora_dtype: str = "auto"            # adapters in the pool: auto (the model's dtype), or bfloat16 /
                                        # float16 under a float32 model (`memory.pool`: half the bytes)
    quantized_prefill: str = "float32"  # a quantized base's prefill matmuls under a float32 model: float32,
                                        # or bfloat16 (`LlamaModel.project`: faster where the CPU has bf16 dot products)
    pool_bytes: int | None = None       # the unified pool; None: 1 GiB on CPU, most free memory on GPU
    block_size: int = 16                # tokens per KV page
    max_num_seqs: int = 256             # sequences in one step
    max_num_batched_tokens: int = 2048  # tokens in one step (the chunked-prefill budget)
    max_model_len: int | None = None    # None: the model's limit
    host_cache_bytes: int = 1 << 30     # the host tier: adapters read and laid out, LRU
    policy: str = "vtc"                 # admission order: vtc (fair across adapters) or fcfs
    prefetch_workers: int = 2           # threads moving adapters disk -> host -> device
    min_resident_steps: int = 4         # an adapter just loaded is not evicted for another one
    seed: int = 0                       # the generator of requests that bring no seed
    debug_checks: bool = False          # check_integrity() after every step (tests turn it on)
    decode_graphs: str = "auto"         # auto (on with CUDA + Triton), on, off, fixed (the same
                                        # fixed-shape decode steps without capture: CPU tests)
    async_decode: str = "off"           # auto (on with CUDA), on, off: read a step's tokens after
                                        # launching the next (`Engine._launch`, `_settle`)
    prefix_cache: bool = True           # reuse the KV of full blocks of earlier prompts (memory/kv.py)
    eviction: str = "cost"              # cached KV and idle adapters: cost (memory/eviction.py) or lru
    kernels: str | None = None          # one of KERNELS (`kernels.backend.select`); None: LORAFLEET_KERNELS, else auto
    self_check: bool = False            # the kernels' logits against the torch reference's on one prompt
                                        # at start (engine/selfcheck.py); `lorafleet serve` turns it on

    def __post_init__(self):
        if self.policy not in ("vtc", "fcfs"):
            raise ConfigError(f"policy must be vtc or fcfs, got {self.policy!r}")
        if not isinstance(self.host_cache_bytes, int) or self.host_cache_bytes < 0:
            raise ConfigError(f"host_cache_bytes must be an integer >= 0, got {self.host_cache_bytes!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "prefetch_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.pool_bytes is not None and (not isinstance(self.pool_bytes, int) or self.pool_bytes < 1):
            raise ConfigError(f"pool_bytes must be a positive integer, got {self.pool_bytes!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len!r}")
        if not isinstance(self.prefix_cache, bool):
            raise ConfigError(f"prefix_cache must be True or False, got {self.prefix_cache!r}")
        if isinstance(self.dtype, str) and self.dtype not in DTYPES:  # a torch.dtype passes as it is
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES[1:])}, got {self.dtype!r}")
        if self.quantized_prefill not in ("float32", "bfloat16"):
            raise ConfigError(f"quantized_prefill must be float32 or bfloat16, got {self.quantized_prefill!r}")
        if self.lora_dtype not in DTYPES:
            raise ConfigError(f"lora_dtype must be one of {', '.join(DTYPES)}, got {self.lora_dtype!r}")
        if self.quantize not in (None, "int8", "int4"):
            raise ConfigError(f"quantize must be int8 or int4, got {self.quantize!r}")
        if self.eviction not in ("cost", "lru"):
            raise ConfigError(f"eviction must be cost or lru, got {self.eviction!r}")
        if self.async_decode not in ("auto", "on", "off"):
            raise ConfigError(f"async_decode must be auto, on or off, got {self.async_decode!r}")
        if self.decode_graphs not in ("auto", "on", "off", "fixed"):
            raise ConfigError(f"decode_graphs must be auto, on, off or fixed, got {self.decode_graphs!r}")
        if self.kernels is not None and self.kernels not in KERNELS:
            raise ConfigError(f"kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")
        if not isinstance(self.self_check, bool):
            raise ConfigError(f"self_check must be True or False, got {self.self_check!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        if os.environ.get("LORAFLEET_DEBUG_CHECKS") == "1":
            kwargs.setdefault("debug_checks", True)
        if os.environ.get("LORAFLEET_DEVICE"):  # the default device (tests run on a GPU with it)
            kwargs.setdefault("device", os.environ["LORAFLEET_DEVICE"])
        unknown = set(kwargs) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return cls(**kwargs)


@dataclass(frozen=True)
class ServerConfig:
    """How the daemon listens and admits requests (the engine's settings are EngineConfig).

    The Unix socket is always served; TCP (`host` and `port`) only with an API key, which then
    guards every /v1 route on TCP (as vLLM does, /health and /metrics stay open for probes and
    scrapers)."""

    socket: str
    host: str | None = None
    port: int | None = None
    api_key: str | None = None
    served_model_name: str | None = None  # the base's name in `model`; None: the model folder's name
    max_pending: int = 1024               # requests admitted (running + waiting); more get 429
    max_body_bytes: int = 4 << 20         # a larger request body gets 413 before it is read
    drain_timeout: float = 30.0           # seconds SIGTERM waits for in-flight requests
    access_log: bool = False
    header_timeout: float = 10.0          # seconds a connection has to send a request's headers
    idle_timeout: float = 30.0            # seconds a keep-alive connection may wait for its next request
    max_tcp_connections: int = 256        # TCP connections open at once; more are closed as they open
    sampling: dict = field(default_factory=dict)  # sampling defaults over the model's (`serve --temperature`...)

    def __post_init__(self):
        if (self.host is None) != (self.port is None):
            raise ConfigError("--host and --port go together")
        if self.port is not None and not (isinstance(self.port, int) and 0 < self.port < 65536):
            raise ConfigError(f"port must be in 1..65535, got {self.port!r}")
        if self.host is not None and not self.api_key:
            raise ConfigError("a TCP listener needs an API key (anyone who can reach the port could use the daemon): "
                              "pass --api-key KEY or set LORAFLEET_API_KEY; make one with "
                              "`python3 -c 'import secrets; print(secrets.token_urlsafe(24))'`")
        if not isinstance(self.max_pending, int) or self.max_pending < 1:
            raise ConfigError(f"max_pending must be a positive integer, got {self.max_pending!r}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be an integer >= 1024, got {self.max_body_bytes!r}")
        if not self.drain_timeout >= 0:
            raise ConfigError(f"drain_timeout must be >= 0 seconds, got {self.drain_timeout!r}")
        for name in ("header_timeout", "idle_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if not isinstance(self.max_tcp_connections, int) or self.max_tcp_connections < 1:
            raise ConfigError(f"max_tcp_connections must be a positive integer, got {self.max_tcp_connections!r}")


MAX_CONFIG_BYTES = 1 << 20  # a config file's size: settings take a few lines, so more is not one (read whole)
CONFIG_TABLES = ("serve",)  # what $LORAFLEET_HOME/config.toml may hold: one table per verb it sets defaults of


def read_config_file(path: Path) -> dict[str, dict]:
    """The tables of the config file at `path` ({} where there is none). A file that is not TOML,
    or that holds anything but the known tables, is a ConfigError naming the file: a misspelt
    table must not be ignored in silence."""
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: over {MAX_CONFIG_BYTES} bytes; a config file holds a table of settings")
        data = tomllib.loads(text.decode("utf-8"))
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    except RecursionError:  # tomllib recurses once per nested array or inline table
        raise ConfigError(f"{path}: its values nest too deeply to read (arrays or inline tables)") from None
    for key, value in data.items():
        if key not in CONFIG_TABLES or not isinstance(value, dict):
            raise ConfigError(f"{path}: unknown {'table' if isinstance(value, dict) else 'key'} {key!r} "
                              f"(known tables: {', '.join(f'[{t}]' for t in CONFIG_TABLES)})")
    return data


def pool_bytes_for(cfg: EngineConfig, device) -> int:
    """The pool's size: `pool_bytes` where given; on a GPU 85% of its free memory (the weights
    are loaded by then); on the CPU DEFAULT_CPU_POOL_BYTES."""
    if cfg.pool_bytes is not None:
        return cfg.pool_bytes
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.85)
    return DEFAULT_CPU_POOL_BYTES
