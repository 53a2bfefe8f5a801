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
the build by that text: a change to any file is a new build. LORAFLEET_KERNELS=torch chooses the
references instead, building nothing (`backend.select`).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from lorafleet.kernels.build import load_kernel

NAME = "lorafleet_cpu_v2"
SOURCES = Path(__file__).resolve().parent / "cpu"
MAIN = "lorafleet_cpu.cpp"
_LOCAL_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$')
_USING = re.compile(r"^using \w+::(\w+);$", re.MULTILINE)


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


def load(avx2: bool = False):
    """The compiled kernels, or None when they cannot be built here (an error instead with
    LORAFLEET_REQUIRE_CPU_KERNELS=1). `avx2`: the build without AVX-512 (`build.load_kernel`),
    which the tests run beside the native one."""
    text, functions = source()
    return load_kernel(NAME, text, functions, avx2)
