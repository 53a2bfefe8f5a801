"""The CPU decode attention kernel: one query token per sequence attends to its keys read
straight from the KV pages of the unified pool, with no gathered copy of the context.

Semantics (identical to `reference.paged_decode`): for sequence b and
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

from lorafleet.kernels import cpu_vector
from lorafleet.kernels.build import load_kernel

_SOURCE = cpu_vector.SOURCE + r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

// pages are scattered: the hardware prefetcher cannot guess the next one, so ask for its rows
// while this one is computed
static inline void prefetch_rows(const float* base, int64_t rows, int64_t stride, int64_t D) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(base + r * stride + d, 0, 3);
}

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
  // one task per (sequence, kv head); contexts differ in length, so torch's threads take tasks
  // from a shared counter rather than equal static shares
  std::atomic<int64_t> next{0};
  const int64_t tasks = B * KVH;
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> s;
    for (int64_t i = next++; i < tasks; i = next++) {
      const int64_t b = i / KVH, kh = i % KVH, L = lp[b];
      s.resize(G * L);
      const float* qb = qp + (b * H + kh * G) * D;
      const int64_t* table = tp + b * maxb;
      // scores, page by page (no division per token), four keys at a time with independent sums
      for (int64_t t0 = 0, blk = 0; t0 < L; t0 += BS, ++blk) {
        const float* kpage = kvp + table[blk] * sP + kh * sK;
        const int64_t n = std::min(BS, L - t0);
        if (t0 + BS < L) prefetch_rows(kvp + table[blk + 1] * sP + kh * sK, std::min(BS, L - t0 - BS), sT, D);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qb + g * D;
          float* sg = s.data() + g * L + t0;
          int64_t u = 0;
          for (; u + 4 <= n; u += 4) {
            const float *k0 = kpage + u * sT, *k1 = k0 + sT, *k2 = k1 + sT, *k3 = k2 + sT;
            float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+:a0, a1, a2, a3)
            for (int64_t d = 0; d < D; ++d) {
              a0 += qg[d] * k0[d]; a1 += qg[d] * k1[d]; a2 += qg[d] * k2[d]; a3 += qg[d] * k3[d];
            }
            sg[u] = a0 * sc; sg[u + 1] = a1 * sc; sg[u + 2] = a2 * sc; sg[u + 3] = a3 * sc;
          }
          for (; u < n; ++u) {
            const float* k = kpage + u * sT;
            float acc = 0.f;
#pragma omp simd reduction(+:acc)
            for (int64_t d = 0; d < D; ++d) acc += qg[d] * k[d];
            sg[u] = acc * sc;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax over each head's scores
        float* sg = s.data() + g * L;
        float m = -INFINITY;
        for (int64_t u = 0; u < L; ++u) m = std::max(m, sg[u]);
        float sum = 0.f;
        int64_t u = 0;
        for (; u + VW <= L; u += VW) {
          const vw e = wexp(wload(sg + u) - m);
          wstore(sg + u, e);
          sum += hsum(e);
        }
        for (; u < L; ++u) { sg[u] = exp1(sg[u] - m); sum += sg[u]; }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t u = 0; u < L; ++u) sg[u] *= inv;
        float* o = op + (b * H + kh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      }
      // values, page by page, four at a time into each head's output
      for (int64_t t0 = 0, blk = 0; t0 < L; t0 += BS, ++blk) {
        const float* vpage = kvp + table[blk] * sP + s2 + kh * sK;
        const int64_t n = std::min(BS, L - t0);
        if (t0 + BS < L) prefetch_rows(kvp + table[blk + 1] * sP + s2 + kh * sK, std::min(BS, L - t0 - BS), sT, D);
        for (int64_t u = 0; u < n; u += 4) {
          const int64_t m = std::min<int64_t>(4, n - u);
          const float* v0 = vpage + u * sT;
          const float* v1 = m > 1 ? v0 + sT : v0;
          const float* v2 = m > 2 ? v0 + 2 * sT : v0;
          const float* v3 = m > 3 ? v0 + 3 * sT : v0;
          for (int64_t g = 0; g < G; ++g) {
            const float* sg = s.data() + g * L + t0 + u;
            const float p0 = sg[0], p1 = m > 1 ? sg[1] : 0.f, p2 = m > 2 ? sg[2] : 0.f, p3 = m > 3 ? sg[3] : 0.f;
            float* o = op + (b * H + kh * G + g) * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
          }
        }
      }
    }
  });
}
"""


def load(avx2: bool = False):
    """The compiled decode kernel, or None when it cannot be built here (an error instead with
    LORAFLEET_REQUIRE_CPU_KERNELS=1: see `build.compile_inline`). `avx2`: the build without
    AVX-512 (`build.load_kernel`)."""
    return load_kernel("lorafleet_attn_cpu_v6", _SOURCE, "paged_decode", avx2)


def paged_decode(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """q: [B, H, D]; kv: [P, 2, block, KVH, D] (one layer's view of the pool); tables: [B, maxb]
    long; lens: [B] long (>= 1). Returns [B, H, D]."""
    out = torch.empty_like(q)
    load().paged_decode(q.contiguous(), kv, tables, lens, scale, out)
    return out
