"""The CPU kernels are one extension (`cpu_module`): every kernel module loads the same build,
which binds every kernel's functions; the backend takes every op from it where it loads and
serves the dtype, and the torch references for every op where it does not."""

from __future__ import annotations

import pytest
import torch

from lorafleet.kernels import (backend, cpu_module, decode_layers_cpu, linear_cpu, lora_cpu, paged_attention_cpu,
                               panels_cpu, pointwise_cpu, reference)

KERNELS = (linear_cpu, panels_cpu, pointwise_cpu, lora_cpu, paged_attention_cpu, decode_layers_cpu)

# with LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI), load() raises instead: a broken build fails, never skips
pytestmark = pytest.mark.skipif(cpu_module.load() is None, reason="the kernels do not build here")


@pytest.mark.parametrize("avx2", [False, pytest.param(True, marks=pytest.mark.heavy)])
def test_every_kernel_module_loads_the_one_build_with_every_function(avx2):
    module = cpu_module.load(avx2)
    assert all(k.load(avx2) is module for k in KERNELS)
    assert (cpu_module.load(True) is module) == avx2
    for k in KERNELS:
        for fn in k.FUNCTIONS:
            assert callable(getattr(module, fn)), f"{k.__name__}.{fn}"


def test_the_backend_takes_every_op_from_it_or_none(monkeypatch):
    ops = backend.cpu_kernels(torch.float32)
    assert (ops.linear, ops.decode, ops.rms_norm, ops.decode_forward, ops.decode_batch) == (
        linear_cpu.linear, paged_attention_cpu.paged_decode, pointwise_cpu.rms_norm, decode_layers_cpu.decode_forward,
        decode_layers_cpu.decode_batch)
    for dtype, load in ((torch.float16, cpu_module.load), (torch.float32, lambda avx2=False: None)):
        monkeypatch.setattr(cpu_module, "load", load)  # fp16: no kernel has it; None: the build failed
        ops = backend.cpu_kernels(dtype)
        assert (ops.linear, ops.decode, ops.rms_norm, ops.write_kv, ops.decode_forward, ops.decode_batch) == (
            reference.linear, reference.paged_decode, reference.rms_norm, reference.write_kv, None, None)
