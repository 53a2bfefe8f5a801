// The decode matmul on weights [N, K] (kernels/linear_cpu.py), in the namespace `lin` of the one extension (kernels/cpu/lorafleet_cpu.cpp).
#include "vector.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <sys/syscall.h>
#include <unistd.h>

namespace qt {  // kernels/cpu/quant.cpp, after this file: the matmul on quantized weights
torch::Tensor linear(torch::Tensor x, const torch::Tensor& q, const c10::optional<torch::Tensor>& bias,
                     const torch::Tensor& scales, const c10::optional<torch::Tensor>& offsets);
}

namespace lin {

#if defined(__AVX512BF16__)
// bf16 x bf16 on CPUs that have VDPBF16PS: each instruction multiplies 32 bf16 pairs exactly and
// adds them pairwise into 16 fp32 sums, so no widening and half the instructions of fp32 FMAs
// (widened bf16 made the kernel compute-bound from a few rows on; widened with x widened once
// per call, as without VDPBF16PS, it was slower at every row count measured on Intel)
template <int NB, int TB>
static inline void tile_dpbf16(const c10::BFloat16* const* w, const c10::BFloat16* const* x, int64_t K,
                               float (*out)[TB], const c10::BFloat16* const* pf) {
  __m512 acc[NB][TB];
  for (int j = 0; j < NB; ++j)
    for (int t = 0; t < TB; ++t) acc[j][t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (pf)
      for (int j = 0; j < NB; ++j) __builtin_prefetch(pf[j] + k, 0, 3);
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w[j] + k);
    for (int t = 0; t < TB; ++t) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[t] + k);
      for (int j = 0; j < NB; ++j) acc[j][t] = _mm512_dpbf16_ps(acc[j][t], wv[j], xv);
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int t = 0; t < TB; ++t) {
      float s = _mm512_reduce_add_ps(acc[j][t]);
      for (int64_t d = k; d < K; ++d) s += float(w[j][d]) * float(x[t][d]);
      out[j][t] = s;
    }
}
#endif

// The tile's x rows: bf16 x is widened to fp32 once per call where the CPU lacks VDPBF16PS, not
// once per weight row in the tile (that made bf16 at 8 rows compute-bound on AVX2, slower than
// fp32's twice the bytes)
template <class S> struct XOf { using type = S; };
#if !defined(__AVX512BF16__)
template <> struct XOf<c10::BFloat16> { using type = float; };
#endif
template <class S> using X = typename XOf<S>::type;

// The next block's rows are asked for non-temporal (prefetchnta) on AVX2: faster than prefetcht0
// there (AMD, weights on huge pages; bf16 about even). Untried with AVX-512: its hint stays the
// one measured there
#if defined(__AVX512F__)
#define PF_HINT 3
#else
#define PF_HINT 0
#endif

// out[j][t] = w[j] . x[t] over K, for NB weight rows and TB x rows; with `pf`, the rows of the
// next block are prefetched as these stream by (one cache line of each per 64 bytes read here)
template <class S, int NB, int TB, int HINT = PF_HINT>
static inline void tile(const S* const* w, const X<S>* const* x, int64_t K, float (*out)[TB], const S* const* pf) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    tile_dpbf16<NB, TB>(w, x, K, out, pf);
    return;
  }
#endif
  constexpr int LINE = 64 / int(sizeof(S));  // elements per cache line
  vw acc[NB][TB];
  for (int j = 0; j < NB; ++j)
    for (int t = 0; t < TB; ++t) acc[j][t] = vw{};
  int64_t k = 0;
  for (; k + VW <= K; k += VW) {
    vw wv[NB];
    if (pf && k % LINE == 0)
      for (int j = 0; j < NB; ++j) __builtin_prefetch(pf[j] + k, 0, HINT);
    for (int j = 0; j < NB; ++j) wv[j] = wload(w[j] + k);
    for (int t = 0; t < TB; ++t) {
      const vw xv = wload(x[t] + k);
      for (int j = 0; j < NB; ++j) acc[j][t] += wv[j] * xv;
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int t = 0; t < TB; ++t) {
      float s = hsum(acc[j][t]);
      for (int64_t d = k; d < K; ++d) s += float(w[j][d]) * float(x[t][d]);
      out[j][t] = s;
    }
}

