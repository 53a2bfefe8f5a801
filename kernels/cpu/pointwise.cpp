// The row-wise ops and the KV write (kernels/pointwise_cpu.py), in the namespace `pw` of the one extension (kernels/cpu/lorafleet_cpu.cpp).
#include "vector.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>
#include <algorithm>

namespace pw {

// the value as the reference's dtype would hold it: identity in fp32, rounded in bf16
static inline float as(float v, float) { return v; }
static inline float as(float v, c10::BFloat16) { return float(c10::BFloat16(v)); }

constexpr int64_t GRAIN = 16;  // rows per task: one task (no threads woken) at decode sizes

template <class S>
static void norm_rows(const S* x, int64_t ldx, const S* w, S* y, int64_t ldy, int64_t T, int64_t H, float eps) {
  at::parallel_for(0, T, GRAIN, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const S* xr = x + t * ldx;
      S* yr = y + t * ldy;
      float ss = 0.f;
#pragma omp simd reduction(+:ss)
      for (int64_t d = 0; d < H; ++d) { const float v = float(xr[d]); ss += v * v; }
      const float r = 1.f / std::sqrt(ss / float(H) + eps);
#pragma omp simd
      for (int64_t d = 0; d < H; ++d) yr[d] = S(float(w[d]) * as(float(xr[d]) * r, S()));
    }
  });
}

template <class S>
static void add_rows(S* x, int64_t ldx, const S* o, int64_t ldo, int64_t T, int64_t H) {
  at::parallel_for(0, T, GRAIN, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      S* xr = x + t * ldx;
      const S* orow = o + t * ldo;
#pragma omp simd
      for (int64_t d = 0; d < H; ++d) xr[d] = S(float(xr[d]) + float(orow[d]));
    }
  });
}

static void check_rows(const torch::Tensor& t, int64_t H, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.size(1) == H && t.stride(1) == 1, what, ": rows of ", H, " contiguous elements");
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  const int64_t H = w.numel();
  check_rows(x, H, "rms_norm x");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == x.scalar_type(), "rms_norm: weight");
  auto y = torch::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.scalar_type() == at::kFloat)
    norm_rows<float>(x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), y.data_ptr<float>(), H, x.size(0), H, eps);
  else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rms_norm: float32 or bfloat16 only");
    using B = c10::BFloat16;
    norm_rows<B>(x.data_ptr<B>(), x.stride(0), w.data_ptr<B>(), y.data_ptr<B>(), H, x.size(0), H, eps);
  }
  return y;
}

// x += delta (in place), then rms_norm(x)
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps) {
  const int64_t H = w.numel();
  check_rows(x, H, "add_rms_norm x");
  check_rows(delta, H, "add_rms_norm delta");
  TORCH_CHECK(delta.size(0) == x.size(0) && delta.scalar_type() == x.scalar_type(), "add_rms_norm: delta");
  if (x.scalar_type() == at::kFloat) {
    add_rows<float>(x.data_ptr<float>(), x.stride(0), delta.data_ptr<float>(), delta.stride(0), x.size(0), H);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "add_rms_norm: float32 or bfloat16 only");
    using B = c10::BFloat16;
    add_rows<B>(x.data_ptr<B>(), x.stride(0), delta.data_ptr<B>(), delta.stride(0), x.size(0), H);
  }
  return rms_norm(x, w, eps);
}

// rotate-half RoPE of every head of x [T, heads, D] in place, at each row's position
template <class S>
static void rope_heads(S* x, int64_t s0, int64_t s1, int64_t T, int64_t heads, int64_t D,
                       const S* cos, const S* sin, const int64_t* pos) {
  const int64_t h = D / 2;
  at::parallel_for(0, T, GRAIN, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const S* c = cos + pos[t] * D;
      const S* s = sin + pos[t] * D;
      for (int64_t j = 0; j < heads; ++j) {
        S* v = x + t * s0 + j * s1;
        // reference: x * cos + cat(-x2, x1) * sin, each product and the sum in the dtype
        int64_t d = 0;
        for (; d + VW <= h; d += VW) {
          const vw a = wload(v + d), b = wload(v + d + h);
          const vw lo = wround(a * wload(c + d), S()) + wround(-b * wload(s + d), S());
          const vw hi = wround(b * wload(c + d + h), S()) + wround(a * wload(s + d + h), S());
          wstore(v + d, lo);
          wstore(v + d + h, hi);
        }
        for (; d < h; ++d) {
          const float a = float(v[d]), b = float(v[d + h]);
          const float lo = as(a * float(c[d]), S()) + as(-b * float(s[d]), S());
          const float hi = as(b * float(c[d + h]), S()) + as(a * float(s[d + h]), S());
          v[d] = S(lo);
          v[d + h] = S(hi);
        }
      }
    }
  });
}

