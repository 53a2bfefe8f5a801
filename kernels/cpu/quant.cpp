// Weight-only quantized projections (kernels/quant_cpu.py): the decode matmul on int8/int4 codes,
// dequantized in registers, the prefill GEMM by blocks of dequantized rows, and an embedding's rows,
// in the namespace `qt` of the one extension (kernels/cpu/lorafleet_cpu.cpp).
#include "vector.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <memory>
#include <cstdlib>
#include <cstring>

namespace qt {

constexpr int QB = 32;          // elements per quantized run along K (every group is a multiple of it)
constexpr int NV = QB / VW;     // vectors per run: 2 with AVX-512, 4 with AVX2

constexpr int64_t XCHUNK_BYTES = 16 * 1024;  // x rows past twice this go by chunks of K this size: x stays in L1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define QT_AMX 1
constexpr int64_t SEGRUNS = 4;      // runs of a row amx_run dequantizes at a time: fewer or more ran slower
constexpr int64_t GROUPS_FROM = 5;  // fp32 rows from which groups < K go on the tiles: below, the FMA tiles win
#endif

static inline float half_f(const at::Half* p) { return _cvtsh_ss(p->x); }

// One run of 32 codes (int8: 32 bytes; int4: 16 bytes, byte i holding element i low and i + 16
// high) as NV vectors of fp32 weights d * code + o (int4: d * (code - 8) + o) in one rounding (an
// FMA, as cheap as the product alone); o = -0 adds nothing (x + -0 is x), leaving the product exact
#if defined(__AVX512F__)
// int4 by a table: the 16 values d * (c - 8) + o in one register, each lane's code its index
// (VPERMPS reads an index's low 4 bits, so the low nibble needs no mask): 4 instructions a run
// against 8 by converting each code to fp32 and scaling it
static inline void deq_i4(const uint8_t* p, float d, float o, vw* out) {
  const __m512 table = _mm512_fmadd_ps(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7),
                                       _mm512_set1_ps(d), _mm512_set1_ps(o));
  const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  out[0] = _mm512_permutexvar_ps(idx, table);
  out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
}
static inline void deq_i8(const uint8_t* p, float d, float o, vw* out) {
  const __m512 dv = _mm512_set1_ps(d), ov = _mm512_set1_ps(o);
  for (int v = 0; v < 2; ++v)
    out[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * v)))), dv, ov);
}
#else
static inline void deq_i4(const uint8_t* p, float d, float o, vw* out) {
  const __m256 dv = _mm256_set1_ps(d), off = _mm256_set1_ps(o - 8.f * d);
  const __m128i m = _mm_set1_epi8(15), b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
  const __m128i h[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int v = 0; v < 4; ++v) out[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h[v])), dv, off);
}
static inline void deq_i8(const uint8_t* p, float d, float o, vw* out) {
  const __m256 dv = _mm256_set1_ps(d), ov = _mm256_set1_ps(o);
  for (int v = 0; v < 4; ++v)
    out[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * v)))), dv, ov);
}
#endif
template <bool I4> static inline void deq(const uint8_t* p, float d, float o, vw* out) {
  if constexpr (I4) deq_i4(p, d, o, out); else deq_i8(p, d, o, out);
}

struct Args {
  const float* x; int64_t ldx; int64_t T;   // x [T, K] in fp32 (bf16 x widened once per call)
  const uint8_t* q; int64_t ldq;            // codes, ldq bytes a row
  const at::Half* s; int64_t ls; int64_t G; // scales [N, K / G]
  const float* o;                           // offsets [N, K / G] (a GGUF file's affine types), or null
  int64_t K, N;
  const float* bias;                        // [N] in fp32, or null
  float* y; int64_t ldy;                    // [T, N] fp32
  bool xbf16;                               // x came as bf16 (exact in bf16)
};
// the span of K a pass covers (`lin::Span`'s idea): all of it, or a chunk, `part` then holding
// each output's sum over the chunks before
struct Span { int64_t k0, len; float* part; };

