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

Tasks are (sequence, group of kv heads): every kv head of a sequence in one task once the batch
has two sequences per thread, fewer heads per task below that, so that a batch of one still
spreads over the threads. A page holds each token's kv heads side by side ([block, KVH, D]), so
a task over all of them reads whole rows, one stream per page; the first version's tasks were
(sequence, kv head), each reading 256 of every 1,024 bytes of a row (`tiny`'s 4 kv heads of 64).
Measured on an AMD EPYC (AVX2, 2 threads), one layer's call with the caches flushed before it,
tiny's shapes, pages scattered over a 1 GiB pool, old and new alternated (best of 3): 8
sequences of 96 tokens 177 -> 148 us, 8 of 32 72 -> 62 us, 32 of 100 707 -> 580 us, one of 96
unchanged (38 us). The same rows merely summed, without the attention, took 123 us per kv head
and 82 us by whole rows: most of a decode call is waiting for its pages. So the next page's
rows are asked for a few at a time while this page's are computed (`prefetch_rows4`): one
layer's call after 14 MB of other reads (a layer's weights, as in a step), v8 (the whole next
page asked for at once) against v9, best of 4 alternated: fp32 8 sequences of 96 tokens 83 ->
72 us, 8 of 470 572 -> 483 us, one of 2,000 274 -> 224 us; bf16 8 of 470 432 -> 332 us. Whole
`tiny` decode steps, alternated: 8 sequences of 470 tokens 0.95x the time, of 64 0.985x.

The softmax runs on whole vectors (a head's scores padded to them, the padding masked out of the
sum), where each score past the last whole vector took a scalar exp; the values pass keeps
blocks of four of each head's output vectors in registers across a page's rows, where four rows
at a time went through memory (each output vector a chain of loads and stores). On the AMD EPYC
with AVX-512 (2026-12-05), one layer's call for 8 sequences of 76 tokens (`tiny`'s heads): one
thread, caches warm, 64-67 -> 54-57 us; caches flushed, 2 threads, 82-105 us either way (the
pages' latency: asking for the next page's rows further ahead, or for a page's V rows during
its K rows, did not move it). Whole `tiny` decode steps at batch 8 over contexts of 64-128
tokens, two processes alternated five times: 4.21-4.29 -> 4.14-4.25 ms, every round lower (in six
more rounds 4.10-4.24 -> 4.06-4.23, five lower); over contexts of 448-512 tokens, four rounds,
7.07-7.16 -> 6.74-7.14 ms. One pass per page instead (its scores, an online softmax, its values,
the page's V rows asked for during its K rows) ran within the noise of these two (4.06-4.38 ms
in the same six rounds): not kept.

q is read where the qkv projection left it: rows strided, each row's heads side by side (the
decode driver copied it before, a 16 KB copy and allocation a layer for 8 rows of `tiny`; whole
steps alternated with and without the copy differed within the noise, 0.99-1.01x).

