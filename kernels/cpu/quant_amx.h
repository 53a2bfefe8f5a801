// The AMX-BF16 paths of the quantized matmul (kernels/quant_cpu.py's doc): 2 and more x rows on
// tiles where the CPU has them. Included by quant.cpp inside namespace qt, after the FMA tiles
// and before `dispatch`, which picks between them.
#pragma once
#ifdef QT_AMX
}  // namespace qt
#include <sys/syscall.h>
#include <unistd.h>
namespace qt {

// the permission the kernel needs to use AMX's tile data (asked once per process)
static bool amx_ok() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}
struct alignas(64) TileCfg { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

static inline uint32_t bf16_bits(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
static inline float bf16_float(uint32_t h) { const uint32_t u = h << 16; float f; std::memcpy(&f, &u, 4); return f; }

// one run of 32 codes as 32 bf16 weights (d * code + o, int4 d * (code - 8) + o, rounded to bf16 from fp32)
template <bool I4> static inline void deq_bf16(const uint8_t* p, float d, float o, uint16_t* out) {
  vw w[2];
  deq<I4>(p, d, o, w);
  _mm512_store_si512(out, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]));
}

// y = x W^T on the AMX tiles for int8 per channel with fp32 x (its codes exact in bf16, the scale on
// the sums) and every scheme with bf16 x (weights d * code (+ offset) rounded to bf16, the
// reference's): A = 16 weight rows x 32 K dequantized a few runs at a time into a double buffer,
// B = x^T in VNNI pairs (fp32 x: hi and lo columns), two blocks of 16 rows a task, C over all of K
template <bool I4, bool CH, bool OFF>
static void amx_run(const Args& a) {
  constexpr int64_t RB = I4 ? QB / 2 : QB;
  const int64_t T = a.T, K = a.K, N = a.N, P = K / 2;
  const bool split = !a.xbf16;  // fp32 x as bf16 hi + lo columns side by side (up to 8 rows: 16 columns)
  const int64_t C = split ? 2 * T : T;  // B's columns: x rows (and their low halves)
  // x^T in VNNI pairs: xb[p * C + c] holds x[c][2p] low, x[c][2p + 1] high (column T + t: x[t] - bf16(x[t]))
  std::unique_ptr<uint32_t[]> xb(new uint32_t[P * C + 16]);
  at::parallel_for(0, P, 1024, [&](int64_t p0, int64_t p1) {
    for (int64_t t = 0; t < T; ++t) {
      const float* xr = a.x + t * a.ldx;
      for (int64_t p = p0; p < p1; ++p) {
        const float x0 = xr[2 * p], x1 = xr[2 * p + 1];
        const uint32_t h0 = bf16_bits(x0), h1 = bf16_bits(x1);
        xb[p * C + t] = h0 | (h1 << 16);
        if (split) xb[p * C + T + t] = bf16_bits(x0 - bf16_float(h0)) | (bf16_bits(x1 - bf16_float(h1)) << 16);
      }
    }
  });
  const int64_t runs = K / QB, bpg = a.G / QB;
  const int64_t blocks = (N + 31) / 32;  // 2 tiles of 16 weight rows
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    TileCfg cfg{};
    cfg.palette = 1;
    for (int i = 0; i < 2; ++i) { cfg.rows[i] = 16; cfg.colsb[i] = uint16_t(4 * C); }  // C: 16 x C fp32
    for (int i : {2, 3}) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }                    // A: 16 rows x 32 bf16
    cfg.rows[4] = 16; cfg.colsb[4] = uint16_t(4 * C);                                 // B: 16 pairs x C
    _tile_loadconfig(&cfg);
    std::unique_ptr<uint16_t[], void (*)(void*)> buf(
        static_cast<uint16_t*>(std::aligned_alloc(64, 2 * 2 * SEGRUNS * 16 * QB * 2)), std::free);
    int64_t flip = 0;
    alignas(64) float out[2][16][16];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * 32;
      const uint8_t* q[32];
      const at::Half* s[32];
      const float* os[32];
      const uint8_t* pf[32];
      for (int j = 0; j < 32; ++j) {
        const int64_t n = std::min<int64_t>(n0 + j, N - 1);
        q[j] = a.q + n * a.ldq;
        s[j] = a.s + n * a.ls;
        os[j] = OFF ? a.o + n * a.ls : nullptr;
        pf[j] = a.q + std::min<int64_t>(n0 + 32 + j, N - 1) * a.ldq;
      }
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t r0 = 0; r0 < runs; r0 += SEGRUNS) {
        const int64_t nr = std::min(SEGRUNS, runs - r0);
        uint16_t* const bb = buf.get() + (flip ^= 1) * 2 * SEGRUNS * 16 * QB;  // [2 tiles][SEGRUNS][16][32]
        const int64_t g0 = r0 / bpg, in0 = r0 % bpg;
        for (int j = 0; j < 32; ++j) {
          for (int64_t l = r0 * RB; l < (r0 + nr) * RB; l += 64) __builtin_prefetch(pf[j] + l, 0, 3);
          uint16_t* o = bb + (j / 16) * SEGRUNS * 16 * QB + (j % 16) * QB;
          const uint8_t* qj = q[j] + r0 * RB;
          if (CH) {
            for (int64_t r = 0; r < nr; ++r) deq_bf16<I4>(qj + r * RB, 1.f, -0.f, o + r * 16 * QB);
          } else if (bpg == 1) {
            const at::Half* sj = s[j] + r0;
            for (int64_t r = 0; r < nr; ++r)
              deq_bf16<I4>(qj + r * RB, half_f(sj + r), OFF ? os[j][r0 + r] : -0.f, o + r * 16 * QB);
          } else {
            int64_t gi = g0, in = in0;
            for (int64_t r = 0; r < nr; ++r) {
              deq_bf16<I4>(qj + r * RB, half_f(s[j] + gi), OFF ? os[j][gi] : -0.f, o + r * 16 * QB);
              if (++in == bpg) { in = 0; ++gi; }
            }
          }
        }
        for (int64_t r = r0; r < r0 + nr; ++r) {
          _tile_loadd(4, xb.get() + r * 16 * C, 4 * C);
          _tile_loadd(2, bb + (r - r0) * 16 * QB, 64);
          _tile_loadd(3, bb + SEGRUNS * 16 * QB + (r - r0) * 16 * QB, 64);
          _tile_dpbf16ps(0, 2, 4);
          _tile_dpbf16ps(1, 3, 4);
        }
      }
      _tile_stored(0, out[0], 64);
      _tile_stored(1, out[1], 64);
      for (int j = 0; j < 32 && n0 + j < N; ++j) {
        const float sc = CH ? half_f(s[j]) : 1.f, bv = a.bias ? a.bias[n0 + j] : 0.f;
        for (int64_t t = 0; t < T; ++t) {
          float v = out[j / 16][j % 16][t];
          if (split) v += out[j / 16][j % 16][T + t];
          a.y[t * a.ldy + n0 + j] = v * sc + bv;
        }
      }
    }
    _tile_release();
  });
}

