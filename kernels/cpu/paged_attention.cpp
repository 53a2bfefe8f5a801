// Decode attention over the pool's pages (kernels/paged_attention_cpu.py), in the namespace `att` of the one extension (kernels/cpu/lorafleet_cpu.cpp).
#include "vector.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

namespace att {

// pages are scattered: the hardware prefetcher cannot guess the next one. So while four rows of
// one kv head of this page are computed, the same four rows of the next page are asked for: a
// few lines at a time, spread over the page's loop. Asking for a whole page at once when its
// turn began (256 lines) did no better than no prefetch at all, while the spread requests made a
// call of 8 sequences or more faster (see the module doc)
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

}  // namespace att