struct Args {
  const void* x; int64_t ldx; int64_t T;
  const void* w; int64_t K; int64_t N;
  const void* bias;
  void* y; int64_t ldy;
};

// The span of K a pass of `run` covers: all of it, or one chunk of it where the x rows are too
// wide to stay in L1 beside the weight stream; then `part` holds each output's fp32 sum over the
// chunks before (T x N, row-major), and the last chunk adds the bias and stores y
struct Span { int64_t k0, len; float* part; };

// rows [t0, t0 + R) against weight rows [n0, n0 + nn), over the span c of K; pointers past the
// end repeat the last row (computed, never stored), so a tile always has its full shape. PF:
// prefetch, as the first tile runs, the same span of the weight rows [pn, pn + NB) (pn < 0: none).
// R, the rows that are real, is a template argument like the tile's shape: with R a runtime
// count, a partial tile ran markedly slower than the full one, the same FMAs on the same data
template <class S, int NB, int TB, bool PF, int R>
static void block(const Args& a, const Span& c, int64_t t0, int64_t n0, int64_t nn, int64_t pn, int64_t pk) {
  constexpr int64_t tb = R;
  const X<S>* xp = static_cast<const X<S>*>(a.x);
  const S* wp = static_cast<const S*>(a.w);
  const S* bp = static_cast<const S*>(a.bias);
  S* yp = static_cast<S*>(a.y);
  const S* w[NB];
  const X<S>* x[TB];
  for (int j = 0; j < NB; ++j) w[j] = wp + (n0 + std::min<int64_t>(j, nn - 1)) * a.K + c.k0;
  for (int t = 0; t < TB; ++t) x[t] = xp + (t0 + std::min<int64_t>(t, tb - 1)) * a.ldx + c.k0;
  // the first tile of a block reads its rows from memory: it prefetches the next block's
  // (the hardware prefetcher alone leaves memory idle while the FMAs run: measured slower
  // without it)
  const S* pf[NB];
  for (int j = 0; j < NB; ++j) pf[j] = wp + std::min<int64_t>(pn + j, a.N - 1) * a.K + pk;
  float out[NB][TB];
  tile<S, NB, TB>(w, x, c.len, out, PF && t0 == 0 && pn >= 0 ? pf : nullptr);
  for (int t = 0; t < tb; ++t)
    for (int j = 0; j < nn; ++j) {
      float v = out[j][t];
      if (c.part && !chunk_sum(v, c.part[(t0 + t) * a.N + n0 + j], c.k0, c.len, a.K)) continue;
      yp[(t0 + t) * a.ldy + n0 + j] = S(v + (bp ? float(bp[n0 + j]) : 0.f));
    }
}

// the last tile's rows: R counts down to `rest`, so that `block` gets it as a constant
template <class S, int NB, int TB, bool PF, int R = TB>
static void rest_block(const Args& a, const Span& c, int64_t t0, int64_t rest, int64_t n0, int64_t nn, int64_t pn,
                       int64_t pk) {
  if constexpr (R > TB / 2 + 1) {  // rest_rows sends fewer rows to a tile of half the height
    if (rest < R) { rest_block<S, NB, TB, PF, R - 1>(a, c, t0, rest, n0, nn, pn, pk); return; }
  }
  block<S, NB, TB, PF, R>(a, c, t0, n0, nn, pn, pk);
}

template <class S, int NB, int TB, bool PF>
static void rest_rows(const Args& a, const Span& c, int64_t t0, int64_t n0, int64_t nn, int64_t pn, int64_t pk) {
  // rows left after the full tiles: one tile of the smallest shape that holds them
  const int64_t rest = a.T - t0;
  if constexpr (TB > 1) {
    if (rest <= TB / 2) { rest_rows<S, NB, TB / 2, PF>(a, c, t0, n0, nn, pn, pk); return; }
  }
  rest_block<S, NB, TB, PF>(a, c, t0, rest, n0, nn, pn, pk);
}