// the element of a run (its offset in K) that `codes_bf16` puts at slot i: int4's lane l = i / 8 holds
// nibble l of the byte pairs (low, high nibble of the even byte, then of the odd one)
template <bool I4> static inline int64_t run_k(int64_t i) {
  if constexpr (I4) return 2 * (i % 8) + (i / 8 % 2) * 16 + i / 16;
  else return i;
}

// one run of 32 codes as 32 bf16 without their scale (int4: code - 8, int8: code; small integers,
// exact in bf16) at out, int4's in the order of `run_k` (the B tile's pairs follow it). int4: the
// 16 bytes in each 128-bit lane of a register (a load, no shuffle), each lane's words shifted by
// 0, 4, 8 or 12 bits, then one VPERMW on a 16-entry table: it reads an index's low 5 bits (the
// table twice over: no mask); lane l holds the nibble l of each byte pair
template <bool I4> static inline void codes_bf16(const uint8_t* p, uint16_t* out) {
  if constexpr (I4) {
    alignas(64) static constexpr int16_t tab[32] = {-16128, -16160, -16192, -16224, -16256, -16320, -16384, -16512, 0, 16256, 16384, 16448, 16512, 16544, 16576, 16608,
                                                    -16128, -16160, -16192, -16224, -16256, -16320, -16384, -16512, 0, 16256, 16384, 16448, 16512, 16544, 16576, 16608};
    alignas(64) static constexpr int16_t shift[32] = {0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4,
                                                      8, 8, 8, 8, 8, 8, 8, 8, 12, 12, 12, 12, 12, 12, 12, 12};
    const __m512i w = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    _mm512_store_si512(out, _mm512_permutexvar_epi16(_mm512_srlv_epi16(w, _mm512_load_si512(shift)),
                                                     _mm512_load_si512(tab)));
  } else {
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))),
                 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
    _mm512_store_si512(out, (__m512i)_mm512_cvtne2ps_pbh(b, a));
  }
}