// out[j][t] = dequantized row j . x[t] over the span's runs, for NB weight rows and TB x rows. CH:
// one scale per row (G = K), applied by the caller to the sums, so the runs dequantize with d = 1.
// OFF: each run's group offset joins its dequantized weights (free: `deq`'s FMA); never with CH.
// With `pf`, the next block's codes of this span are prefetched a cache line per line read here
template <bool I4, bool CH, bool OFF, int NB, int TB>
static inline void tile(const Args& a, const Span& c, const uint8_t* const* q, const at::Half* const* s,
                        const float* const* o, const float* const* x, float (*out)[TB], const uint8_t* const* pf) {
  constexpr int64_t RB = I4 ? QB / 2 : QB;  // bytes a run
  vw acc[NB][TB];
  for (int j = 0; j < NB; ++j)
    for (int t = 0; t < TB; ++t) acc[j][t] = vw{};
  const int64_t bpg = a.G / QB, r0 = c.k0 / QB, runs = c.len / QB;
  int64_t g = r0 / bpg, in_g = r0 % bpg;  // the group of the run, and the run's place in it
  for (int64_t r = r0; r < r0 + runs; ++r) {
    if (pf && (r * RB) % 64 == 0)
      for (int j = 0; j < NB; ++j) __builtin_prefetch(pf[j] + r * RB, 0, 3);
    vw wv[NB][NV];
    for (int j = 0; j < NB; ++j) deq<I4>(q[j] + r * RB, CH ? 1.f : half_f(s[j] + g), OFF ? o[j][g] : -0.f, wv[j]);
    for (int v = 0; v < NV; ++v)
      for (int t = 0; t < TB; ++t) {
        const vw xv = wload(x[t] + r * QB + v * VW);
        for (int j = 0; j < NB; ++j) acc[j][t] += wv[j][v] * xv;
      }
    if (!CH && ++in_g == bpg) { in_g = 0; ++g; }
  }
  for (int j = 0; j < NB; ++j)
    for (int t = 0; t < TB; ++t) out[j][t] = hsum(acc[j][t]);
}

// x rows [t0, t0 + TB) (all real) against weight rows [n0, n0 + nn) over span c; rows past the end
// repeat the last (computed, never stored), so the tile keeps its shape
template <bool I4, bool CH, bool OFF, int NB, int TB>
static void block(const Args& a, const Span& c, int64_t t0, int64_t n0, int64_t nn, const uint8_t* const* pf) {
  const uint8_t* q[NB];
  const at::Half* s[NB];
  const float* o[NB];
  const float* x[TB];
  for (int j = 0; j < NB; ++j) {
    const int64_t n = n0 + std::min<int64_t>(j, nn - 1);
    q[j] = a.q + n * a.ldq;
    s[j] = a.s + n * a.ls;
    o[j] = OFF ? a.o + n * a.ls : nullptr;
  }
  for (int t = 0; t < TB; ++t) x[t] = a.x + (t0 + t) * a.ldx;
  float out[NB][TB];
  tile<I4, CH, OFF, NB, TB>(a, c, q, s, o, x, out, pf);
  for (int t = 0; t < TB; ++t)
    for (int j = 0; j < nn; ++j) {
      float v = out[j][t];
      if (c.part && !chunk_sum(v, c.part[(t0 + t) * a.N + n0 + j], c.k0, c.len, a.K)) continue;
      if (CH) v *= half_f(s[j]);
      a.y[(t0 + t) * a.ldy + n0 + j] = v + (a.bias ? a.bias[n0 + j] : 0.f);
    }
}

