"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from lorafleet.kernels import (decode_layers_cpu, linear_cpu, lora_cpu, paged_attention_cpu, panels_cpu, pointwise_cpu,
                               quant_cpu)

CPU_KERNELS = (linear_cpu, panels_cpu, lora_cpu, pointwise_cpu, paged_attention_cpu, decode_layers_cpu, quant_cpu)
