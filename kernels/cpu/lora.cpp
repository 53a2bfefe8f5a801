// LoRA through row tables (kernels/lora_cpu.py), in the namespace `lo` of the one extension (kernels/cpu/lorafleet_cpu.cpp).
#include "vector.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <vector>

namespace lo {

// one (mix, module) of a call: rows [row0, row0 + n) against A [r, in] and Bt [r, n_out], whose
// rows start at the pool offsets a[0 .. r) and b[0 .. r); its shrink results at t + t_off
// ([n, r], fp32), rank row k's times sc[k] (null: 1); for a one-row segment, its expand's
// partial sums at p + p_off ([ceil(r / KE), n_out], fp32). A mix of several adapters is one item
// whose rank rows are its members' side by side (their pointers copied into one list), each
// member's scaled in the shrink: the expand then sums every member's delta in fp32 before the
// output is touched, so it is rounded once, and a mix costs what an adapter of its total rank does.
struct Item {
  int64_t row0, n, r, n_out, col, t_off, p_off;
  const int64_t *a, *b;
  const float* sc;
  const void *g, *c;  // a lone segment's epilogue rows ([n_out] each, the pool's dtype), or null
};

constexpr int64_t FIELDS = 7;  // a row table's fields per slot (kernels/reference.py's TABLE_FIELDS)

// an output element's last step: y + delta, or the epilogue g * (y + delta) + c (fp32, rounded
// once); g and c are adapter rows, in the adapters' storage W
template <class W>
static inline vw finish(const Item& it, int64_t at, vw y) {
  if (!it.g) return y;
  return wload(static_cast<const W*>(it.g) + at) * y + wload(static_cast<const W*>(it.c) + at);
}
template <class W>
static inline float finish1(const Item& it, int64_t at, float y) {
  if (!it.g) return y;
  return float(static_cast<const W*>(it.g)[at]) * y + float(static_cast<const W*>(it.c)[at]);
}

// Tile shapes, so that every accumulator of a tile stays in a register (cpu_vector's `vw`):
#if defined(__AVX512F__)    // 32 registers of 16 lanes
constexpr int64_t KR = 4;   // rank rows per shrink tile: each x element loaded serves four
constexpr int SR = 4;       // x rows per shrink tile: 16 accumulators
constexpr int64_t CW = 64;  // output columns per expand task: four vectors per row
constexpr int ER = 4;       // x rows per expand tile: 16 accumulators
#else                       // AVX2: 16 registers of 8 lanes (the best of 18 shapes on tiny's, r64)
constexpr int64_t KR = 4;
constexpr int SR = 2;       // 8 accumulators
constexpr int64_t CW = 128; // 512 contiguous bytes of each Bt row per task
constexpr int ER = 1;       // 16 accumulators, Bt read straight into the FMAs
#endif
constexpr int64_t PF = 8;   // Bt rows prefetched ahead: a task's rows are n_out apart, which the
                            // hardware prefetcher does not follow
constexpr int64_t KE = 16;  // rank rows per task of a one-row segment's expand: whole Bt rows
constexpr int64_t RW = 256; // output columns per task of its sum

// a segment's scale: the fp32 whose bits its int64 field holds (kernels/reference.py)
static inline float seg_scale(int64_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits);
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// t[b * ldt + j] = a[j] . x[b] over K, for NJ rank rows and NB x rows (fp32 sums)
template <class S, class W, int NJ, int NB>
static inline void shrink_tile(const W* const* a, const S* const* x, int64_t K, float* t, int64_t ldt) {
  vw acc[NB][NJ];
  for (int b = 0; b < NB; ++b)
    for (int j = 0; j < NJ; ++j) acc[b][j] = vw{};
  int64_t d = 0;
  for (; d + VW <= K; d += VW) {
    vw av[NJ];
    for (int j = 0; j < NJ; ++j) av[j] = wload(a[j] + d);
    for (int b = 0; b < NB; ++b) {
      const vw xv = wload(x[b] + d);
      for (int j = 0; j < NJ; ++j) acc[b][j] += av[j] * xv;
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int j = 0; j < NJ; ++j) {
      float s = hsum(acc[b][j]);
      for (int64_t e = d; e < K; ++e) s += float(a[j][e]) * float(x[b][e]);
      t[b * ldt + j] = s;
    }
}

template <class S, class W, int NJ>
static inline void shrink_rows(const W* const* a, const S* xp, int64_t ldx, int64_t row0, int64_t n, int64_t K,
                               float* t, int64_t ldt) {
  int64_t b = 0;
  for (; b + SR <= n; b += SR) {
    const S* x[SR];
    for (int i = 0; i < SR; ++i) x[i] = xp + (row0 + b + i) * ldx;
    shrink_tile<S, W, NJ, SR>(a, x, K, t + b * ldt, ldt);
  }
  for (; b < n; ++b) {
    const S* x[1] = {xp + (row0 + b) * ldx};
    shrink_tile<S, W, NJ, 1>(a, x, K, t + b * ldt, ldt);
  }
}

// the shrink of rank rows [k0, k0 + KR) of one item, for all its rows
template <class S, class W>
static void shrink(const Item& it, int64_t k0, const W* wp, const S* xp, int64_t ldx, int64_t in, float* t) {
  float* tk = t + it.t_off + k0;
  const int64_t nk = std::min(KR, it.r - k0);
  const W* a[KR];
  bool tile = nk == KR;  // the KR rows side by side in one tile
  for (int64_t j = 0; j < nk; ++j) a[j] = wp + it.a[k0 + j];
#if defined(__AVX512F__)
  // one x row on an AMD CPU with AVX-512: one A row at a time (the loop below), one sequential
  // stream, as `linear_cpu` reads a weight for one row there (faster than KR rows side by side
  // for a step's LoRA over 2-8 adapters of one row each, the pool on huge pages or not)
  tile = tile && !(it.n == 1 && amd_layout());
#endif
  if (tile) {
    shrink_rows<S, W, KR>(a, xp, ldx, it.row0, it.n, in, tk, it.r);
  } else {
    for (int64_t j = 0; j < nk; ++j)  // one rank row at a time: a tail, or the above
      shrink_rows<S, W, 1>(&a[j], xp, ldx, it.row0, it.n, in, tk + j, it.r);
  }
  if (it.sc)  // a mix: each member's rank rows times its scale
    for (int64_t b = 0; b < it.n; ++b)
      for (int64_t j = 0; j < nk; ++j) tk[b * it.r + j] *= it.sc[k0 + j];
}

// out[rows, col + c0 ...] += t[rows] @ Bt[:, c0 : c0 + w] for NB rows, w <= CW columns: each
// output element is summed in fp32 over every rank row and rounded once
template <class S, class W, int NB>
static inline void expand_tile(const Item& it, int64_t b0, int64_t c0, int64_t w, const float* t,
                               const W* const* bt, S* op, int64_t ldo) {
  constexpr int Q = CW / VW;  // vectors per row
  vw acc[NB][Q];
  for (int b = 0; b < NB; ++b)
    for (int q = 0; q < Q; ++q) acc[b][q] = vw{};
  for (int64_t k = 0; k < it.r; ++k) {
    if (b0 == 0 && k + PF < it.r)  // the first rows read Bt from memory: its later rows ahead
      for (int64_t c = 0; c < CW; c += 64 / (int)sizeof(W)) __builtin_prefetch(bt[k + PF] + c, 0, 3);
    vw bv[Q];
    for (int q = 0; q < Q; ++q) bv[q] = wload(bt[k] + VW * q);
    for (int b = 0; b < NB; ++b) {
      const float c = t[(b0 + b) * it.r + k];
      for (int q = 0; q < Q; ++q) acc[b][q] += c * bv[q];
    }
  }
  for (int b = 0; b < NB; ++b) {
    S* y = op + (it.row0 + b0 + b) * ldo + it.col + c0;
    if (w == CW) {
      for (int q = 0; q < Q; ++q) wstore(y + VW * q, finish<W>(it, c0 + VW * q, wload(y + VW * q) + acc[b][q]));
    } else {
      float sum[CW];
      for (int q = 0; q < Q; ++q) wstore(sum + VW * q, acc[b][q]);
      for (int64_t c = 0; c < w; ++c) y[c] = S(finish1<W>(it, c0 + c, float(y[c]) + sum[c]));
    }
  }
}

// the expand of output columns [c0, c0 + CW) of one item, for all its rows; the last, narrower
// block is first copied out (zero padded)
template <class S, class W>
static void expand(const Item& it, int64_t c0, const W* wp, const float* t, S* op, int64_t ldo,
                   std::vector<W>& buf, std::vector<const W*>& bt) {
  const int64_t w = std::min(CW, it.n_out - c0);
  bt.resize(it.r);
  if (w < CW) buf.resize(it.r * CW);
  for (int64_t k = 0; k < it.r; ++k) {
    const W* src = wp + it.b[k] + c0;
    if (w == CW) {
      bt[k] = src;
    } else {
      W* row = buf.data() + k * CW;
      std::copy(src, src + w, row);
      std::fill(row + w, row + CW, W(0.f));
      bt[k] = row;
    }
  }
  const float* ti = t + it.t_off;
  int64_t b = 0;
  for (; b + ER <= it.n; b += ER) expand_tile<S, W, ER>(it, b, c0, w, ti, bt.data(), op, ldo);
  for (; b < it.n; ++b) expand_tile<S, W, 1>(it, b, c0, w, ti, bt.data(), op, ldo);
}

// A one-row segment (decode) reads Bt by whole rows instead: a task takes KE rank rows and adds
// each, scaled by the row's shrink result, to an fp32 partial of all n_out columns (in L1), so
// Bt streams from memory in contiguous rows rather than in CW-column pieces n_out apart; a
// last pass sums the partials into the output, each element rounded once.
template <class S>
static inline void axpy(float c, const S* x, float* y, int64_t n) {
  const vw cv = vw{} + c;
  int64_t i = 0;
  for (; i + VW <= n; i += VW) wstore(y + i, wload(y + i) + cv * wload(x + i));
  for (; i < n; ++i) y[i] += c * float(x[i]);
}

template <class W>
static void expand_rows(const Item& it, int64_t k0, const W* wp, const float* t, float* p) {
  float* part = p + it.p_off + (k0 / KE) * it.n_out;
  std::fill(part, part + it.n_out, 0.f);
  for (int64_t k = k0; k < std::min(it.r, k0 + KE); ++k)
    axpy(t[it.t_off + k], wp + it.b[k], part, it.n_out);
}

template <class S, class W>
static void sum_parts(const Item& it, int64_t c0, const float* p, S* op, int64_t ldo) {
  const int64_t parts = (it.r + KE - 1) / KE, w = std::min(RW, it.n_out - c0);
  const float* part = p + it.p_off + c0;
  S* y = op + it.row0 * ldo + it.col + c0;
  int64_t c = 0;
  for (; c + VW <= w; c += VW) {
    vw acc = wload(part + c);
    for (int64_t b = 1; b < parts; ++b) acc += wload(part + b * it.n_out + c);
    wstore(y + c, finish<W>(it, c0 + c, wload(y + c) + acc));
  }
  for (; c < w; ++c) {
    float acc = part[c];
    for (int64_t b = 1; b < parts; ++b) acc += part[b * it.n_out + c];
    y[c] = S(finish1<W>(it, c0 + c, float(y[c]) + acc));
  }
}

// S: the storage of x and out (float or bf16); W: the adapters' in the pool (S, or a 16-bit
// type under fp32 x: `--lora-dtype`, widened in registers)
template <class S, class W>
static void lora_t(const torch::Tensor& x, torch::Tensor& out, const torch::Tensor& w, const torch::Tensor& seg,
                   int64_t entry, int64_t M) {
  const S* xp = x.data_ptr<S>();
  S* op = out.data_ptr<S>();
  const W* wp = static_cast<const W*>(w.data_ptr());
  const int64_t* wi = reinterpret_cast<const int64_t*>(wp);  // the pool's bytes: the row tables
  const int64_t* sp = seg.data_ptr<int64_t>();
  const int64_t S_ = seg.size(0), in = x.size(1);
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  std::vector<Item> items;
  // (item, first rank row / column): the shrink's tasks; the expand's, first those of segments
  // of several rows (columns), then those of one row (rank rows); the one-row sums (columns)
  std::vector<std::pair<int64_t, int64_t>> shrinks, expands, row_expands, sums;
  std::vector<int64_t> cat;  // the row pointers of mixes' items, a's then b's per item
  std::vector<float> cat_sc;  // their rank rows' scales
  std::vector<std::array<int64_t, 3>> mixed;  // (item, offset in cat, offset in cat_sc)
  int64_t t_size = 0, p_size = 0;
  for (int64_t s = 0; s < S_; ++s) {
    const int64_t* g = sp + 5 * s;  // (start, end, table, scale, mix)
    const int64_t n = g[1] - g[0], members = g[4];
    if (members < 1 || n <= 0) continue;  // a follower (in its lead's item), or empty: never read
    for (int64_t m = 0; m < M; ++m) {
      int64_t r = 0, n_out = 0, col = 0, count = 0;
      const int64_t* one = nullptr;
      bool unit = true;
      for (int64_t j = 0; j < members; ++j) {
        const int64_t* f = wi + g[5 * j + 2] + entry + m * FIELDS;  // (r, n_out, col, a_rows, b_rows, g, c)
        if (f[0] == 0) continue;
        r += f[0], n_out = f[1], col = f[2], one = f, ++count;
        unit = unit && seg_scale(g[5 * j + 3]) == 1.f;
      }
      if (r == 0) continue;
      const int64_t i = items.size();
      items.push_back({g[0], n, r, n_out, col, t_size, p_size, nullptr, nullptr, nullptr, nullptr, nullptr});
      if (members == 1 && one[5] >= 0)  // a lone segment's epilogue (DoRA, lora_bias)
        items[i].g = wp + one[5], items[i].c = wp + one[6];
      if (count == 1 && unit) {  // one adapter as is: its pointer lists in the pool
        items[i].a = wi + one[3], items[i].b = wi + one[4];
      } else {
        mixed.push_back({i, (int64_t)cat.size(), (int64_t)cat_sc.size()});
        for (int pass = 0; pass < 2; ++pass)
          for (int64_t j = 0; j < members; ++j) {
            const int64_t* f = wi + g[5 * j + 2] + entry + m * FIELDS;
            const int64_t* rows = wi + f[3 + pass];
            cat.insert(cat.end(), rows, rows + f[0]);
            if (pass == 0) cat_sc.insert(cat_sc.end(), f[0], seg_scale(g[5 * j + 3]));
          }
      }
      t_size += n * r;
      for (int64_t k = 0; k < r; k += KR) shrinks.emplace_back(i, k);
      if (n == 1) {
        p_size += (r + KE - 1) / KE * n_out;
        for (int64_t k = 0; k < r; k += KE) row_expands.emplace_back(i, k);
        for (int64_t c = 0; c < n_out; c += RW) sums.emplace_back(i, c);
      } else {
        for (int64_t c = 0; c < n_out; c += CW) expands.emplace_back(i, c);
      }
    }
  }
  for (const auto& [i, at, at_sc] : mixed)  // cat no longer grows: point into it
    items[i].a = cat.data() + at, items[i].b = cat.data() + at + items[i].r, items[i].sc = cat_sc.data() + at_sc;
  if (items.empty()) return;
  const int64_t n_cols = expands.size();
  expands.insert(expands.end(), row_expands.begin(), row_expands.end());
  std::vector<float> t(t_size);
  std::unique_ptr<float[]> p(new float[p_size]);  // each task zeroes its own part
  at::parallel_for(0, (int64_t)shrinks.size(), 1, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) shrink<S, W>(items[shrinks[i].first], shrinks[i].second, wp, xp, ldx, in, t.data());
  });
  at::parallel_for(0, (int64_t)expands.size(), 1, [&](int64_t a, int64_t b) {
    std::vector<W> buf;
    std::vector<const W*> bt;
    for (int64_t i = a; i < b; ++i) {
      const Item& it = items[expands[i].first];
      if (i < n_cols) expand<S, W>(it, expands[i].second, wp, t.data(), op, ldo, buf, bt);
      else expand_rows<W>(it, expands[i].second, wp, t.data(), p.get());
    }
  });
  if (!sums.empty())
    at::parallel_for(0, (int64_t)sums.size(), 1, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) sum_parts<S, W>(items[sums[i].first], sums[i].second, p.get(), op, ldo);
    });
}

