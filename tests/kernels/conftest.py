"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from lorafleet.kernels import (decode_layers_cpu, linear_cpu, lora_cpu, paged_attention_cpu, panels_cpu, pointwise_cpu,
                               quant_cpu)

CPU_KERNELS = (linear_cpu, panels_cpu, lora_cpu, pointwise_cpu, paged_attention_cpu, decode_layers_cpu, quant_cpu)


@pytest.fixture(params=["native", pytest.param("avx2", marks=pytest.mark.heavy)])
def isa(request, monkeypatch):
    """A test that takes this runs twice: on the build for this CPU, then on one without AVX-512
    (`load(avx2=True)`), whose vectors have 8 lanes, not 16 (`kernels/cpu/vector.h`'s `vw`), and whose
    matmul tiles have other shapes. So a CI machine with AVX-512 checks the AVX2 code too;
    without AVX-512 both builds are AVX2. The second is heavy (a build of its own)."""
    if request.param == "avx2":
        for module in CPU_KERNELS:
            native = module.load
            assert native(avx2=True) is not native()
            monkeypatch.setattr(module, "load", lambda native=native: native(avx2=True))
    return request.param