float32 and bfloat16 (q, the pool and the output in one dtype): scores, softmax and the output
sums in fp32, each output element rounded once. Before, a bf16 pool went to the torch reference,
which gathers the context and ran at ~1/8 of this kernel's speed (8 sequences of 96 tokens, one
layer, caches flushed: 1,048 us against 133; bf16 decode steps on `tiny`, AMD EPYC: batch 1
7.0 -> 5.4 ms, batch 8 16.6 -> 8.4 ms, reference and kernel alternated in one process).
"""

from __future__ import annotations

import torch

from lorafleet.kernels import cpu_vector
from lorafleet.kernels.cpu_module import load  # the CPU kernels' one extension

FUNCTIONS = ["paged_decode"]
_SOURCE = cpu_vector.SOURCE + r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

// pages are scattered: the hardware prefetcher cannot guess the next one. So while four rows of
// one kv head of this page are computed, the same four rows of the next page are asked for: a
// few lines at a time, spread over the page's loop. Asking for a whole page at once when its
// turn began (256 lines) did no better than no prefetch at all, while the spread requests took
// 7-23% off a call of 8 sequences or more (see the module doc)
template <class S>
static inline void prefetch_rows4(const S* base, int64_t stride, int64_t width) {
  constexpr int64_t LINE = 64 / int64_t(sizeof(S));
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t d = 0; d < width; d += LINE) __builtin_prefetch(base + r * stride + d, 0, 3);
}

// f(t, hh, rows, m): token rows [t, t + m) (m <= 4) of kv head hh of a task, page by page, four at
// a time; `half` points at the task's first kv head in K or V of a page (table[blk] * sP from
// it). rows[j] past m repeat the last row (computed, never kept). The same rows of the next page
// are asked for meanwhile
template <class S, class F>
static inline void each_row_group(const S* half, const int64_t* table, int64_t L, int64_t BS, int64_t sP,
                                  int64_t sT, int64_t sK, int64_t HG, int64_t D, F f) {
  for (int64_t t0 = 0, blk = 0; t0 < L; t0 += BS, ++blk) {
    const S* page = half + table[blk] * sP;
    const S* next = t0 + BS < L ? half + table[blk + 1] * sP : nullptr;
    const int64_t n = std::min(BS, L - t0);
    for (int64_t u = 0; u < n; u += 4) {
      const int64_t m = std::min<int64_t>(4, n - u);
      for (int64_t hh = 0; hh < HG; ++hh) {
        const S* rows[4];
        for (int64_t j = 0; j < 4; ++j) rows[j] = page + (u + std::min(j, m - 1)) * sT + hh * sK;
        if (next) prefetch_rows4(next + u * sT + hh * sK, sT, D);
        f(t0 + u, hh, rows, m);
      }
    }
  }
}

// S: the storage of q, the pool and out (float or bf16); q is widened once per task, scores,
// softmax and the output sums are fp32, each output element rounded once at the end
template <class S>
static void decode_t(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables,
                     const torch::Tensor& lens, double scale, torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = kv.size(2), KVH = kv.size(3), G = H / KVH, maxb = tables.size(1);
  const int64_t sP = kv.stride(0), s2 = kv.stride(1), sT = kv.stride(2), sK = kv.stride(3);
  const S* qp = q.data_ptr<S>();
  const int64_t sq = q.stride(0);  // q may be a view of the qkv rows: heads contiguous, rows strided
  const S* kvp = kv.data_ptr<S>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  S* op = out.data_ptr<S>();
  const float sc = static_cast<float>(scale);
  const int64_t DV = D - D % VW;  // the vector part of a head; the rest one lane at a time
  // tasks of (sequence, group of HG kv heads): all of a sequence's kv heads when the batch
  // has sequences enough for the threads, halved until it has (so one sequence still uses every
  // thread). A task reads each token row's HG heads side by side (HG x D contiguous), so a page
  // streams; one task per kv head read 256 of every 1,024 bytes of each row (see the module
  // doc). Contexts differ in length: torch's threads take tasks from a shared counter
  const int64_t nth = at::get_num_threads();
  int64_t HG = KVH;
  while (HG % 2 == 0 && B * (KVH / HG) < 2 * nth) HG /= 2;
  const int64_t NG = KVH / HG, tasks = B * NG, GH = G * HG;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nth, 1, [&](int64_t, int64_t) {
    std::vector<float> s, qf(GH * D), of(GH * D);
    for (int64_t i = next++; i < tasks; i = next++) {
      const int64_t b = i / NG, kh0 = (i % NG) * HG, L = lp[b];
      const int64_t Ls = (L + VW - 1) / VW * VW;  // a head's scores, padded to whole vectors
      s.resize(GH * Ls);
      const S* qb = qp + b * sq + kh0 * G * D;  // the group's GH query heads, contiguous
      for (int64_t e = 0; e < GH * D; ++e) qf[e] = float(qb[e]);
      const int64_t* table = tp + b * maxb;
      // scores, page by page (no division per token), four keys at a time with independent sums
      each_row_group(kvp + kh0 * sK, table, L, BS, sP, sT, sK, HG, D, [&](int64_t t, int64_t hh, const S* const* k, int64_t m) {
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + (hh * G + g) * D;
          vw a0{}, a1{}, a2{}, a3{};
          for (int64_t d = 0; d < DV; d += VW) {
            const vw qv = wload(qg + d);
            a0 += qv * wload(k[0] + d); a1 += qv * wload(k[1] + d);
            a2 += qv * wload(k[2] + d); a3 += qv * wload(k[3] + d);
          }
          float r[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
          for (int64_t d = DV; d < D; ++d)
            for (int64_t j = 0; j < 4; ++j) r[j] += qg[d] * float(k[j][d]);
          float* sg = s.data() + (hh * G + g) * Ls + t;
          for (int64_t j = 0; j < m; ++j) sg[j] = r[j] * sc;
        }
      });
      for (int64_t g = 0; g < GH; ++g) {  // softmax over each head's scores, whole vectors
        float* sg = s.data() + g * Ls;
        for (int64_t u = L; u < Ls; ++u) sg[u] = -INFINITY;
        vw m = wload(sg);
        for (int64_t u = VW; u < Ls; u += VW) {
          const vw x = wload(sg + u);
          m = m > x ? m : x;
        }
        float mx = m[0];
        for (int j = 1; j < VW; ++j) mx = std::max(mx, m[j]);
        vw sum{};
        for (int64_t u = 0; u < Ls; u += VW) {
          vw e = wexp(wload(sg + u) - mx);
          if (u + VW > L) e = lane_ids() < iw{} + int32_t(L - u) ? e : vw{};  // the padding weighs nothing
          wstore(sg + u, e);
          sum += e;
        }
        const float inv = 1.f / hsum(sum);
#pragma omp simd
        for (int64_t u = 0; u < L; ++u) sg[u] *= inv;
      }
      std::fill(of.begin(), of.end(), 0.f);
      // values, page by page: for each kv head and each of its query heads, blocks of four of the
      // output's vectors stay in registers across the page's rows (four independent sums, one
      // FMA each per row; four rows at a time through memory kept each output vector's sums in a
      // chain of loads and stores), while the next page's rows of that kv head are asked for
      const S* vbase = kvp + s2 + kh0 * sK;
      for (int64_t t0 = 0, blk = 0; t0 < L; t0 += BS, ++blk) {
        const S* page = vbase + table[blk] * sP;
        const S* nxt = t0 + BS < L ? vbase + table[blk + 1] * sP : nullptr;
        const int64_t n = std::min(BS, L - t0);
        for (int64_t hh = 0; hh < HG; ++hh) {
          const S* rows = page + hh * sK;
          const S* nrows = nxt ? nxt + hh * sK : nullptr;
          for (int64_t g = 0; g < G; ++g) {
            const float* p = s.data() + (hh * G + g) * Ls + t0;
            float* o = of.data() + (hh * G + g) * D;
            int64_t d = 0;
            for (; d + 4 * VW <= DV; d += 4 * VW) {
              vw a0 = wload(o + d), a1 = wload(o + d + VW), a2 = wload(o + d + 2 * VW), a3 = wload(o + d + 3 * VW);
              for (int64_t r = 0; r < n; ++r) {
                const S* v = rows + r * sT + d;
                if (nrows && g == 0 && d == 0)  // the next page's row, a row at a time (D >= 4 vectors)
                  for (int64_t e = 0; e < D; e += 64 / int64_t(sizeof(S))) __builtin_prefetch(nrows + r * sT + e, 0, 3);
                const vw pr = vw{} + p[r];
                a0 += pr * wload(v); a1 += pr * wload(v + VW);
                a2 += pr * wload(v + 2 * VW); a3 += pr * wload(v + 3 * VW);
              }
              wstore(o + d, a0); wstore(o + d + VW, a1); wstore(o + d + 2 * VW, a2); wstore(o + d + 3 * VW, a3);
            }
            for (; d < DV; d += VW) {
              vw a = wload(o + d);
              for (int64_t r = 0; r < n; ++r) a += p[r] * wload(rows + r * sT + d);
              wstore(o + d, a);
            }
            for (; d < D; ++d) {
              float a = o[d];
              for (int64_t r = 0; r < n; ++r) a += p[r] * float(rows[r * sT + d]);
              o[d] = a;
            }
          }
        }
      }
      S* ob = op + (b * H + kh0 * G) * D;
      for (int64_t e = 0; e < GH * D; ++e) ob[e] = S(of[e]);
    }
  });
}

void paged_decode(torch::Tensor q, torch::Tensor kv, torch::Tensor tables, torch::Tensor lens,
                  double scale, torch::Tensor out) {
  TORCH_CHECK(q.scalar_type() == kv.scalar_type() && out.scalar_type() == q.scalar_type(),
              "paged_decode: q, the pool and out differ in dtype");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.is_contiguous() && kv.stride(4) == 1,
              "paged_decode: q [B, H, D] with each row's heads contiguous, out contiguous");
  TORCH_CHECK(tables.is_contiguous() && lens.is_contiguous(), "metadata layout");
  if (q.scalar_type() == at::kFloat) decode_t<float>(q, kv, tables, lens, scale, out);
  else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_decode: float32 or bfloat16 only");
    decode_t<c10::BFloat16>(q, kv, tables, lens, scale, out);
  }
}
"""


def paged_decode(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """q: [B, H, D] (its rows may be strided, as a view of the qkv projection's are); kv: [P, 2,
    block, KVH, D] (one layer's view of the pool), one dtype, float32 or bfloat16; tables: [B, maxb]
    long; lens: [B] long (>= 1). Returns [B, H, D] in q's dtype."""
    if q.stride(2) != 1 or q.stride(1) != q.size(2):  # the kernel reads each row's heads side by side
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    load().paged_decode(q, kv, tables, lens, scale, out)
    return out
