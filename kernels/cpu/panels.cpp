// Packed fp32 weight panels and the matmul on them (kernels/panels_cpu.py), in the namespace `pn` of the one extension (kernels/cpu/lorafleet_cpu.cpp).
#include "vector.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>

namespace pn {

// W packed in panels of PW output rows, [N / PW, K, PW] (`pack`): a panel is one contiguous
// stream, read once per call; for each k its PW weights are two vectors, and each x row's element
// is broadcast against them, so the sums are PW lanes wide (no horizontal sums): a pass of PH rows
// keeps 2 x PH accumulators for 2 + PH loads per 2 x PH FMAs, where the (3, 8) tile of [N, K]
// rows has 11 per 24 and the (1, 8) one 9 per 8. K goes by chunks of PKC, so that a chunk of the
// panel stays in L1 while every pass of rows reads it. Rows go in blocks of RB, each (panel,
// block of rows) one unit of the threads' work, a panel's blocks in a row (its chunks stay in L2
// between them): so packed weights take every row count here, prefill too, never a copy laid
// out [N, K] again for torch's GEMM. With AVX2, the first pass of a chunk asks for the same chunk
// of the next panel; 2-4 rows go as one pass of 4 (rows past T repeat the last, computed and
// never stored), 5-8 as 6 + the rest. With AVX-512 (on AMD CPUs only: `panel_width`), passes of
// up to 8 rows and no software prefetch. One row, with either: `panel_row` (why: the module doc
// and there)
constexpr int64_t PW = 2 * VW;
constexpr int64_t PKC = 128;
constexpr int64_t RB = 64;
#if defined(__AVX512F__)
constexpr int64_t PH = 8;
constexpr bool PREFETCH_PANELS = false;
#else
constexpr int64_t PH = 6;
constexpr bool PREFETCH_PANELS = true;
#endif

template <int TR>
static inline void panel_pass(const float* wp, const float* const* x, int64_t k0, int64_t k1, vw (*st)[2],
                              bool first, const float* pf) {
  vw acc[TR][2];
  for (int t = 0; t < TR; ++t) {
    acc[t][0] = first ? vw{} : st[t][0];
    acc[t][1] = first ? vw{} : st[t][1];
  }
  for (int64_t k = k0; k < k1; ++k) {
    if (pf)  // (AVX2 only: PREFETCH_PANELS) non-temporal, the hint `linear_cpu` measured there
      for (int64_t c = 0; c < PW; c += 16) __builtin_prefetch(pf + k * PW + c, 0, 0);
    const vw w0 = wload(wp + k * PW), w1 = wload(wp + k * PW + VW);
    for (int t = 0; t < TR; ++t) {
      const float xv = x[t][k];
      acc[t][0] += w0 * xv;
      acc[t][1] += w1 * xv;
    }
  }
  for (int t = 0; t < TR; ++t) {
    st[t][0] = acc[t][0];
    st[t][1] = acc[t][1];
  }
}

// one row against a panel: all of K in one pass, four k at a time into four pairs of sums, so
// that eight loads of the stream are in flight: faster than a pass of one row, which keeps one
// pair and goes by chunks of K, on AMD with AVX-512 and in the build for AVX2 (two k at a time
// about the same). Tried: 2-4 rows the same way, two or four k at a time; no faster than the
// chunked passes, not kept
static inline void panel_row(const float* wp, const float* x, int64_t K, vw* st) {
  vw a[4][2] = {};
  int64_t k = 0;
  for (; k + 4 <= K; k += 4)
    for (int u = 0; u < 4; ++u) {
      a[u][0] += wload(wp + (k + u) * PW) * x[k + u];
      a[u][1] += wload(wp + (k + u) * PW + VW) * x[k + u];
    }
  for (; k < K; ++k) {
    a[0][0] += wload(wp + k * PW) * x[k];
    a[0][1] += wload(wp + k * PW + VW) * x[k];
  }
  st[0] = (a[0][0] + a[1][0]) + (a[2][0] + a[3][0]);
  st[1] = (a[0][1] + a[1][1]) + (a[2][1] + a[3][1]);
}

// y [T, N] = x [T, K] @ W^T (+ bias) for W packed as [N / PW, K, PW], fp32, any T
static void run_panels(const float* xp, int64_t ldx, int64_t T, const float* W, int64_t K, int64_t P,
                       const float* bias, float* yp, int64_t ldy) {
  const int64_t blocks = (T + RB - 1) / RB;  // blocks of rows
  at::parallel_for(0, P * blocks, 1, [&](int64_t i0, int64_t i1) {
    vw st[RB + 4][2];  // each row's sums across the chunks of K (+ the rows a pass of 4 repeats)
    const float* xr[RB + 4];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = i / blocks, tb = i % blocks * RB, R = std::min(RB, T - tb);
      const float* wp = W + p * K * PW;
      // the next panel, asked for as the first pass of this one's first block of rows runs
      const float* next = PREFETCH_PANELS && tb == 0 && (p + 1) * blocks < i1 ? wp + K * PW : nullptr;
      for (int64_t t = 0; t < std::max<int64_t>(R, 4); ++t) xr[t] = xp + (tb + std::min(t, R - 1)) * ldx;
      if (R == 1) {
        panel_row(wp, xr[0], K, st[0]);
      } else {
        for (int64_t k0 = 0; k0 < K; k0 += PKC) {
          const int64_t k1 = std::min(K, k0 + PKC);
          const bool first = k0 == 0;
          if (R <= 4 && PH == 6) {
            panel_pass<4>(wp, xr, k0, k1, st, first, next);
            continue;
          }
          for (int64_t t0 = 0; t0 < R; t0 += PH) {
            const float* const* x = xr + t0;
            const float* pf = t0 == 0 ? next : nullptr;
            switch (std::min<int64_t>(PH, R - t0)) {
              case 1: panel_pass<1>(wp, x, k0, k1, st + t0, first, pf); break;
              case 2: panel_pass<2>(wp, x, k0, k1, st + t0, first, pf); break;
              case 3: panel_pass<3>(wp, x, k0, k1, st + t0, first, pf); break;
              case 4: panel_pass<4>(wp, x, k0, k1, st + t0, first, pf); break;
              case 5: panel_pass<5>(wp, x, k0, k1, st + t0, first, pf); break;
              case 6: panel_pass<6>(wp, x, k0, k1, st + t0, first, pf); break;
              case 7: panel_pass<7>(wp, x, k0, k1, st + t0, first, pf); break;
              default: panel_pass<8>(wp, x, k0, k1, st + t0, first, pf); break;
            }
          }
        }
      }
      for (int64_t t = 0; t < R; ++t) {
        vw a0 = st[t][0], a1 = st[t][1];
        if (bias) {
          a0 += wload(bias + p * PW);
          a1 += wload(bias + p * PW + VW);
        }
        wstore(yp + (tb + t) * ldy + p * PW, a0);
        wstore(yp + (tb + t) * ldy + p * PW + VW, a1);
      }
    }
  });
}