template <class S, int NB, int TB, bool PF>
static void tiles(const Args& a, const Span& c, int64_t n0, int64_t nn, int64_t pn, int64_t pk) {
  int64_t t0 = 0;
  for (; t0 + TB <= a.T; t0 += TB) block<S, NB, TB, PF, TB>(a, c, t0, n0, nn, pn, pk);
  if (t0 < a.T) rest_rows<S, NB, TB, PF>(a, c, t0, n0, nn, pn, pk);
}

// With AVX-512, x rows (one tile's: T <= TB) of more than XCHUNK_FROM bytes go by chunks of K of
// at most XCHUNK_BYTES of x: each thread runs all its blocks over one chunk, then over the next,
// so that the chunk of x stays in L1 while the weights stream by, and the next block's piece of
// the same chunk is prefetched (after its last block, the range's first block's next chunk).
// 8 rows of `tiny`'s and `smol`'s down projection (1,536 wide: 48 KB of x, all of L1) had every x
// vector come from L2 for each weight vector; chunked, faster on Intel at 6-8 rows, in the
// matmuls and in whole decode steps. Tried: larger chunks (less gain), smaller ones cutting
// narrower weights too (slower: rows read in short pieces stream worse than whole, hence
// XCHUNK_FROM); not kept. Tried: summing a tile's accumulators by a transposing shuffle tree;
// no faster, not kept. AVX2 keeps `run_kchunks` below, measured on its host
constexpr int64_t XCHUNK_FROM = 32 * 1024, XCHUNK_BYTES = 16 * 1024;

template <class S, int NB, int TB, bool PF = true>
static void run(const Args& a) {
  const int64_t blocks = (a.N + NB - 1) / NB;
  int64_t KC = a.K;  // the chunk of K
#if defined(__AVX512F__)
  const int64_t xk = a.T * int64_t(sizeof(X<S>));  // bytes of x per k
  if (a.T <= TB && a.K * xk > XCHUNK_FROM) {
    const int64_t most = std::max<int64_t>(32, XCHUNK_BYTES / xk / 32 * 32), chunks = (a.K + most - 1) / most;
    KC = ((a.K + chunks - 1) / chunks + 31) / 32 * 32;  // even chunks, whole vectors (32 bf16 for VDPBF16PS)
  }
#endif
  std::unique_ptr<float[]> part(KC < a.K ? new float[a.T * a.N] : nullptr);
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t k0 = 0; k0 < a.K; k0 += KC) {
      const Span c{k0, std::min(KC, a.K - k0), part.get()};
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * NB;
        int64_t pn = n0 + NB, pk = k0;  // the weight rows that stream next
        if (part && b + 1 == b1) {  // this range's first block, in the next chunk
          pn = k0 + KC < a.K ? b0 * NB : -1;
          pk = k0 + KC;
        }
        tiles<S, NB, TB, PF>(a, c, n0, std::min<int64_t>(NB, a.N - n0), pn < a.N ? pn : -1, pk);
      }
    }
  });
}

// x rows wider than L1 keeps beside the weight stream (8 fp32 rows of a 1,536-wide input, `tiny`'s
// and `smol`'s down projection: 48 KB): a tile reloads every x vector from L2 for each weight
// vector (the down projection streamed well below the other shapes' rate). Here K goes
// in chunks of KC, each chunk of the x rows (16 KB) against a group of G weight rows, so that it
// stays in L1 while the rows' pieces go by; sums are kept per chunk and added up. The pieces of a
// group are not contiguous, so the next group's rows (which are) are asked for a piece's worth
// at a time while this group's are computed, with prefetcht0 (non-temporal lines were gone again
// before their turn: no faster than (2, 4)). Faster than the tiles on AVX2 (AMD, weights on huge
// pages), the more the wider the rows (a Llama-2-7B down projection's width most); whole `tiny`
// decode steps within the noise. Below KCHUNK_BYTES of x no gain: slower in whole decode steps
constexpr int64_t KCHUNK_BYTES = 40 * 1024;  // x rows past this go by chunks of K