// y = x W^T for fp32 x (2-8 rows) in groups (G < K; any G with offsets) on the AMX tiles, without
// rounding the weights: A = 16 weight rows x one run of their codes in bf16 without the scale
// (`codes_bf16`); B = x^T in VNNI pairs in `run_k`'s order, x as bf16 hi and lo columns side by
// side (16 bits of its 24), prepared once per call; C sums a chunk of a group's runs (at most 8;
// TDPBF16PS), is stored (16 rows x 2T fp32) and added into 16 zmm accumulators, one a weight row,
// times its group's scale (fp32, converted once a block) broadcast over the columns; the
// accumulators live across all of K, bias and y are written once a block. A task takes blocks of 16
// rows; each block's chunks go through a pipeline (a tile's or vector's load right after the store
// it reads waits on it): chunk c's tile ops, then c + 1's codes, c - 1's C stored, c - 2's scaled
// (two A buffers, two C and two B tiles alternating). OFF: each chunk's sum of x (`xs`, once per
// call) times the row's group offset joins the accumulators as its C does: the tiles keep the exact
// codes, the term costs an FMA a row a chunk; such weights stay here, not on the FMA tiles: those
// were slower with them from GROUPS_FROM rows, int8 at GROUPS_FROM itself aside (a little faster)
template <bool I4, bool OFF>
static void amx_groups(const Args& a) {
  constexpr int64_t RB = I4 ? QB / 2 : QB;
  const int64_t T = a.T, K = a.K, N = a.N, P = K / 2, C = 2 * T;
  std::unique_ptr<uint32_t[]> xb(new uint32_t[P * C + 16]);
  at::parallel_for(0, P, 256, [&](int64_t p0, int64_t p1) {
    for (int64_t t = 0; t < T; ++t) {
      const float* xr = a.x + t * a.ldx;
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t k = p / 16 * QB;  // the run's first element; its pair p % 16 in `run_k`'s order
        const float x0 = xr[k + run_k<I4>(2 * (p % 16))], x1 = xr[k + run_k<I4>(2 * (p % 16) + 1)];
        const uint32_t h0 = bf16_bits(x0), h1 = bf16_bits(x1);
        xb[p * C + t] = h0 | (h1 << 16);
        xb[p * C + T + t] = bf16_bits(x0 - bf16_float(h0)) | (bf16_bits(x1 - bf16_float(h1)) << 16);
      }
    }
  });
  const int64_t bpg = a.G / QB, ng = K / a.G;
  int64_t cr = std::min<int64_t>(bpg, 8);  // runs a C tile sums before it is scaled: a divisor of the group's
  while (bpg % cr) --cr;
  const int64_t nc = K / QB / cr;          // chunks of cr runs
  // OFF: [nc][16] each chunk's sum of x row t in column t (the hi columns'; the lo columns' 0)
  std::unique_ptr<float[], void (*)(void*)> xs(
      OFF ? static_cast<float*>(std::aligned_alloc(64, nc * 16 * 4)) : nullptr, std::free);
  if constexpr (OFF)
    at::parallel_for(0, nc, 64, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        float* v = xs.get() + c * 16;
        for (int i = 0; i < 16; ++i) v[i] = 0.f;
        for (int64_t t = 0; t < T; ++t) {
          const float* xr = a.x + t * a.ldx + c * cr * QB;
          vw sum{};
          for (int64_t k = 0; k < cr * QB; k += VW) sum += wload(xr + k);
          v[t] = hsum(sum);
        }
      }
    });
  const int64_t blocks = (N + 15) / 16;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    TileCfg cfg{};
    cfg.palette = 1;
    for (int i = 0; i < 2; ++i) { cfg.rows[i] = 16; cfg.colsb[i] = uint16_t(4 * C); }  // C: 16 x C fp32
    for (int i = 2; i < 4; ++i) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }              // A: 16 rows x 32 bf16
    for (int i = 4; i < 6; ++i) { cfg.rows[i] = 16; cfg.colsb[i] = uint16_t(4 * C); }  // B: 16 pairs x C
    _tile_loadconfig(&cfg);
    std::unique_ptr<float[], void (*)(void*)> mem(
        static_cast<float*>(std::aligned_alloc(64, (16 * ng + 2 * 16 * 16 + 2 * cr * 16 * QB / 2) * 4)), std::free);
    float* const ds = mem.get();                  // [16][ng] the block's scales in fp32
    float* const cb = ds + 16 * ng;               // C stored: [2][16][16] fp32
    uint16_t* const ab = reinterpret_cast<uint16_t*>(cb + 2 * 16 * 16);  // [2][cr][16][32] bf16
    std::memset(cb, 0, 2 * 16 * 16 * 4);
    alignas(64) float out[16][16];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * 16;
      const uint8_t* q[16];
      const float* os[16];
      const uint8_t* pf[16];
      for (int j = 0; j < 16; ++j) {
        const int64_t n = std::min<int64_t>(n0 + j, N - 1);
        q[j] = a.q + n * a.ldq;
        os[j] = OFF ? a.o + n * a.ls : nullptr;
        pf[j] = a.q + std::min<int64_t>(n0 + 16 + j, N - 1) * a.ldq;
        const at::Half* s = a.s + n * a.ls;
        int64_t g = 0;
        for (; g + 16 <= ng; g += 16)
          _mm512_storeu_ps(ds + j * ng + g, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + g))));
        for (; g < ng; ++g) ds[j * ng + g] = half_f(s + g);
      }
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
      auto deq = [&](int64_t c, uint16_t* o) {
        const int64_t r0 = c * cr;
        for (int64_t l = (r0 * RB + 63) & ~int64_t(63); l < (r0 + cr) * RB; l += 64)
          for (int j = 0; j < 16; ++j) __builtin_prefetch(pf[j] + l, 0, 3);
        for (int64_t r = 0; r < cr; ++r)
#pragma GCC unroll 16
          for (int j = 0; j < 16; ++j) codes_bf16<I4>(q[j] + (r0 + r) * RB, o + (r * 16 + j) * QB);
      };
      auto scale = [&](int64_t c, const float* cs) {
        const int64_t g = c * cr / bpg;
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          acc[j] = _mm512_fmadd_ps(_mm512_load_ps(cs + 16 * j), _mm512_set1_ps(ds[j * ng + g]), acc[j]);
          if constexpr (OFF)
            acc[j] = _mm512_fmadd_ps(_mm512_load_ps(xs.get() + 16 * c), _mm512_set1_ps(os[j][g]), acc[j]);
        }
      };
