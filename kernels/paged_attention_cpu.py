"""The CPU decode attention kernel: one query token per sequence attends to its keys read
straight from the KV pages of the unified pool, with no gathered copy of the context.

Semantics (identical to the decode branch of `reference.paged_attention`): for sequence b and
query head h (kv head h // (H / KVH)), over positions t < lens[b] with
K_t = kv[tables[b, t // block], 0, t % block], V_t likewise at 1:
    out[b, h] = softmax_t(scale * q[b, h] . K_t) @ V_t

Why it exists: the torch path gathers every sequence's context into a padded tensor per layer
per step, which on long contexts costs more than the attention itself (40% of the step time in
the mixed-lengths profile). Compiled on first use like the LoRA kernel; falls back to the
reference when it cannot be built (an error instead with LORAFLEET_REQUIRE_CPU_KERNELS=1).
LORAFLEET_CPU_KERNELS=0 forces the reference.
"""

from __future__ import annotations

import torch

from lorafleet.kernels.lora_cpu import compile_inline

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

void paged_decode(torch::Tensor q, torch::Tensor kv, torch::Tensor tables, torch::Tensor lens,
                  double scale, torch::Tensor out) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && kv.stride(4) == 1, "layout");
  TORCH_CHECK(tables.is_contiguous() && lens.is_contiguous(), "metadata layout");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = kv.size(2), KVH = kv.size(3), G = H / KVH, maxb = tables.size(1);
  const int64_t sP = kv.stride(0), s2 = kv.stride(1), sT = kv.stride(2), sK = kv.stride(3);
  const float* qp = q.data_ptr<float>();
  const float* kvp = kv.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * KVH, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> s;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / KVH, kh = i % KVH, L = lp[b];
      s.assign(G * L, 0.f);
      const float* qb = qp + (b * H + kh * G) * D;
      for (int64_t t = 0; t < L; ++t) {
        const float* k = kvp + tp[b * maxb + t / BS] * sP + (t % BS) * sT + kh * sK;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qb + g * D;
          float acc = 0.f;
#pragma omp simd reduction(+:acc)
          for (int64_t d = 0; d < D; ++d) acc += qg[d] * k[d];
          s[g * L + t] = acc * sc;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* row = s.data() + g * L;
        float m = -INFINITY;
        for (int64_t t = 0; t < L; ++t) m = std::max(m, row[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) { row[t] = std::exp(row[t] - m); sum += row[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) row[t] *= inv;
        float* o = op + (b * H + kh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      }
      for (int64_t t = 0; t < L; ++t) {
        const float* v = kvp + tp[b * maxb + t / BS] * sP + s2 + (t % BS) * sT + kh * sK;
        for (int64_t g = 0; g < G; ++g) {
          const float p = s[g * L + t];
          float* o = op + (b * H + kh * G + g) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += p * v[d];
        }
      }
    }
  });
}
"""


def load():
    """The compiled decode kernel, or None when it cannot be built here (an error instead with
    LORAFLEET_REQUIRE_CPU_KERNELS=1: see `lora_cpu.compile_inline`)."""
    return compile_inline("lorafleet_attn_cpu_v1", _SOURCE, "paged_decode")


def usable(kv: torch.Tensor) -> bool:
    return kv.device.type == "cpu" and kv.dtype == torch.float32 and load() is not None


def paged_decode(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """q: [B, H, D]; kv: [P, 2, block, KVH, D] (one layer's view of the pool); tables: [B, maxb]
    long; lens: [B] long (>= 1). Returns [B, H, D]."""
    out = torch.empty_like(q)
    load().paged_decode(q.contiguous(), kv, tables, lens, scale, out)
    return out
