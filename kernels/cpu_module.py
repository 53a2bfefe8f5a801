"""The CPU kernels as one C++ extension: the matmul (`linear_cpu`; on packed weights
`panels_cpu`), the row-wise ops (`pointwise_cpu`), LoRA (`lora_cpu`), decode attention
(`paged_attention_cpu`) and the driver that runs a decode step's layers over them in one call
(`decode_layers_cpu`).

Why one: a kernel's build is mostly torch's headers (~30 s each on 2 cores, whatever the
kernel), so five extensions made a first start compile for ~2.5 min where one takes ~40 s; and
the driver calls every kernel's C++, so it had to compile their sources anyway.

How: `cpu_vector`'s shared code, then every `#include` of the kernels' sources once, then each
kernel's source in a C++ namespace of its own (so their private helpers may share names), then
`using` declarations that put each kernel's bound functions at global scope, then the driver,
which calls them as `pn::`, `lin::`, `pw::`, `lo::`, `att::`. Each kernel keeps its source, its
documentation and its Python wrappers in its own module; their `load` is this one's. Built and
cached by `build.py` (the key covers this whole text); LORAFLEET_CPU_KERNELS=0 forces the
references.
"""

from __future__ import annotations

import functools

from lorafleet.kernels import cpu_vector
from lorafleet.kernels.build import load_kernel

NAME = "lorafleet_cpu_v1"


def _kernels() -> dict:
    """namespace -> kernel module (imported here, not at the top: each imports `load` from here)."""
    from lorafleet.kernels import linear_cpu, lora_cpu, paged_attention_cpu, panels_cpu, pointwise_cpu

    # in this order: `lin` calls `pn`
    return {"pn": panels_cpu, "lin": linear_cpu, "pw": pointwise_cpu, "lo": lora_cpu, "att": paged_attention_cpu}


@functools.cache
def source() -> tuple[str, tuple[str, ...]]:
    """(the extension's C++, the names it binds)."""
    from lorafleet.kernels import decode_layers_cpu

    kernels = _kernels()
    includes, bodies, using = [], [], []
    for ns, module in kernels.items():
        src = module._SOURCE
        assert src.startswith(cpu_vector.SOURCE), f"{module.__name__}: a kernel source starts with cpu_vector.SOURCE"
        body = []
        for line in src[len(cpu_vector.SOURCE):].splitlines():
            (includes if line.startswith("#include") else body).append(line)
        bodies.append(f"namespace {ns} {{\n" + "\n".join(body) + f"\n}}  // namespace {ns}\n")
        using += [f"using {ns}::{fn};" for fn in module.FUNCTIONS]
    text = "\n".join([cpu_vector.SOURCE, *dict.fromkeys(includes), *bodies, *using, decode_layers_cpu.DRIVER])
    functions = tuple(fn for m in kernels.values() for fn in m.FUNCTIONS) + tuple(decode_layers_cpu.FUNCTIONS)
    return text, functions


def load(avx2: bool = False):
    """The compiled kernels, or None when they cannot be built here (an error instead with
    LORAFLEET_REQUIRE_CPU_KERNELS=1). `avx2`: the build without AVX-512 (`build.load_kernel`),
    which the tests run beside the native one."""
    text, functions = source()
    return load_kernel(NAME, text, functions, avx2)