// w's rows `ids` [T] as [T, K], w [N, K] or packed (`pack`): a tied LM head's embedding, packed
// with it, is read by rows too. A row of a panel is one lane of it, PW floats apart: each of its
// K elements costs a cache line, T x K lines for the T tokens of a step (few beside what the LM
// head itself streams)
torch::Tensor rows(torch::Tensor w, torch::Tensor ids) {
  if (w.dim() != 3) return w.index_select(0, ids);
  TORCH_CHECK(w.size(2) == PW && w.is_contiguous() && w.scalar_type() == at::kFloat,
              "rows: packed w [N / ", PW, ", K, ", PW, "] of float32");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "rows: ids [T] of int64");
  const int64_t N = w.size(0) * PW, K = w.size(1), T = ids.size(0);
  const torch::Tensor ic = ids.contiguous();
  const int64_t* ip = ic.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK_INDEX(ip[t] >= 0 && ip[t] < N, "rows: id ", ip[t], " is out of [0, ", N, ")");
  auto y = torch::empty({T, K}, w.options());
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* src = wp + ip[t] / PW * K * PW + ip[t] % PW;
    for (int64_t k = 0; k < K; ++k) yp[t * K + k] = src[k * PW];
  }
  return y;
}

// the panel width `pack` uses, 0 where weights stay [N, K]: panels pay on AVX2 and, with AVX-512,
// on AMD CPUs (AMD's layout, `amd_layout()`); on Intel they did not (module doc)
int64_t panel_width() {
#if defined(__AVX512F__)
  return amd_layout() ? PW : 0;
#elif defined(__AVX2__)
  return PW;
#else
  return 0;
#endif
}

// F.linear(x, w, bias) for w packed (`pack`): the kernel at every row count (`linear_cpu`'s `linear`
// sends packed weights here)
static torch::Tensor linear_packed(torch::Tensor x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1) && w.size(2) == PW && w.is_contiguous(),
              "linear: x [T, K] and packed w [N / ", PW, ", K, ", PW, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "linear: packed w is float32");
  const int64_t N = w.size(0) * PW;
  if (bias) TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                        "linear: bias");
  if (x.stride(1) != 1) x = x.contiguous();
  auto y = torch::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0 || N == 0) return y;
  run_panels(x.data_ptr<float>(), x.stride(0), x.size(0), w.data_ptr<float>(), w.size(1), w.size(0),
             bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), y.stride(0));
  return y;
}

}  // namespace pn