// every x row against one block of weight rows: tiles of TB rows, the rest in one tile of its own
// height (a compile-time count, as `lin` found faster than a runtime one)
template <bool I4, bool CH, bool OFF, int NB, int TB>
static void tiles(const Args& a, const Span& c, int64_t n0, int64_t nn, const uint8_t* const* pf) {
  int64_t t0 = 0;
  for (; t0 + TB <= a.T; t0 += TB) block<I4, CH, OFF, NB, TB>(a, c, t0, n0, nn, t0 == 0 ? pf : nullptr);
  const uint8_t* const* p = t0 == 0 ? pf : nullptr;
  if constexpr (TB == 8) {
    switch (a.T - t0) {
      case 0: break;
      case 1: block<I4, CH, OFF, NB, 1>(a, c, t0, n0, nn, p); break;
      case 2: block<I4, CH, OFF, NB, 2>(a, c, t0, n0, nn, p); break;
      case 3: block<I4, CH, OFF, NB, 3>(a, c, t0, n0, nn, p); break;
      case 4: block<I4, CH, OFF, NB, 4>(a, c, t0, n0, nn, p); break;
      case 5: block<I4, CH, OFF, NB, 5>(a, c, t0, n0, nn, p); break;
      case 6: block<I4, CH, OFF, NB, 6>(a, c, t0, n0, nn, p); break;
      case 7: block<I4, CH, OFF, NB, 7>(a, c, t0, n0, nn, p); break;
    }
  } else {
    TORCH_CHECK(t0 == a.T, "quant linear: rows left past the tiles");
  }
}

// N in blocks of NB rows over torch's threads; x rows wider than XCHUNK_BYTES * 2 go by chunks of K
// of at most XCHUNK_BYTES of x (each thread's blocks over one chunk, then the next), so the chunk
// stays in L1 while the codes stream by (`lin::run`'s reason); the rows that stream next are
// prefetched as a block runs (`tile`)
template <bool I4, bool CH, bool OFF, int NB, int TB>
static void run(const Args& a) {
  const int64_t blocks = (a.N + NB - 1) / NB, xk = std::min<int64_t>(a.T, 8) * int64_t(sizeof(float));
  int64_t KC = a.K;
  if (a.K * xk > 2 * XCHUNK_BYTES) {
    const int64_t most = std::max<int64_t>(QB, XCHUNK_BYTES / xk / QB * QB), chunks = (a.K + most - 1) / most;
    KC = ((a.K + chunks - 1) / chunks + QB - 1) / QB * QB;
  }
  std::unique_ptr<float[]> part(KC < a.K ? new float[a.T * a.N] : nullptr);
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t k0 = 0; k0 < a.K; k0 += KC) {
      const Span c{k0, std::min(KC, a.K - k0), part.get()};
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * NB, nn = std::min<int64_t>(NB, a.N - n0);
        // the rows that stream next: the next block's, or after the range's last block (in chunks
        // of K) the range's first block's next chunk, `ahead` bytes on
        int64_t pn = n0 + NB, ahead = 0;
        if (part && b + 1 == b1) {
          pn = k0 + KC < a.K ? b0 * NB : a.N;
          ahead = I4 ? KC / 2 : KC;
        }
        const uint8_t* pf[NB];
        for (int j = 0; j < NB; ++j) pf[j] = a.q + std::min<int64_t>(pn + j, a.N - 1) * a.ldq + ahead;
        tiles<I4, CH, OFF, NB, TB>(a, c, n0, nn, pn < a.N ? pf : nullptr);
      }
    }
  });
}


#include "quant_amx.h"

// tile shapes: one x row streams 4 weight rows side by side; 2-4 rows 4 weight rows (AVX-512; 2 on
// AVX2, whose 16 registers hold fewer accumulators); 5 and more rows 2 weight rows (1 on AVX2)
template <bool I4, bool CH, bool OFF>
static void dispatch(const Args& a) {
#if defined(__AVX512F__)
  constexpr int N1 = 4, N4 = 4, N8 = 2;
#else
  constexpr int N1 = 2, N4 = 1, N8 = 1;
#endif
#ifdef QT_AMX
  // fp32 x up to 8 rows (x's hi and lo columns fit the tile): int8 per channel by amx_run (bf16
  // holds its codes exactly, the scale goes on the sums); groups of K from GROUPS_FROM rows by
  // amx_groups (the codes without their scale, the scale on each group's sums; below, the FMA
  // tiles were faster); bf16 x up to 16 by amx_run (weights rounded to bf16 as the reference's)
  if (a.T >= 2 && amx_ok()) {
    if (!a.xbf16 && a.T <= 8 && CH) return amx_run<I4, CH, OFF>(a);
    if (!a.xbf16 && a.T <= 8 && a.T >= GROUPS_FROM) return amx_groups<I4, OFF>(a);
    if (a.xbf16 && a.T <= 16) return amx_run<I4, CH, OFF>(a);
  }
#endif
  switch (a.T) {
    case 1: run<I4, CH, OFF, N1, 1>(a); break;
    case 2: run<I4, CH, OFF, N4, 2>(a); break;
    case 3: run<I4, CH, OFF, N4, 3>(a); break;
    case 4: run<I4, CH, OFF, N4, 4>(a); break;
    default: run<I4, CH, OFF, N8, 8>(a); break;
  }
}

