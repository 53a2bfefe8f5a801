"""The CPU LoRA kernel: shrink + expand for every segment of a projection group in one call,
reading adapter weights straight from the pool's pages through each adapter's page table.

Semantics (identical to `reference.lora_paged`, whose contract it keeps): for every segment s,
row i in [seg[s, 0], seg[s, 1]) and module slot m with rank r > 0:
    out[i, col_m : col_m + n_out] += (x[i] @ A_m(s)^T) @ Bt_m(s)
with A_m [r, in] at logical offset a_off and Bt_m [r, n_out] at b_off of the adapter's buffer;
logical element o lives in pool page tables[s, o // E] at o % E. A row of A or Bt that crosses a
page boundary is read in two pieces, so an adapter's pages may lie anywhere in the pool: no
contiguous run, no per-step gather.

Why it exists: with one token per adapter (decode over many adapters), the torch path issues
~11 tiny matmuls per adapter per layer, and the time goes to dispatch, not to reading weights.
This kernel makes it one call per (layer, group), parallel over (segment, block of 4 rows)
tasks: each weight row is read once per 4 rows of a segment (decode: once), so decode is
memory-bound and prefill segments need no BLAS call on gathered copies. float32 and bfloat16
(x, out and the pool in one dtype): sums in fp32, each output element rounded once when the
segment's whole delta joins it, as the reference does.
It is compiled on first use with the machine's C++ compiler and cached (see `build.py`); where
that is impossible lorafleet falls back to the torch reference and says so once.
Set LORAFLEET_CPU_KERNELS=0 to force the reference; LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI) makes a
kernel that cannot be loaded an error instead (`KernelUnavailableError`, with the build error).
"""

from __future__ import annotations

import torch

from lorafleet.kernels.build import KernelUnavailableError, compile_inline, required  # noqa: F401  re-exported

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <vector>

constexpr int64_t RB = 4;  // rows of a segment per task: each weight row serves up to 4 rows

// calls f(pointer, first element, length) for each piece of logical elements [o, o + n) that
// lies in one page
template <class S, class F>
static inline void pieces(const S* w, const int64_t* table, int64_t E, int64_t o, int64_t n, F f) {
  for (int64_t done = 0; done < n;) {
    const int64_t page = (o + done) / E, off = (o + done) % E, len = std::min(n - done, E - off);
    f(w + table[page] * E + off, done, len);
    done += len;
  }
}

