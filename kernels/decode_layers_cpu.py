"""The decoder layers of a CPU decode step in one call (issue 18): the loop of `LlamaModel.forward`
over its layers, in C++, calling the same C++ kernels the Python loop calls one by one.

Why: a decode step on `tiny` (8 layers) made ~100 kernel calls, and the Python between them
(argument passing, the qkv split into three views, each LoRA group's metadata view, the wrappers)
took 0.7 ms of a 7.3 ms step at batch 1, 0.85 of 11.0 at batch 8 and 1.5 of 22.3 at batch 8 over
8 adapters (AMD EPYC, 2 threads, contexts up to 364 tokens), beside 0.55-0.9 ms of engine
bookkeeping; issue 18's bound for that step at batch 1 is ~4.3 ms. Here a step's layers are one
call; the model's Python still embeds the tokens and runs the final norm and LM head. Steps with
the one call against the Python loop, alternated in one process: 0.93x the time at batch 1,
0.96x at batch 8, 0.94x at batch 8 over 8 adapters.

How: the driver below is compiled in the CPU kernels' one extension (`cpu_module`), after the
four kernels' sources (`linear_cpu` as `lin::`, `pointwise_cpu` as `pw::`, `lora_cpu` as
`lo::`, `paged_attention_cpu` as `att::`), whose C++ functions it calls directly.

Semantics: those of the Python loop on the CPU kernels, op for op and in the same order, so the
result is the same bit for bit (`tests/kernels/test_decode_layers_cpu.py` asserts equality);
rows past `linear_cpu.max_rows()` go to torch's GEMM, as `lin::linear` sends every caller's. Only
decode rows (one query token per sequence): a step with a prefill row runs the Python loop.
LORAFLEET_CPU_KERNELS=0 forces the references.
"""

from __future__ import annotations

import torch

from lorafleet.kernels.cpu_module import load

FUNCTIONS = ["decode_layers"]
FIELDS = 12  # tensors per layer, in `llama.Layer`'s order

DRIVER = r"""
#include <vector>
using OptT = c10::optional<torch::Tensor>;

// One decode step through every layer. x [T, H]: the embedded tokens, the residual stream
// (updated in place); w: FIELDS tensors per layer (None where the family has none); kv: the pool
// [pages, L, 2, block, KVH, D]; lora: empty, or (pool [n], seg, meta [L, G, S, slots, 5], tables)
// with `E` elements per page. Returns the last layer's MLP output (not yet in x).
torch::Tensor decode_layers(torch::Tensor x, std::vector<OptT> w, torch::Tensor kv, torch::Tensor cos,
                            torch::Tensor sin, torch::Tensor positions, torch::Tensor slot_pages,
                            torch::Tensor slot_offsets, torch::Tensor tables, torch::Tensor lens, double scale,
                            double eps, int64_t H, int64_t KVH, int64_t D, std::vector<torch::Tensor> lora,
                            int64_t E) {
  constexpr int64_t F = FIELDS_;
  TORCH_CHECK(w.size() % F == 0 && kv.dim() == 6 && int64_t(w.size() / F) == kv.size(1),
              "decode_layers: ", F, " tensors per layer of the pool's ", kv.size(1));
  TORCH_CHECK(lora.empty() || lora.size() == 4, "decode_layers: lora is (pool, seg, meta, tables) or empty");
  const int64_t T = x.size(0), L = kv.size(1);
  // no Python object is touched below: other threads (the adapter loaders, the server) run
  // meanwhile, as they did between the Python loop's calls (holding the GIL through a step
  // stalled a stream 3-4x its median step while a 200 MB adapter loaded)
  pybind11::gil_scoped_release no_gil;
  auto delta = [&](int64_t i, int64_t g, const torch::Tensor& in, torch::Tensor& out) {
    if (!lora.empty()) lo::lora_paged(in, out, lora[0], E, lora[1], lora[2].select(0, i).select(0, g), lora[3]);
  };
  torch::Tensor out;  // the previous layer's MLP output: it joins x as the next norm reads it
  for (int64_t i = 0; i < L; ++i) {
    const OptT* lw = w.data() + i * F;  // in_norm qkv qkv_b q_norm k_norm o o_b post_norm gate_up gate_up_b down down_b
    torch::Tensor h = out.defined() ? pw::add_rms_norm(x, out, *lw[0], eps) : pw::rms_norm(x, *lw[0], eps);
    torch::Tensor qkv = lin::linear(h, *lw[1], lw[2]);
    delta(i, 0, h, qkv);
    const torch::Tensor heads = qkv.view({T, H + 2 * KVH, D});
    torch::Tensor q = heads.narrow(1, 0, H), k = heads.narrow(1, H, KVH), v = heads.narrow(1, H + KVH, KVH);
    if (lw[3]) {
      q = pw::rms_norm(q.reshape({-1, D}), *lw[3], eps).view({T, H, D});
      k = pw::rms_norm(k.reshape({-1, D}), *lw[4], eps).view({T, KVH, D});
    }
    pw::rope_(q, k, cos, sin, positions);
    const torch::Tensor layer_kv = kv.select(1, i);
    pw::write_kv(layer_kv, k, v, slot_pages, slot_offsets);
    torch::Tensor o = torch::empty({T, H, D}, x.options());
    att::paged_decode(q.contiguous(), layer_kv, tables, lens, scale, o);
    o = o.view({T, H * D});
    out = lin::linear(o, *lw[5], lw[6]);
    delta(i, 1, o, out);
    h = pw::add_rms_norm(x, out, *lw[7], eps);
    torch::Tensor gu = lin::linear(h, *lw[8], lw[9]);
    delta(i, 2, h, gu);
    const torch::Tensor a = pw::silu_mul(gu);
    out = lin::linear(a, *lw[10], lw[11]);
    delta(i, 3, a, out);
  }
  return out;
}
""".replace("FIELDS_", str(FIELDS))


def decode_layers(x: torch.Tensor, layers: list, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor, meta, scale: float, eps: float, heads: int, kv_heads: int,
                  head_dim: int, lora=None) -> torch.Tensor:
    """Every layer of a decode-only step (`meta.num_decode == len(x)`): x [T, H] the embedded
    tokens (updated in place, as the Python loop updates it); `layers` the model's
    `llama.Layer`s flattened (FIELDS per layer); `meta` the step's `AttentionMetadata`; `lora` a
    `lora.batch.LoraBatch` or None. Returns the last layer's MLP output, for the caller to add."""
    extra = [] if lora is None else [lora.weights, lora.seg, lora.meta, lora.tables]
    return load().decode_layers(x, layers, kv, cos, sin, positions, meta.slot_pages, meta.slot_offsets,
                                meta.decode_block_tables, meta.decode_context_lens, scale, eps, heads, kv_heads,
                                head_dim, extra, 0 if lora is None else lora.page_elems)