// v kept apart from the add after it (GCC fuses a * b + c into one FMA, one rounding where the
// reference has two)
static inline vw unfused(vw v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#else
  asm("" : "+x"(v));
#endif
  return v;
}

// A quantized weight's rows [n0, n0 + nn) dequantized into out (ld elements a row), in O: each
// code times its group's scale in fp32, plus its group's offset where there are offsets (null:
// none; rows of `ls` floats, as the scales'), rounded once to O (`reference.dequantize`'s values,
// bit for bit: the product rounded, then the sum)
template <class O>
static void deq_rows(const torch::Tensor& q, const torch::Tensor& scales, const float* offsets, const int64_t* ids,
                     int64_t n0, int64_t nn, O* out, int64_t ld) {
  const bool i4 = q.scalar_type() == at::kByte;
  const int64_t K = q.size(1) * (i4 ? 2 : 1), ls = scales.size(1), G = K / ls, RB = i4 ? QB / 2 : QB;
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const at::Half* sp = scales.data_ptr<at::Half>();
  at::parallel_for(0, nn, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = ids ? ids[i] : n0 + i;
      const uint8_t* row = qp + n * q.size(1);
      O* o = out + i * ld;
      for (int64_t r = 0; r < K / QB; ++r) {
        const int64_t g = n * ls + r * QB / G;
        vw w[NV];
        if (i4) deq<true>(row + r * RB, half_f(sp + g), -0.f, w);
        else deq<false>(row + r * RB, half_f(sp + g), -0.f, w);
        for (int v = 0; v < NV; ++v) wstore(o + r * QB + v * VW, offsets ? unfused(w[v]) + offsets[g] : w[v]);
      }
    }
  });
}

static int64_t features(const torch::Tensor& q) { return q.size(1) * (q.scalar_type() == at::kByte ? 2 : 1); }

static void check(const torch::Tensor& q, const torch::Tensor& scales, const char* what) {
  TORCH_CHECK(q.dim() == 2 && (q.scalar_type() == at::kChar || q.scalar_type() == at::kByte) && q.is_contiguous(),
              what, ": codes are contiguous int8 [N, K] or uint8 [N, K / 2]");
  const int64_t K = features(q);
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.size(0) == q.size(0) && scales.size(1) > 0 && K % scales.size(1) == 0 &&
                  (K / scales.size(1)) % QB == 0,
              what, ": scales are contiguous float16 [N, K / G], G a multiple of ", QB, " dividing K");
}