template <class S, int TB, int R>
static void run_kchunks(const Args& a) {
  constexpr int G = 8;
  constexpr int64_t KC = 16 * 1024 / (TB * int64_t(sizeof(X<S>)));
  const X<S>* xp = static_cast<const X<S>*>(a.x);
  const S* wp = static_cast<const S*>(a.w);
  const S* bp = static_cast<const S*>(a.bias);
  S* yp = static_cast<S*>(a.y);
  at::parallel_for(0, (a.N + G - 1) / G, 1, [&](int64_t g0, int64_t g1) {
    float part[G][TB];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * G, nn = std::min<int64_t>(G, a.N - n0);
      // the next group's rows (contiguous) are asked for a piece's worth at a time, spread over
      // this group's pieces, so memory streams while every piece here comes from cache
      const S* next = g + 1 < g1 ? wp + (n0 + G) * a.K : nullptr;
      const int64_t next_len = next ? std::min<int64_t>(G, a.N - n0 - G) * a.K : 0;
      for (int64_t j = 0; j < nn; ++j)
        for (int t = 0; t < TB; ++t) part[j][t] = 0.f;
      int64_t piece = 0;
      for (int64_t kc = 0; kc < a.K; kc += KC) {
        const int64_t len = std::min(KC, a.K - kc);
        const X<S>* x[TB];
        for (int t = 0; t < TB; ++t) x[t] = xp + std::min(t, R - 1) * a.ldx + kc;
        for (int64_t j = 0; j < nn; ++j, ++piece) {
          const S* w[1] = {wp + (n0 + j) * a.K + kc};
          const int64_t off = piece * KC;
          const S* pf[1] = {next ? next + off : nullptr};
          float out[1][TB];
          tile<S, 1, TB, 3>(w, x, len, out, off + len <= next_len ? pf : nullptr);
          for (int t = 0; t < TB; ++t) part[j][t] += out[0][t];
        }
      }
      for (int t = 0; t < R; ++t)
        for (int64_t j = 0; j < nn; ++j)
          yp[t * a.ldy + n0 + j] = S(part[j][t] + (bp ? float(bp[n0 + j]) : 0.f));
    }
  });
}

template <class S>
static void kchunks(const Args& a) {
  switch (a.T) {
    case 2: run_kchunks<S, 4, 2>(a); break;
    case 3: run_kchunks<S, 4, 3>(a); break;
    case 4: run_kchunks<S, 4, 4>(a); break;
    case 5: run_kchunks<S, 8, 5>(a); break;
    case 6: run_kchunks<S, 8, 6>(a); break;
    case 7: run_kchunks<S, 8, 7>(a); break;
    case 8: run_kchunks<S, 8, 8>(a); break;
    default: TORCH_CHECK(false, "linear: K chunks take 2-8 rows");
  }
}

template <class S>
static void dispatch(const Args& a) {
#if defined(__AVX512F__)
  // one row on an AMD CPU with AVX-512: one weight row at a time, no software prefetch, one
  // sequential stream (there faster than the (6, 4) tile in fp32 and bf16, at the rate a plain
  // sum reads, and than (2, 1) to (16, 1)). Intel keeps the tile measured there
  if (a.T == 1 && amd_layout()) run<S, 1, 1, false>(a);
  else if (a.T <= 4) run<S, 6, 4>(a);
  else run<S, 3, 8>(a);
#else
  // AVX2 (each the best of the shapes measured on AMD): one fp32 row streams 8 weight rows side
  // by side with no prefetch (faster than (6, 1) with its prefetch; bf16, compute-bound by the
  // widening, ran slower so); from 2 rows on one weight row at a time against 4 or 8 x rows, as
  // it streams from memory ((6, 4), six weight rows side by side, was slower at 2-4 rows,
  // weights on huge pages)
  if (a.T == 1 && std::is_same_v<S, float>) run<S, 8, 1, false>(a);
  // x rows past KCHUNK_BYTES would leave L1 to the weight stream: K in chunks (`run_kchunks`)
  else if (a.T >= 2 && a.T <= 8 && a.T * a.K * int64_t(sizeof(X<S>)) > KCHUNK_BYTES) kchunks<S>(a);
  else if (a.T <= 4) run<S, 1, 4>(a);
  else if (a.T <= 8) run<S, 1, 8>(a);
  else run<S, 2, 4>(a);                // compute-bound: 6 loads per 8 FMAs instead of 9
#endif
}

