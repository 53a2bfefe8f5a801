"""The CPU kernels as one C++ extension, built from the sources in `kernels/cpu/`: the matmul
(`linear.cpp`; on packed weights `panels.cpp`), the row-wise ops (`pointwise.cpp`), LoRA
(`lora.cpp`), decode attention (`paged_attention.cpp`) and the driver that runs a decode step's
layers over them in one call (`decode_layers.cpp`), all on `vector.h`. Each `*_cpu.py` module
holds its kernel's semantics and Python wrappers; their `load` is this one's.

Why one extension: a kernel's build is mostly torch's headers (the same time whatever the
kernel), and the driver calls every kernel's C++, so it compiles their sources anyway.

How: `lorafleet_cpu.cpp` includes each kernel (each in a C++ namespace of its own, so their
private helpers may share names), puts the functions Python binds at global scope (`using`), then
the driver. `source` splices its local includes into one text, each file once, each piece after a
`#line` naming its file (a compiler's messages point at the real sources), and `build.py` keys
the build by that text: a change to any file is a new build.

Variants: what a CPU feature selects is chosen when the extension is built, by its flags, never
read from the CPU at run time, so that every variant can be forced, built and tested on any CPU
that can execute it (`runnable`: a CPU with AVX-512 runs every variant but `amx` without AMX):
- `avx2`: no AVX-512 (`vw` of 8 lanes; AVX2 where the CPU has it), AMD's layout (its choices
  were measured on AMD);
- `avx512`: AVX-512, Intel's layout: weights stay [N, K], several weight rows streamed side by side;
- `avx512-panels`: AVX-512, AMD's layout: fp32 weights packed in panels, one row streamed at a
  time, torch's fp32 GEMM through oneDNN (`vector.h`'s `amd_layout()`);
- `amx`: `avx512` with AMX (the quantized matmul's tiles, torch's bf16 GEMM from 13 rows).
Every variant but `amx` is built without AMX. `host_variant` is auto's choice for this CPU (AMD
with AVX-512: `avx512-panels`; with AMX-BF16: `amx`; other AVX-512: `avx512`; else `avx2`).
LORAFLEET_KERNELS names one to force it (`backend.select`). A process runs one variant, the first
a model selects (`use`): the Python wrappers call `load()`. LORAFLEET_KERNELS=torch chooses the
references instead, building nothing.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from lorafleet.errors import ConfigError
from lorafleet.kernels.build import compile_inline, cpu_identity

NAME = "lorafleet_cpu"
SOURCES = Path(__file__).resolve().parent / "cpu"
MAIN = "lorafleet_cpu.cpp"
_LOCAL_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$')
_USING = re.compile(r"^using \w+::(\w+);$", re.MULTILINE)
_NO_AMX = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
# each variant's flags beside build.CFLAGS (-march=native); LF_AMD_LAYOUT is vector.h's `amd_layout()`
FLAGS = {
    "avx2": ("-mno-avx512f", *_NO_AMX, "-DLF_AMD_LAYOUT=1"),
    "avx512": (*_NO_AMX, "-DLF_AMD_LAYOUT=0"),
    "avx512-panels": (*_NO_AMX, "-DLF_AMD_LAYOUT=1"),
    "amx": ("-DLF_AMD_LAYOUT=0",),
}
VARIANTS = tuple(FLAGS)
# the /proc/cpuinfo flags each variant's instructions need
NEEDS = {"avx2": (), "avx512": ("avx512f",), "avx512-panels": ("avx512f",),
         "amx": ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16")}
_current: str | None = None  # the process's variant (`use`)


def _splice(name: str, seen: set[str]) -> list[str]:
    """`name`'s lines with its local includes replaced by their files' (each file once)."""
    if name in seen:
        return []
    seen.add(name)
    out = [f'#line 1 "kernels/cpu/{name}"']
    for i, line in enumerate((SOURCES / name).read_text().splitlines(), start=1):
        m = _LOCAL_INCLUDE.match(line)
        if m:
            out += _splice(m.group(1), seen)
            out.append(f'#line {i + 1} "kernels/cpu/{name}"')
        elif line.strip() != "#pragma once":
            out.append(line)
    return out


@functools.cache
def source() -> tuple[str, tuple[str, ...]]:
    """(the extension's C++ as one text, the names it binds: the main file's `using`s, then the
    driver's)."""
    from lorafleet.kernels import decode_layers_cpu

    text = "\n".join(_splice(MAIN, set())) + "\n"
    main = (SOURCES / MAIN).read_text()
    return text, tuple(_USING.findall(main)) + tuple(decode_layers_cpu.FUNCTIONS)


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo's, as `build.cpu_identity` reads them)."""
    for part in cpu_identity().split("; "):
        key, _, value = part.partition(": ")
        if key in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@functools.cache
def runnable() -> tuple[str, ...]:
    """The variants this CPU can execute, in VARIANTS' order."""
    flags = cpu_flags()
    return tuple(v for v in VARIANTS if all(f in flags for f in NEEDS[v]))


@functools.cache
def host_variant() -> str:
    """Auto's choice for this CPU (module doc)."""
    here = runnable()
    if "avx512" not in here:
        return "avx2"
    if "amd" in cpu_identity().lower():
        return "avx512-panels"
    return "amx" if "amx" in here else "avx512"


def check(variant: str) -> str:
    """`variant` where this CPU can execute it; ConfigError naming what it lacks otherwise."""
    if variant not in FLAGS:
        raise ConfigError(f"unknown CPU kernel variant {variant!r}: use one of {', '.join(VARIANTS)}")
    missing = [f for f in NEEDS[variant] if f not in cpu_flags()]
    if missing:
        raise ConfigError(f"the CPU kernel variant {variant} needs {', '.join(missing)}, which this CPU lacks "
                          f"(it runs {', '.join(runnable())})")
    return variant


def use(variant: str) -> str:
    """Make `variant` the process's (what `load()` loads). ConfigError where another one already
    serves here: a process runs one variant, as the wrappers call `load()`."""
    global _current
    check(variant)
    if _current is not None and _current != variant:
        raise ConfigError(f"the CPU kernel variant {variant} was asked for in a process that runs {_current}: "
                          "one variant per process (LORAFLEET_KERNELS)")
    _current = variant
    return variant


def current() -> str:
    """The process's variant: the one in use, else auto's (`host_variant`)."""
    return _current or host_variant()


def name(variant: str) -> str:
    """The build's module name for `variant`."""
    return f"{NAME}_{variant.replace('-', '_')}"


def load(variant: str | None = None):
    """The compiled kernels of `variant` (default `current()`), or None when they cannot be built
    here (an error instead with LORAFLEET_REQUIRE_CPU_KERNELS=1). Each variant is its own build,
    cached by `build` under its flags."""
    variant = variant or _current or host_variant()
    text, functions = source()
    return compile_inline(name(variant), text, functions, cflags=FLAGS[variant])