// Past max_rows() rows (prefill): blocks of weight rows dequantized into a buffer of x's dtype
// (about 1 MB, the extra memory bounded) and torch's GEMM on each; the bias joins in the GEMM
// (addmm), as F.linear adds it
static torch::Tensor gemm_blocks(const torch::Tensor& x, const torch::Tensor& q, const c10::optional<torch::Tensor>& bias,
                                 const torch::Tensor& scales, const float* offsets) {
  const int64_t N = q.size(0), K = features(q), es = x.element_size();
  const int64_t R = std::min<int64_t>(N, std::max<int64_t>(16, (int64_t(1) << 20) / (K * es) / 16 * 16));
  auto y = torch::empty({x.size(0), N}, x.options());
  auto buf = torch::empty({R, K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += R) {
    const int64_t nn = std::min(R, N - n0);
    if (x.scalar_type() == at::kFloat) deq_rows(q, scales, offsets, nullptr, n0, nn, buf.data_ptr<float>(), K);
    else deq_rows(q, scales, offsets, nullptr, n0, nn, buf.data_ptr<c10::BFloat16>(), K);
    const torch::Tensor w = buf.narrow(0, 0, nn).t();
    y.narrow(1, n0, nn).copy_(bias ? at::addmm(bias->narrow(0, n0, nn), x, w) : at::mm(x, w));
  }
  return y;
}

// rows up to which the kernel runs; torch's GEMM on dequantized blocks beyond: `lin`'s
int64_t quant_max_rows(bool bf16) {
#ifdef QT_AMX
  if (bf16 && amx_ok()) return 16;
#endif
  return lin::max_rows(bf16);
}

// F.linear(x, dequantize(q, scales, offsets), bias) for x [T, K] fp32 or bf16 (the result in x's dtype);
// offsets, where a GGUF file's affine types have them: float32 [N, K / G], added in the kernel
torch::Tensor linear(torch::Tensor x, const torch::Tensor& q, const c10::optional<torch::Tensor>& bias,
                     const torch::Tensor& scales, const c10::optional<torch::Tensor>& offsets) {
  check(q, scales, "quant linear");
  if (offsets) TORCH_CHECK(offsets->scalar_type() == at::kFloat && offsets->is_contiguous() &&
                               offsets->sizes() == scales.sizes(), "quant linear: offsets are contiguous float32 "
                           "[N, K / G], as the scales");
  const float* op = offsets ? offsets->data_ptr<float>() : nullptr;
  const int64_t K = features(q), N = q.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "quant linear: x [T, K] against codes of ", K, " features");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "quant linear: x float32 or bfloat16");
  if (bias) TORCH_CHECK(bias->numel() == N && bias->scalar_type() == x.scalar_type(), "quant linear: bias [N] in x's dtype");
  const int64_t T = x.size(0);
  if (T > quant_max_rows(x.scalar_type() == at::kBFloat16)) return gemm_blocks(x.contiguous(), q, bias, scales, op);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  torch::Tensor xf = bf16 ? x.to(at::kFloat).contiguous() : (x.stride(1) == 1 ? x : x.contiguous());
  torch::Tensor bf;
  if (bias) bf = bias->to(at::kFloat).contiguous();
  auto y = torch::empty({T, N}, x.options().dtype(at::kFloat));
  if (T == 0 || N == 0) return bf16 ? y.to(at::kBFloat16) : y;
  Args a{xf.data_ptr<float>(), xf.stride(0), T, static_cast<const uint8_t*>(q.data_ptr()), q.size(1),
         scales.data_ptr<at::Half>(), scales.size(1), K / scales.size(1), op, K, N,
         bias ? bf.data_ptr<float>() : nullptr, y.data_ptr<float>(), N, bf16};
  // one scale a row (G = K) goes on the sums (CH); offsets go on the weights, so a weight with
  // them takes the groups' path at G = K too
  const bool i4 = q.scalar_type() == at::kByte, ch = a.G == K && !op;
  if (i4) op ? dispatch<true, false, true>(a) : ch ? dispatch<true, true, false>(a) : dispatch<true, false, false>(a);
  else op ? dispatch<false, false, true>(a) : ch ? dispatch<false, true, false>(a) : dispatch<false, false, false>(a);
  return bf16 ? y.to(at::kBFloat16) : y;
}

// the rows `ids` of a quantized embedding, dequantized in `dtype` (`reference.rows`)
torch::Tensor rows(const torch::Tensor& q, const torch::Tensor& ids, const torch::Tensor& scales, at::ScalarType dtype) {
  check(q, scales, "quant rows");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant rows: float32 or bfloat16");
  const torch::Tensor idx = ids.to(at::kLong).contiguous();
  const int64_t T = idx.numel(), K = features(q);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < T; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < q.size(0), "quant rows: id ", ip[i], " out of range");
  auto out = torch::empty({T, K}, q.options().dtype(dtype));
  if (dtype == at::kFloat) deq_rows(q, scales, nullptr, ip, 0, T, out.data_ptr<float>(), K);
  else deq_rows(q, scales, nullptr, ip, 0, T, out.data_ptr<c10::BFloat16>(), K);
  return out;
}

torch::Tensor quant_rows(torch::Tensor q, torch::Tensor ids, torch::Tensor scales, bool bf16) {
  return rows(q, ids, scales, bf16 ? at::kBFloat16 : at::kFloat);
}

}  // namespace qt