void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.size(2) == k.size(2) &&
              q.size(0) == k.size(0), "rope_: q [T, H, D] and k [T, KH, D] with contiguous heads");
  const int64_t D = q.size(2), T = q.size(0);
  TORCH_CHECK(D % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == D && sin.size(1) == D,
              "rope_: cos/sin tables [positions, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == T,
              "rope_: positions [T] int64");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == q.scalar_type() &&
              sin.scalar_type() == q.scalar_type(), "rope_: dtypes differ");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rope_: position out of range");
  if (q.scalar_type() == at::kFloat) {
    rope_heads<float>(q.data_ptr<float>(), q.stride(0), q.stride(1), T, q.size(1), D, cos.data_ptr<float>(), sin.data_ptr<float>(), pos);
    rope_heads<float>(k.data_ptr<float>(), k.stride(0), k.stride(1), T, k.size(1), D, cos.data_ptr<float>(), sin.data_ptr<float>(), pos);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "rope_: float32 or bfloat16 only");
    using B = c10::BFloat16;
    rope_heads<B>(q.data_ptr<B>(), q.stride(0), q.stride(1), T, q.size(1), D, cos.data_ptr<B>(), sin.data_ptr<B>(), pos);
    rope_heads<B>(k.data_ptr<B>(), k.stride(0), k.stride(1), T, k.size(1), D, cos.data_ptr<B>(), sin.data_ptr<B>(), pos);
  }
}

// a [T, I] = silu(gu[:, :I]) * gu[:, I:]
template <class S>
static void silu_rows(const S* gu, int64_t ld, S* a, int64_t T, int64_t I) {
  at::parallel_for(0, T, GRAIN, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const S* g = gu + t * ld;
      S* out = a + t * I;
      int64_t d = 0;
      for (; d + VW <= I; d += VW) {
        const vw x = wload(g + d);
        wstore(out + d, wround(x / (1.f + wexp(-x)), S()) * wload(g + d + I));
      }
      for (; d < I; ++d) {
        const float x = float(g[d]);
        out[d] = S(as(x / (1.f + exp1(-x)), S()) * float(g[d + I]));
      }
    }
  });
}

torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0 && gu.stride(1) == 1, "silu_mul: gu [T, 2I] with contiguous rows");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto a = torch::empty({T, I}, gu.options());
  if (gu.scalar_type() == at::kFloat) silu_rows<float>(gu.data_ptr<float>(), gu.stride(0), a.data_ptr<float>(), T, I);
  else {
    TORCH_CHECK(gu.scalar_type() == at::kBFloat16, "silu_mul: float32 or bfloat16 only");
    using B = c10::BFloat16;
    silu_rows<B>(gu.data_ptr<B>(), gu.stride(0), a.data_ptr<B>(), T, I);
  }
  return a;
}

// kv[slot_pages[t], 0|1, slot_offsets[t]] = k[t] | v[t]: one copy of KVH x D elements per row
void write_kv(torch::Tensor kv, torch::Tensor k, torch::Tensor v, torch::Tensor pages, torch::Tensor offsets) {
  TORCH_CHECK(kv.dim() == 5 && k.dim() == 3 && v.dim() == 3, "write_kv: kv [P, 2, B, KVH, D], k and v [T, KVH, D]");
  const int64_t T = k.size(0), KVH = kv.size(3), D = kv.size(4), P = kv.size(0), B = kv.size(2);
  TORCH_CHECK(kv.stride(4) == 1 && kv.stride(3) == D, "write_kv: a slot's [KVH, D] must be contiguous");
  for (const auto& x : {k, v})
    TORCH_CHECK(x.size(0) == T && x.size(1) == KVH && x.size(2) == D && x.stride(2) == 1 && x.stride(1) == D &&
                x.scalar_type() == kv.scalar_type(), "write_kv: k and v [T, KVH, D] like the pool's slots");
  TORCH_CHECK(pages.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && pages.is_contiguous() &&
              offsets.is_contiguous() && pages.numel() == T && offsets.numel() == T, "write_kv: slots [T] int64");
  const int64_t* pg = pages.data_ptr<int64_t>();
  const int64_t* of = offsets.data_ptr<int64_t>();
  const int64_t es = kv.element_size(), row = KVH * D * es;
  char* base = static_cast<char*>(kv.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pg[t] >= 0 && pg[t] < P && of[t] >= 0 && of[t] < B, "write_kv: slot out of range");
    char* slot = base + (pg[t] * kv.stride(0) + of[t] * kv.stride(2)) * es;
    std::memcpy(slot, static_cast<const char*>(k.data_ptr()) + t * k.stride(0) * es, row);
    std::memcpy(slot + kv.stride(1) * es, static_cast<const char*>(v.data_ptr()) + t * v.stride(0) * es, row);
  }
}

