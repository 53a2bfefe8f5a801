"""The CPU kernels are one extension (`cpu_module`): every kernel module loads the same build,
which binds every kernel's functions; the backend takes every op from it where it loads and
serves the dtype, and the torch references for every op where it does not."""

from __future__ import annotations

import functools

import pytest
import torch

from lorafleet.errors import ConfigError
from lorafleet.kernels import (backend, cpu_module, decode_layers_cpu, linear_cpu, lora_cpu, paged_attention_cpu,
                               panels_cpu, pointwise_cpu, reference)

KERNELS = (linear_cpu, panels_cpu, pointwise_cpu, lora_cpu, paged_attention_cpu, decode_layers_cpu)

# with LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI), load() raises instead: a broken build fails, never skips
# a string, read as each test starts: collecting the tree builds nothing (a session of unit tests builds no kernel)
pytestmark = pytest.mark.skipif("cpu_module.load() is None", reason="the kernels do not build here")


def test_every_kernel_module_loads_the_variants_one_build_with_every_function(variant):
    module = cpu_module.load()
    assert module is cpu_module.load(variant) and all(k.load() is module for k in KERNELS)
    assert backend.cpu_kernels(torch.float32).variant == variant
    for k in KERNELS:
        for fn in k.FUNCTIONS:
            assert callable(getattr(module, fn)), f"{k.__name__}.{fn}"


CPUS = {  # /proc/cpuinfo's model name and flags -> the variants it runs, auto's first
    "AMD EPYC 9R14: avx2 fma avx512f avx512bw avx512_bf16": ("avx512-panels", ("avx2", "avx512", "avx512-panels")),
    "Intel(R) Xeon(R) Platinum 8488C: avx2 avx512f avx512_bf16 amx_tile amx_bf16": (
        "amx", ("avx2", "avx512", "avx512-panels", "amx")),
    "Intel(R) Xeon(R) Platinum 8375C: avx2 avx512f": ("avx512", ("avx2", "avx512", "avx512-panels")),
    "AMD EPYC 7R13: avx2 fma": ("avx2", ("avx2",)),
}


@pytest.mark.parametrize("cpu", CPUS)
def test_auto_picks_the_variant_of_the_cpu_and_any_runnable_one_can_be_forced(cpu, monkeypatch):
    model, flags = cpu.split(": ")
    monkeypatch.setattr(cpu_module, "cpu_identity", lambda: f"model name: {model}; flags: {flags}")
    for cached in (cpu_module.runnable, cpu_module.host_variant):
        monkeypatch.setattr(cpu_module, cached.__name__, functools.cache(cached.__wrapped__))
    auto, runnable = CPUS[cpu]
    assert cpu_module.host_variant() == auto and cpu_module.runnable() == runnable
    for v in cpu_module.VARIANTS:
        if v in runnable:
            assert cpu_module.check(v) == v
        else:
            with pytest.raises(ConfigError, match=f"variant {v} needs .*which this CPU lacks"):
                cpu_module.check(v)


def test_a_process_runs_one_variant_and_the_backend_names_every_one(monkeypatch):
    assert backend.CPU_VARIANTS == cpu_module.VARIANTS
    assert set(backend.CPU_VARIANTS) < set(backend.CHOICES)
    monkeypatch.setattr(cpu_module, "_current", None)
    assert cpu_module.use(cpu_module.host_variant()) == cpu_module.current() == cpu_module.host_variant()
    for other in cpu_module.runnable():
        if other != cpu_module.host_variant():
            with pytest.raises(ConfigError, match="one variant per process"):
                cpu_module.use(other)
    with pytest.raises(ConfigError, match="unknown CPU kernel variant"):
        cpu_module.check("avx1024")
    with pytest.raises(ConfigError, match="use one of auto, triton, cpu, avx2"):
        backend.select(torch.device("cpu"), torch.float32, "sse")
    with pytest.raises(ConfigError, match="runs on meta"):
        backend.select(torch.device("meta"), torch.float32, "avx2")


def test_the_backend_takes_every_op_from_it_or_none(monkeypatch):
    ops = backend.cpu_kernels(torch.float32)
    assert (ops.linear, ops.decode, ops.rms_norm, ops.decode_forward, ops.decode_batch) == (
        linear_cpu.linear, paged_attention_cpu.paged_decode, pointwise_cpu.rms_norm, decode_layers_cpu.decode_forward,
        decode_layers_cpu.decode_batch)
    for dtype, load in ((torch.float16, cpu_module.load), (torch.float32, lambda variant=None: None)):
        monkeypatch.setattr(cpu_module, "load", load)  # fp16: no kernel has it; None: the build failed
        ops = backend.cpu_kernels(dtype)
        assert (ops.linear, ops.decode, ops.rms_norm, ops.write_kv, ops.decode_forward, ops.decode_batch) == (
            reference.linear, reference.paged_decode, reference.rms_norm, reference.write_kv, None, None)


def test_the_drivers_layer_schema_is_generated_from_the_python_table():
    """The C++ driver reads each layer's tensors by the indices `reference.Layer` gives and each
    LoRA group's slots from `reference.GROUPS`: the text it is built from says so, and holds no
    hand-written copy of either."""
    from lorafleet.kernels.reference import GROUPS, Layer

    text, _ = cpu_module.source()
    assert f"constexpr int64_t FIELDS = {len(Layer._fields)};" in text
    assert all(f" {name} = {i}" in text for i, name in enumerate(Layer._fields))
    assert "SLOTS[GROUPS] = {" + ", ".join(str(len(m)) for m in GROUPS.values()) + "}" in text
    driver = (cpu_module.SOURCES / "decode_layers.cpp").read_text()
    assert "= 20" not in driver and "{3, 1, 2, 1}" not in driver