#define QT_TILES(CT, AT, BT)                                                       \
  {                                                                                \
    const uint16_t* o = ab + (c & 1) * cr * 16 * QB;                               \
    _tile_zero(CT);                                                                \
    for (int64_t r = 0; r < cr; ++r) {                                             \
      _tile_loadd(BT, xb.get() + (c * cr + r) * 16 * C, 4 * C);                    \
      _tile_loadd(AT, o + r * 16 * QB, 64);                                        \
      _tile_dpbf16ps(CT, AT, BT);                                                  \
    }                                                                              \
  }
      deq(0, ab);
      for (int64_t c = 0; c < nc; ++c) {
        if (c & 1) QT_TILES(1, 3, 5) else QT_TILES(0, 2, 4)
        if (c + 1 < nc) deq(c + 1, ab + ((c + 1) & 1) * cr * 16 * QB);
        if (c >= 1) {
          if (c & 1) _tile_stored(0, cb, 64); else _tile_stored(1, cb + 256, 64);
        }
        if (c >= 2) scale(c - 2, cb + (c & 1) * 256);
      }
#undef QT_TILES
      if ((nc - 1) & 1) _tile_stored(1, cb + 256, 64); else _tile_stored(0, cb, 64);
      if (nc >= 2) scale(nc - 2, cb + (nc & 1) * 256);
      scale(nc - 1, cb + ((nc - 1) & 1) * 256);
      for (int j = 0; j < 16; ++j) _mm512_store_ps(out[j], acc[j]);
      for (int j = 0; j < 16 && n0 + j < N; ++j) {
        const float bv = a.bias ? a.bias[n0 + j] : 0.f;
        for (int64_t t = 0; t < T; ++t)
          a.y[t * a.ldy + n0 + j] = out[j][t] + out[j][T + t] + bv;
      }
    }
    _tile_release();
  });
}
#endif
