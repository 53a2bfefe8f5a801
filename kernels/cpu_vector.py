"""C++ shared by the CPU kernels (`linear_cpu`, `pointwise_cpu`, `paged_attention_cpu`, `lora_cpu`), pasted
at the top of each kernel's source: one definition of the 16-lane vector types, their loads and
stores from fp32 and bf16, bf16 rounding, the horizontal sum and exp.

The loops are written with GCC vector types rather than left to `#pragma omp simd`: the
compiler left SiLU's exp, RoPE and the argmax scalar under it (a scalar exp took 3 ns an
element). `v16` is 16 fp32 lanes: one AVX-512 register, two AVX2 halves elsewhere. `vw` is one
register of either set (16 lanes or 8): the type of the matmul tiles (`linear_cpu`, `lora_cpu`),
whose accumulators must all fit in the register file.
"""

SOURCE = r"""
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstdint>
#include <cstring>

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

// bf16 <-> fp32 on any lane count (U16, U32: the unsigned vectors of V's lanes), for v16 and vw:
// a bf16 is the top half of the fp32 with the same bits
template <class V, class U32, class U16>
static inline V bf16_widen(const c10::BFloat16* p) {
  U16 h; std::memcpy(&h, p, sizeof h);
  const U32 u = __builtin_convertvector(h, U32) << 16;
  V v; std::memcpy(&v, &u, sizeof v); return v;
}
// each lane's bits rounded to the nearest even bf16 (the low half zero; NaN stays NaN)
template <class U32, class V>
static inline U32 bf16_round_bits(V v) {
  U32 u; std::memcpy(&u, &v, sizeof u);
  const U32 r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  const U32 keep = (U32)(v == v);
  return (r & keep) | ((u | 0x00400000u) & ~keep);
}
template <class U16, class U32, class V>
static inline void bf16_store(c10::BFloat16* p, V v) {
  const U16 h = __builtin_convertvector(bf16_round_bits<U32>(v) >> 16, U16);
  std::memcpy(p, &h, sizeof h);
}

static inline v16 vload(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
static inline v16 vload(const c10::BFloat16* p) { return bf16_widen<v16, u32x16, u16x16>(p); }
// each lane as the dtype holds it: identity in fp32; in bf16 rounded to nearest even (NaN stays NaN)
static inline v16 vround(v16 v, float) { return v; }
static inline v16 vround(v16 v, c10::BFloat16) {
  const u32x16 out = bf16_round_bits<u32x16>(v);
  v16 o; std::memcpy(&o, &out, sizeof o); return o;
}
static inline void vstore(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
static inline void vstore(c10::BFloat16* p, v16 v) { bf16_store<u16x16, u32x16>(p, v); }
static inline float hsum(v8 a) {
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
static inline float hsum(v16 v) {
  return hsum(v8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)));
}
// exp(x) on 16 lanes, x clamped to [-87, 88]: 2^(x log2 e) split into 2^i * 2^f, 2^f by a
// degree-6 polynomial on [0, 1) (relative error < 2e-7, under fp32 rounding of the sum)
static inline v16 vexp(v16 x) {
  const v16 lo = v16{} - 87.f, hi = v16{} + 88.f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const v16 t = x * 1.44269504088896341f;
  i16v ti = __builtin_convertvector(t, i16v);           // toward zero
  ti += (i16v)(__builtin_convertvector(ti, v16) > t);   // -1 where that was above t: floor
  const v16 f = t - __builtin_convertvector(ti, v16);
  v16 p = v16{} + 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const i16v bits = (ti + 127) << 23;
  v16 scale; std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
// the same for one value (loop tails, softmax rows)
static inline float exp1(float x) { return vexp(v16{} + x)[0]; }

// `vw`: one register of the widest vector set the CPU has, for the tiles of the matmul kernels
// (`linear_cpu`, `lora_cpu`), whose many accumulators must all stay in registers. AVX-512 has
// 32 registers of 16 lanes (vw is v16); AVX2 has 16 of 8 lanes (vw is v8), where a v16 takes two
// registers and tiles of v16 spilled to the stack (8 rows of a decode matmul read the weights at
// 2 GB/s, a third of torch's GEMM, on an AMD EPYC without AVX-512)
#if defined(__AVX512F__)
typedef v16 vw;
constexpr int VW = 16;
#else
typedef v8 vw;
constexpr int VW = 8;
#endif
typedef uint16_t u16w __attribute__((vector_size(VW * 2)));
typedef uint32_t u32w __attribute__((vector_size(VW * 4)));
static inline vw wload(const float* p) { vw v; std::memcpy(&v, p, sizeof v); return v; }
static inline vw wload(const c10::BFloat16* p) { return bf16_widen<vw, u32w, u16w>(p); }
static inline void wstore(float* p, vw v) { std::memcpy(p, &v, sizeof v); }
static inline void wstore(c10::BFloat16* p, vw v) { bf16_store<u16w, u32w>(p, v); }
"""