// S: the storage of x, out and the pool (float or bf16); every sum is fp32, and each output
// element is rounded once, when the segment's whole delta is added to it
template <class S>
static void lora_t(const torch::Tensor& x, torch::Tensor& out, const torch::Tensor& w, int64_t E,
                   const torch::Tensor& seg, const torch::Tensor& meta, const torch::Tensor& tables) {
  const S* xp = x.data_ptr<S>();
  S* op = out.data_ptr<S>();
  const S* wp = w.data_ptr<S>();
  const int64_t* mp = meta.data_ptr<int64_t>();
  const int64_t* sp = seg.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t S_ = seg.size(0), M = meta.size(1), in = x.size(1), maxp = tables.size(1);
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  std::vector<int64_t> tasks;  // (segment, first row) pairs
  for (int64_t s = 0; s < S_; ++s)
    for (int64_t row = sp[2 * s]; row < sp[2 * s + 1]; row += RB) { tasks.push_back(s); tasks.push_back(row); }
  at::parallel_for(0, (int64_t)tasks.size() / 2, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> t, xf, acc;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t s = tasks[2 * task], row0 = tasks[2 * task + 1];
      const int64_t nb = std::min(RB, sp[2 * s + 1] - row0);
      const int64_t* table = tp + s * maxp;
      // the block's rows in fp32 (rows past the block repeat its first: computed, never stored)
      xf.resize(RB * in);
      for (int64_t b = 0; b < RB; ++b) {
        const S* xr = xp + (row0 + (b < nb ? b : 0)) * ldx;
        for (int64_t d = 0; d < in; ++d) xf[b * in + d] = float(xr[d]);
      }
      const float* xr[RB] = {xf.data(), xf.data() + in, xf.data() + 2 * in, xf.data() + 3 * in};
      for (int64_t m = 0; m < M; ++m) {
        const int64_t* f = mp + (s * M + m) * 5;
        const int64_t a_off = f[0], r = f[1], b_off = f[2], n_out = f[3], col = f[4];
        if (r == 0) continue;
        t.assign(RB * r, 0.f);
        acc.assign(nb * n_out, 0.f);
        auto one_row = [&](int64_t k) {  // t[b, k] for one rank row, in pieces across pages
          float sum[RB] = {0.f, 0.f, 0.f, 0.f};
          pieces(wp, table, E, a_off + k * in, in, [&](const S* a, int64_t d0, int64_t len) {
            const float *x0 = xr[0] + d0, *x1 = xr[1] + d0, *x2 = xr[2] + d0, *x3 = xr[3] + d0;
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+:s0, s1, s2, s3)
            for (int64_t d = 0; d < len; ++d) {
              const float av = float(a[d]);
              s0 += av * x0[d]; s1 += av * x1[d]; s2 += av * x2[d]; s3 += av * x3[d];
            }
            sum[0] += s0; sum[1] += s1; sum[2] += s2; sum[3] += s3;
          });
          for (int64_t b = 0; b < RB; ++b) t[b * r + k] = sum[b];
        };
        auto one_expand = [&](int64_t k) {  // acc[b] += t[b, k] * Bt[k], in pieces across pages
          pieces(wp, table, E, b_off + k * n_out, n_out, [&](const S* bt, int64_t d0, int64_t len) {
            for (int64_t b = 0; b < nb; ++b) {
              const float c = t[b * r + k];
              float* y = acc.data() + b * n_out + d0;
#pragma omp simd
              for (int64_t d = 0; d < len; ++d) y[d] += c * float(bt[d]);
            }
          });
        };
        // shrink: t[b, k] = A[k] . x[b]; two rank rows at a time when each lies in one page
        // (8 running sums: each x element loaded serves two rows of A)
        int64_t k = 0;
        for (; k + 2 <= r; k += 2) {
          const int64_t o0 = a_off + k * in, o1 = o0 + in;
          if (o0 % E + in > E || o1 % E + in > E) {
            one_row(k);
            one_row(k + 1);
            continue;
          }
          const S *a0 = wp + table[o0 / E] * E + o0 % E, *a1 = wp + table[o1 / E] * E + o1 % E;
          const float *x0 = xr[0], *x1 = xr[1], *x2 = xr[2], *x3 = xr[3];
          float s00 = 0.f, s01 = 0.f, s10 = 0.f, s11 = 0.f, s20 = 0.f, s21 = 0.f, s30 = 0.f, s31 = 0.f;
#pragma omp simd reduction(+:s00, s01, s10, s11, s20, s21, s30, s31)
          for (int64_t d = 0; d < in; ++d) {
            const float u = float(a0[d]), v = float(a1[d]);
            s00 += u * x0[d]; s01 += v * x0[d]; s10 += u * x1[d]; s11 += v * x1[d];
            s20 += u * x2[d]; s21 += v * x2[d]; s30 += u * x3[d]; s31 += v * x3[d];
          }
          t[k] = s00; t[k + 1] = s01; t[r + k] = s10; t[r + k + 1] = s11;
          t[2 * r + k] = s20; t[2 * r + k + 1] = s21; t[3 * r + k] = s30; t[3 * r + k + 1] = s31;
        }
        if (k < r) one_row(k);
        // expand: acc[b] += sum_k t[b, k] * Bt[k]; four rank rows at a time when each lies in
        // one page (one pass over acc per four rows of Bt instead of one per row)
        k = 0;
        for (; k + 4 <= r; k += 4) {
          const S* bt[4];
          bool in_page = true;
          for (int64_t j = 0; j < 4; ++j) {
            const int64_t o = b_off + (k + j) * n_out;
            in_page = in_page && o % E + n_out <= E;
            bt[j] = in_page ? wp + table[o / E] * E + o % E : nullptr;
          }
          if (!in_page) {
            for (int64_t j = 0; j < 4; ++j) one_expand(k + j);
            continue;
          }
          const S *b0 = bt[0], *b1 = bt[1], *b2 = bt[2], *b3 = bt[3];
          for (int64_t b = 0; b < nb; ++b) {
            const float* c = t.data() + b * r + k;
            const float c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3];
            float* y = acc.data() + b * n_out;
#pragma omp simd
            for (int64_t d = 0; d < n_out; ++d)
              y[d] += c0 * float(b0[d]) + c1 * float(b1[d]) + c2 * float(b2[d]) + c3 * float(b3[d]);
          }
        }
        for (; k < r; ++k) one_expand(k);
        for (int64_t b = 0; b < nb; ++b) {  // out += delta, rounded once
          S* y = op + (row0 + b) * ldo + col;
          const float* dv = acc.data() + b * n_out;
#pragma omp simd
          for (int64_t d = 0; d < n_out; ++d) y[d] = S(float(y[d]) + dv[d]);
        }
      }
    }
  });
}

void lora_paged(torch::Tensor x, torch::Tensor out, torch::Tensor w, int64_t E, torch::Tensor seg,
                torch::Tensor meta, torch::Tensor tables) {
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && w.scalar_type() == x.scalar_type(),
              "lora_paged: x, out and the pool differ in dtype");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && w.is_contiguous(), "lora_paged: layout");
  TORCH_CHECK(meta.is_contiguous() && seg.is_contiguous() && tables.is_contiguous(),
              "lora_paged: metadata layout");
  if (x.scalar_type() == at::kFloat) lora_t<float>(x, out, w, E, seg, meta, tables);
  else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "lora_paged: float32 or bfloat16 only");
    lora_t<c10::BFloat16>(x, out, w, E, seg, meta, tables);
  }
}
"""

def load():
    """The compiled LoRA kernel, or None when it cannot be built here (an error instead with
    LORAFLEET_REQUIRE_CPU_KERNELS=1)."""
    return compile_inline("lorafleet_lora_cpu_v5", _SOURCE, "lora_paged")


def lora_paged(x: torch.Tensor, out: torch.Tensor, w: torch.Tensor, page_elems: int, seg: torch.Tensor,
               meta: torch.Tensor, tables: torch.Tensor) -> None:
    """x: [T, in]; out: [T, N] (updated in place); w: the pool, flat; one dtype, float32 or
    bfloat16 (fp32 sums, each output rounded once); seg [S, 2],
    meta [S, M, 5], tables [S, maxp] int64 (the contract in `reference.py`)."""
    load().lora_paged(x, out, w, page_elems, seg, meta, tables)