void lora(torch::Tensor x, torch::Tensor out, torch::Tensor w, torch::Tensor seg, int64_t entry, int64_t slots) {
  const auto xt = x.scalar_type(), wt = w.scalar_type();
  TORCH_CHECK(out.scalar_type() == xt && (xt == at::kFloat || xt == at::kBFloat16), "lora: x and out are one dtype, "
              "float32 or bfloat16");
  TORCH_CHECK(wt == xt || (xt == at::kFloat && (wt == at::kBFloat16 || wt == at::kHalf)),
              "lora: the pool's adapters are x's dtype, or bfloat16 or float16 under float32 x");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && w.is_contiguous(), "lora: layout");
  TORCH_CHECK(seg.is_contiguous() && seg.dim() == 2 && seg.size(1) == 5, "lora: seg must be [S, 5], contiguous");
  if (xt == at::kBFloat16) lora_t<c10::BFloat16, c10::BFloat16>(x, out, w, seg, entry, slots);
  else if (wt == at::kBFloat16) lora_t<float, c10::BFloat16>(x, out, w, seg, entry, slots);
  else if (wt == at::kHalf) lora_t<float, c10::Half>(x, out, w, seg, entry, slots);
  else lora_t<float, float>(x, out, w, seg, entry, slots);
}

}  // namespace lo
