"""The CPU LoRA kernel: fused shrink + expand for many small segments in one call per projection
group, reading adapter weights straight from the pool tensor by element offset.

Semantics (identical to `reference.lora_shrink_expand`): for every segment s, every row i in
[start_s, end_s) and every module slot m with rank r > 0:
    t = A_m(s) @ x[i]                    A_m: r rows of `in` at pool offset a_off
    out[i, col_m : col_m + n_out] += t @ Bt_m(s)      Bt_m: [r, n_out] at pool offset b_off
(Bt is B transposed and pre-scaled, as residency stores it.)

Why it exists: with one token per adapter (decode over many adapters), the torch path issues
~11 tiny matmuls per adapter per layer, and the time goes to dispatch, not to reading weights.
This kernel makes it one call per (layer, group), parallel over segments, memory-bound.
It is compiled on first use with the machine's C++ compiler (torch's cpp_extension, cached);
where that is impossible lorafleet falls back to the torch reference and says so once.
Set LORAFLEET_CPU_KERNELS=0 to force the reference; LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI) makes a
kernel that cannot be loaded an error instead (`KernelUnavailableError`, with the build error).
"""

from __future__ import annotations

import logging
import os
import threading

import torch

log = logging.getLogger("lorafleet.kernels")

# meta[s, m] = (a_off, r, b_off, n_out, col_off); r == 0: the segment's adapter lacks module m
META_FIELDS = 5

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <vector>

static inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+:acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

static inline void axpy(float* __restrict y, float alpha, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void lora_segments(torch::Tensor x, torch::Tensor out, torch::Tensor w, torch::Tensor meta,
                   torch::Tensor seg) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
              w.scalar_type() == at::kFloat, "lora_segments: float32 only");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && w.is_contiguous(), "lora_segments: layout");
  TORCH_CHECK(meta.is_contiguous() && seg.is_contiguous(), "lora_segments: metadata layout");
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const int64_t* mp = meta.data_ptr<int64_t>();
  const int64_t* sp = seg.data_ptr<int64_t>();
  const int64_t S = seg.size(0), M = meta.size(1), in = x.size(1);
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    std::vector<float> t;
    for (int64_t s = s0; s < s1; ++s) {
      for (int64_t row = sp[2 * s]; row < sp[2 * s + 1]; ++row) {
        const float* xi = xp + row * ldx;
        float* yi = op + row * ldo;
        for (int64_t m = 0; m < M; ++m) {
          const int64_t* f = mp + (s * M + m) * 5;
          const int64_t r = f[1];
          if (r == 0) continue;
          const float* a = wp + f[0];
          const float* bt = wp + f[2];
          const int64_t n_out = f[3];
          float* y = yi + f[4];
          t.resize(r);
          for (int64_t k = 0; k < r; ++k) t[k] = dot(a + k * in, xi, in);
          for (int64_t k = 0; k < r; ++k) axpy(y, t[k], bt + k * n_out, n_out);
        }
      }
    }
  });
}
"""

_lock = threading.Lock()
_modules: dict[str, object] = {}
_why_not: dict[str, BaseException | str] = {}  # name -> the build error, for kernels that are None


class KernelUnavailableError(RuntimeError):
    """A CPU kernel could not be loaded while LORAFLEET_REQUIRE_CPU_KERNELS=1: where the kernels are
    expected (CI), a broken build must fail the run, not pass as skipped tests on the torch path."""


def compile_inline(name: str, source: str, function: str):
    """Build (once per machine, cached by torch) and load a C++ CPU kernel; None when that is
    impossible here (reason logged once) or disabled with LORAFLEET_CPU_KERNELS=0, unless
    LORAFLEET_REQUIRE_CPU_KERNELS=1, which raises KernelUnavailableError instead."""
    if name not in _modules:
        with _lock:
            if name not in _modules:
                module = None
                if os.environ.get("LORAFLEET_CPU_KERNELS", "1") == "0":
                    _why_not[name] = "disabled by LORAFLEET_CPU_KERNELS=0"
                else:
                    try:
                        from torch.utils.cpp_extension import load_inline

                        module = load_inline(name=name, cpp_sources=[source], functions=[function],
                                             extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                             extra_ldflags=["-fopenmp"], verbose=False)
                    except Exception as e:  # no compiler, headers or ninja: the reference still works
                        _why_not[name] = e
                        if not required():
                            log.warning("CPU kernel %s unavailable (%s); using the torch reference", name, e)
                _modules[name] = module
    if _modules[name] is None and required():
        why = _why_not[name]
        cause = why if isinstance(why, BaseException) else None
        raise KernelUnavailableError(f"CPU kernel {name} unavailable and LORAFLEET_REQUIRE_CPU_KERNELS=1: {why}") from cause
    return _modules[name]


def required() -> bool:
    """LORAFLEET_REQUIRE_CPU_KERNELS=1: every CPU kernel must load (`compile_inline` raises)."""
    return os.environ.get("LORAFLEET_REQUIRE_CPU_KERNELS", "0") == "1"


def load():
    """The compiled LoRA kernel, or None when it cannot be built here (an error instead with
    LORAFLEET_REQUIRE_CPU_KERNELS=1)."""
    return compile_inline("lorafleet_lora_cpu_v2", _SOURCE, "lora_segments")


def lora_segments(x: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, meta: torch.Tensor,
                  seg: torch.Tensor) -> None:
    """x: [T, in] f32; out: [T, sum n_out] f32 (updated in place); weights: flat f32 (the pool);
    meta: [S, M, 5] int64 (see META_FIELDS); seg: [S, 2] int64 row ranges."""
    load().lora_segments(x, out, weights, meta, seg)