// per row of logits [S, V]: the first index of its largest value, and whether every value is
// finite (a row with a NaN or an infinity gets false; its index is then meaningless).
// Each row is cut into as many pieces as there are threads, and a thread takes the same piece of
// every row (tasks piece by piece), as the LM head's threads each wrote a range of its columns;
// one pass a piece: each lane keeps its largest value and the first index holding it. Before,
// rows went to threads whole, in two passes (the largest value, then where it first is): slower,
// in decode steps and on logits in cache. (In a step most of the call's time is its code and
// data, cold after the weights.)
constexpr int64_t GREEDY_PIECE = 2048;  // no piece shorter

std::tuple<torch::Tensor, torch::Tensor> greedy(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 && logits.size(1) > 0,
              "greedy: logits [S, V] float32 with contiguous rows");
  const int64_t S = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(V < (int64_t(1) << 31), "greedy: a vocabulary under 2^31");
  auto tokens = torch::empty({S}, logits.options().dtype(at::kLong));
  auto finite = torch::empty({S}, logits.options().dtype(at::kBool));
  const float* lp = logits.data_ptr<float>();
  // P pieces of `len` (each non-empty: len >= GREEDY_PIECE > P), their results [P][S]
  const int64_t P = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), V / GREEDY_PIECE));
  const int64_t len = (V + P - 1) / P;
  std::vector<float> pmax(P * S);
  std::vector<int64_t> pat(P * S);
  std::vector<char> pbad(P * S);
  at::parallel_for(0, P * S, 1, [&](int64_t u0, int64_t u1) {
    const iw lanes = lane_ids();
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t p = u / S, s = u % S, c0 = p * len, c1 = std::min(V, c0 + len);
      const float* row = lp + s * ld;
      vw vm = vw{} - INFINITY;
      iw vi = iw{}, vbad = iw{};
      int64_t i = c0;
      for (; i + VW <= c1; i += VW) {
        const vw x = wload(row + i);
        const iw up = (iw)(x > vm);  // strictly: a lane keeps the first index of its largest; NaN never wins
        vm = up ? x : vm;
        vi = up ? lanes + int32_t(i) : vi;
        vbad |= (iw)((x - x) != 0.f);  // x - x is 0 only for finite x
      }
      float m = -INFINITY;
      int64_t at = c0;
      int bad = 0;
      for (int l = 0; l < VW; ++l) {
        bad |= vbad[l] != 0;
        if (vm[l] > m || (vm[l] == m && vi[l] < at)) { m = vm[l]; at = vi[l]; }
      }
      for (; i < c1; ++i) {  // the tail comes after every lane's indices: only a larger value wins
        bad |= (row[i] - row[i]) != 0.f;
        if (row[i] > m) { m = row[i]; at = i; }
      }
      pmax[u] = m;
      pat[u] = at;
      pbad[u] = bad;
    }
  });
  int64_t* tp = tokens.data_ptr<int64_t>();
  bool* fp = finite.data_ptr<bool>();
  for (int64_t s = 0; s < S; ++s) {  // the pieces in order: an earlier one keeps a tie
    float m = pmax[s];
    int64_t at = pat[s];
    bool bad = pbad[s];
    for (int64_t p = 1; p < P; ++p) {
      bad |= pbad[p * S + s] != 0;
      if (pmax[p * S + s] > m) { m = pmax[p * S + s]; at = pat[p * S + s]; }
    }
    tp[s] = at;
    fp[s] = !bad;
  }
  return {tokens, finite};
}

}  // namespace pw