// more rows than this: torch's GEMM (`linear` in Python), from where it overtakes the kernel. With
// AVX-512 (measured on Intel): 24. But fp32 on an AMD CPU with AVX-512, where torch's GEMM (MKL)
// is slow at 16-64 rows: 64 (beyond, the kernel is no faster; in bf16 torch's (oneDNN) GEMM
// overtakes it past 24 rows, so bf16 keeps 24). With AVX2: 64, the (2, 4) tiles faster than
// torch's GEMM up to there; past that the x rows outgrow L2.
// bf16 where the CPU has AMX: torch's bf16 GEMM (oneDNN) runs on its tiles, and takes over from
// 13 rows, where it overtook the kernel on Intel (with oneDNN held to AVX512-BF16,
// ONEDNN_MAX_CPU_ISA, it stayed slower than the kernel)
// (where the kernel lets this process use the AMX state at all: Linux 5.16 and later grant it on
// request, as oneDNN asks for it before it uses the tiles; elsewhere torch's bf16 GEMM has none)
int64_t max_rows(bool bf16) {
  (void)bf16;  // unread in a build with neither AMX nor AVX-512
#if defined(__AMX_BF16__)
  static const bool amx = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  if (bf16 && amx) return 12;
#endif
#if defined(__AVX512F__)
  return !bf16 && amd_layout() ? 64 : 24;
#else
  return 64;
#endif
}

// Past max_rows() rows in fp32 on an AMD CPU: oneDNN's GEMM, through the op torch registers for
// it (mkldnn::_linear_pointwise, which Inductor's CPU fusions call), instead of at::linear's MKL
// (faster there: the module doc); at::linear where the op is missing (torch built without oneDNN)
static torch::Tensor gemm(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  if (!op || x.scalar_type() != at::kFloat || !amd_layout()) return at::linear(x, w, bias);
  torch::jit::Stack stack{x.contiguous(), w.contiguous(), bias, std::string("none"),
                          c10::List<c10::optional<at::Scalar>>(), c10::optional<std::string>()};
  op->callBoxed(&stack);
  return stack.back().toTensor();
}

// F.linear(x, w, bias): the kernel on packed panels (`pn::linear_packed`), on w [N, K] up to
// max_rows() rows and `gemm` beyond (prefill); with `scales`, w is a quantized weight's codes, with
// `offsets` its group offsets where it has them (`qt::linear`); here so that every caller (the
// Python wrapper, the decode-layers driver) takes the same path
torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                     c10::optional<torch::Tensor> scales, c10::optional<torch::Tensor> offsets) {
  if (scales) return qt::linear(x, w, bias, *scales, offsets);
  TORCH_CHECK(!offsets, "linear: offsets come with a quantized weight's scales");
  if (w.dim() == 3) return pn::linear_packed(x, w, bias);  // packed panels (`panels_cpu`)
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear: x [T, K] and w [N, K]");
  if (x.size(0) > max_rows(x.scalar_type() == at::kBFloat16)) return gemm(x, w, bias);
  if (x.stride(1) != 1) x = x.contiguous();
  TORCH_CHECK(w.is_contiguous(), "linear: w must be contiguous");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "linear: x and w differ in dtype");
  if (bias) TORCH_CHECK(bias->scalar_type() == w.scalar_type() && bias->is_contiguous() &&
                        bias->numel() == w.size(0), "linear: bias");
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  Args a{x.data_ptr(), x.stride(0), x.size(0), w.data_ptr(), w.size(1), w.size(0),
         bias ? bias->data_ptr() : nullptr, y.data_ptr(), y.stride(0)};
  if (a.T == 0 || a.N == 0) return y;
  if (x.scalar_type() == at::kFloat) dispatch<float>(a);
  else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear: float32 or bfloat16 only");
    torch::Tensor xf;  // x in fp32, where the tile takes it so (X<S>): kept alive through the call
    if constexpr (!std::is_same_v<X<c10::BFloat16>, c10::BFloat16>) {
      xf = x.to(at::kFloat);
      a.x = xf.data_ptr();
      a.ldx = xf.stride(0);
    }
    dispatch<c10::BFloat16>(a);
  }
  return y;
}

}  // namespace lin
