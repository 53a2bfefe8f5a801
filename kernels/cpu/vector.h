// What the CPU kernels share: the vector type every loop runs on, `vw`, one register of the widest
// set the CPU has (16 fp32 lanes with AVX-512, 8 with AVX2), its fp32/bf16 loads and stores (and fp16 loads), bf16
// rounding, the horizontal sum and exp, and `amd_layout()`.
// Decisions: GCC vector types, not `#pragma omp simd` (under it the compiler left exp, RoPE and the
// argmax scalar); never a vector wider than a register (the matmul tiles' accumulators must all
// fit in the register file, and on AVX2 GCC lowers a wider vector's comparisons, selects and
// conversions one lane at a time).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// `vw`: one register of the widest vector set the CPU has. AVX-512 has 32 registers of 16 lanes;
// AVX2 has 16 of 8. Every kernel computes on it, never on a vector wider than a register: GCC
// splits arithmetic on a too-wide vector into register halves, but it lowers comparisons,
// selects and int<->float conversions on one lane at a time (on AVX2, a 16-lane exp made SiLU
// and the greedy pick several times slower)
#if defined(__AVX512F__)
typedef float vw __attribute__((vector_size(64)));
#else
typedef v8 vw;
#endif
constexpr int VW = int(sizeof(vw) / sizeof(float));
typedef int32_t iw __attribute__((vector_size(VW * 4)));
typedef uint16_t u16w __attribute__((vector_size(VW * 2)));
typedef uint32_t u32w __attribute__((vector_size(VW * 4)));

// bf16 <-> fp32: a bf16 is the top half of the fp32 with the same bits
static inline vw bf16_widen(const c10::BFloat16* p) {
  u16w h; std::memcpy(&h, p, sizeof h);
  const u32w u = __builtin_convertvector(h, u32w) << 16;
  vw v; std::memcpy(&v, &u, sizeof v); return v;
}
// each lane's bits rounded to the nearest even bf16 (the low half zero; NaN stays NaN)
static inline u32w bf16_round_bits(vw v) {
  u32w u; std::memcpy(&u, &v, sizeof u);
  const u32w r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  const u32w keep = (u32w)(v == v);
  return (r & keep) | ((u | 0x00400000u) & ~keep);
}

static inline vw wload(const float* p) { vw v; std::memcpy(&v, p, sizeof v); return v; }
static inline vw wload(const c10::BFloat16* p) { return bf16_widen(p); }
static inline vw wload(const c10::Half* p) {  // F16C (every AVX2 CPU has it)
#if defined(__AVX512F__)
  return (vw)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  return (vw)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
}
// each lane as the dtype holds it: identity in fp32; in bf16 rounded to nearest even
static inline vw wround(vw v, float) { return v; }
static inline vw wround(vw v, c10::BFloat16) {
  const u32w out = bf16_round_bits(v);
  vw o; std::memcpy(&o, &out, sizeof o); return o;
}
static inline void wstore(float* p, vw v) { std::memcpy(p, &v, sizeof v); }
static inline void wstore(c10::BFloat16* p, vw v) {
  const u16w h = __builtin_convertvector(bf16_round_bits(v) >> 16, u16w);
  std::memcpy(p, &h, sizeof h);
}
static inline float hsum(v8 a) {
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
#if defined(__AVX512F__)
static inline float hsum(vw v) {
  return hsum(v8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)));
}
#endif
// exp(x) on every lane, x clamped to [-87, 88]: 2^(x log2 e) split into 2^i * 2^f, 2^f by a
// degree-6 polynomial on [0, 1) (relative error < 2e-7, under fp32 rounding of the sum)
static inline vw wexp(vw x) {
  const vw lo = vw{} - 87.f, hi = vw{} + 88.f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vw t = x * 1.44269504088896341f;
  iw ti = __builtin_convertvector(t, iw);               // toward zero
  ti += (iw)(__builtin_convertvector(ti, vw) > t);      // -1 where that was above t: floor
  const vw f = t - __builtin_convertvector(ti, vw);
  vw p = vw{} + 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const iw bits = (ti + 127) << 23;
  vw scale; std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
// the same for one value (loop tails, softmax rows)
static inline float exp1(float x) { return wexp(vw{} + x)[0]; }
// each lane's index: 0, 1, ..., VW - 1 (masks of the first n lanes, argmax indices)
static inline iw lane_ids() {
  iw v;
  for (int j = 0; j < VW; ++j) v[j] = j;
  return v;
}

// AMD's layout (the build's variant, `kernels/cpu_module.py`; LF_AMD_LAYOUT): with AVX-512 (Zen 4)
// its hardware prefetcher streams one weight row at a time best, where Intel's keeps up with
// several side by side (`linear_cpu`, `lora_cpu`), fp32 weights go in panels (`panels_cpu`) and
// torch's fp32 GEMM is oneDNN's. A compile-time choice, not the CPU's vendor read at run time, so
// that every layout can be built and tested on any CPU that runs its instructions
#ifndef LF_AMD_LAYOUT
#error "LF_AMD_LAYOUT (0 or 1) is set by the variant's flags (kernels/cpu_module.py)"
#endif
constexpr bool amd_layout() { return LF_AMD_LAYOUT != 0; }

// A chunk of K's sum for one output (the matmuls that go by chunks of K): `v`, this chunk's sum,
// plus the chunks before it (kept in `part`); true at the last chunk (v is then the whole sum),
// false before it (v kept in `part` until then)
static inline bool chunk_sum(float& v, float& part, int64_t k0, int64_t len, int64_t K) {
  if (k0 > 0) v += part;
  if (k0 + len < K) {
    part = v;
    return false;
  }
  return true;
}
