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
kernels' sources (`panels_cpu` as `pn::`, `linear_cpu` as `lin::`, `pointwise_cpu` as `pw::`,
`lora_cpu` as `lo::`, `paged_attention_cpu` as `att::`), whose C++ functions it calls directly.

Semantics: those of the Python loop on the CPU kernels, op for op and in the same order, so the
result is the same bit for bit (`tests/kernels/test_decode_layers_cpu.py` asserts equality);
rows past `linear_cpu.max_rows()` go to torch's GEMM, as `lin::linear` sends every caller's. Only
decode rows (one query token per sequence): a step with a prefill row runs the Python loop.
LORAFLEET_CPU_KERNELS=0 forces the references.

Two more calls for a decode step, because every Python call after the layers' weights have
streamed through the caches runs cold (on an AMD EPYC VM a numpy cumsum of 8 numbers took
25-80 us after a 128 MB read, 2.5 us warm):
- `decode_forward`: the whole forward pass of a decode-only step (the embedding, the layers,
  the final norm and the LM head), `Kernels.decode_forward`; the Python forward's logits bit
  for bit. Alone, alternated with the Python around `decode_layers` in one process: `tiny`
  steps 0.97-0.99x the time at batch 1, 0.98-1.01x at batch 8 (three runs; within the noise).
- `decode_batch`: a pure decode step's batch tensors (`ModelRunner.prepare`), in one call
  instead of ~30 numpy and torch calls that took 0.32-0.4 ms of a `tiny` step at batch 1 and 8
  (0.07-0.1 ms in one call); steps 0.91-0.94x the time at batch 1, 0.93-0.99x at batch 8.
"""

from __future__ import annotations

import torch

from lorafleet.kernels.cpu_module import load
from lorafleet.kernels.reference import AttentionMetadata

FUNCTIONS = ["decode_layers", "decode_forward", "decode_batch"]
FIELDS = 12  # tensors per layer, in `llama.Layer`'s order

DRIVER = r"""
#include <algorithm>
#include <vector>
using OptT = c10::optional<torch::Tensor>;

// One decode step through every layer. x [T, H]: the embedded tokens, the residual stream
// (updated in place); w: FIELDS tensors per layer (None where the family has none); kv: the pool
// [pages, L, 2, block, KVH, D]; lora: empty, or (pool [n], seg [S, 3]): the row tables' fields
// are [L, 4 groups, 3 slots, 5] (`reference.lora_entry`). Returns the last layer's MLP output
// (not yet in x).
// (`layers` touches no Python object: its callers release the GIL around it, so that other
// threads (the adapter loaders, the server) run meanwhile, as they did between the Python loop's
// calls; holding the GIL through a step stalled a stream 3-4x its median step while a 200 MB
// adapter loaded)
static torch::Tensor layers(torch::Tensor x, const std::vector<OptT>& w, const torch::Tensor& kv,
                            const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions,
                            const torch::Tensor& slot_pages, const torch::Tensor& slot_offsets,
                            const torch::Tensor& tables, const torch::Tensor& lens, double scale, double eps,
                            int64_t H, int64_t KVH, int64_t D, const std::vector<torch::Tensor>& lora) {
  constexpr int64_t F = FIELDS_;
  TORCH_CHECK(w.size() % F == 0 && kv.dim() == 6 && int64_t(w.size() / F) == kv.size(1),
              "decode_layers: ", F, " tensors per layer of the pool's ", kv.size(1));
  TORCH_CHECK(lora.empty() || lora.size() == 2, "decode_layers: lora is (pool, seg) or empty");
  const int64_t T = x.size(0), L = kv.size(1);
  constexpr int64_t SLOTS[4] = {3, 1, 2, 1};  // qkv, o, gate_up, down (lora/batch.py's GROUPS)
  auto delta = [&](int64_t i, int64_t g, const torch::Tensor& in, torch::Tensor& out) {
    if (!lora.empty()) lo::lora(in, out, lora[0], lora[1], ((i * 4 + g) * 3) * 5, SLOTS[g]);
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
    att::paged_decode(q, layer_kv, tables, lens, scale, o);
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

torch::Tensor decode_layers(torch::Tensor x, std::vector<OptT> w, torch::Tensor kv, torch::Tensor cos,
                            torch::Tensor sin, torch::Tensor positions, torch::Tensor slot_pages,
                            torch::Tensor slot_offsets, torch::Tensor tables, torch::Tensor lens, double scale,
                            double eps, int64_t H, int64_t KVH, int64_t D, std::vector<torch::Tensor> lora) {
  pybind11::gil_scoped_release no_gil;
  return layers(x, w, kv, cos, sin, positions, slot_pages, slot_offsets, tables, lens, scale, eps, H, KVH, D, lora);
}

// `LlamaModel.forward` for a decode-only step: the tokens' embedding rows, `layers`, the last
// MLP output into the residual stream, then the final norm and the LM head on the rows that
// sample (all of them where `rows` has every row); returns fp32 logits [S, V]. The ops of the
// Python forward, in its order, so the logits are the same bit for bit.
torch::Tensor decode_forward(torch::Tensor ids, torch::Tensor rows, torch::Tensor embed, std::vector<OptT> w,
                             torch::Tensor norm, torch::Tensor lm_head, torch::Tensor kv, torch::Tensor cos,
                             torch::Tensor sin, torch::Tensor positions, torch::Tensor slot_pages,
                             torch::Tensor slot_offsets, torch::Tensor tables, torch::Tensor lens, double scale,
                             double eps, int64_t H, int64_t KVH, int64_t D, std::vector<torch::Tensor> lora) {
  pybind11::gil_scoped_release no_gil;
  torch::Tensor x = pn::rows(embed, ids);  // the embedding, packed where it is the LM head too
  x.add_(layers(x, w, kv, cos, sin, positions, slot_pages, slot_offsets, tables, lens, scale, eps, H, KVH, D,
                lora));
  if (rows.size(0) != x.size(0)) x = x.index_select(0, rows);
  return lin::linear(pw::rms_norm(x, norm, eps), lm_head, c10::nullopt).to(at::kFloat);
}

// A pure decode step's batch tensors (`ModelRunner.prepare`'s, for rows that each decode one
// token and sample it), built in one call: table [rows, blocks] the KV manager's block table;
// per sequence its table row, its position (tokens computed so far) and its token. Returns
// (ids, positions, slot pages, slot offsets, context lengths, logits rows, block tables
// [n, width]), views of one allocation; width covers the longest sequence's blocks.
std::vector<torch::Tensor> decode_batch(torch::Tensor table, std::vector<int64_t> rows, std::vector<int64_t> starts,
                                        std::vector<int64_t> ids, int64_t bs) {
  const int64_t n = rows.size();
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong && table.is_contiguous(),
              "decode_batch: table is a contiguous [rows, blocks] int64 array");
  TORCH_CHECK(int64_t(starts.size()) == n && int64_t(ids.size()) == n && bs > 0,
              "decode_batch: one row, start and token per sequence");
  const int64_t R = table.size(0), C = table.size(1);
  int64_t width = 1;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < R && starts[i] >= 0 && starts[i] / bs < C,
                "decode_batch: sequence ", i, " is outside the block table");
    width = std::max(width, starts[i] / bs + 1);
  }
  torch::Tensor all = torch::empty({n * (6 + width)}, torch::dtype(at::kLong));
  int64_t* p = all.data_ptr<int64_t>();
  const int64_t* t = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = starts[i], *row = t + rows[i] * C;
    p[i] = ids[i];
    p[n + i] = s;
    p[2 * n + i] = row[s / bs];
    p[3 * n + i] = s % bs;
    p[4 * n + i] = s + 1;
    p[5 * n + i] = i;
    std::copy(row, row + width, p + 6 * n + i * width);
  }
  std::vector<torch::Tensor> out;
  for (int64_t k = 0; k < 6; ++k) out.push_back(all.narrow(0, k * n, n));
  out.push_back(all.narrow(0, 6 * n, n * width).view({n, width}));
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
    return load().decode_layers(x, layers, *_step_args(kv, cos, sin, positions, meta, scale, eps, heads, kv_heads,
                                                      head_dim, lora))


def _step_args(kv, cos, sin, positions, meta, scale, eps, heads, kv_heads, head_dim, lora) -> tuple:
    """The arguments after the weights that the C++ `decode_layers` and `decode_forward` both take,
    in their order: the pool, RoPE tables, the step's attention metadata, the model's numbers,
    and the LoRA batch's pool and segments (none without adapters)."""
    lora_tensors = [] if lora is None else [lora.weights, lora.seg]
    return (kv, cos, sin, positions, meta.slot_pages, meta.slot_offsets, meta.decode_block_tables,
            meta.decode_context_lens, scale, eps, heads, kv_heads, head_dim, lora_tensors)


def decode_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, meta, kv: torch.Tensor,
                   logits_rows: torch.Tensor, lora=None) -> torch.Tensor:
    """`model.forward` (a `LlamaModel`) for a decode-only step (`meta.num_decode == len(input_ids)`)
    in one call: the embedding, every layer (the C++ `decode_layers`), the final norm and the LM
    head; returns fp32 logits [S, V] for `logits_rows`. The same ops in the same order as the
    Python forward around `decode_layers`, so the same logits bit for bit (why: the module doc)."""
    cfg, w = model.cfg, model.w
    return load().decode_forward(input_ids, logits_rows, w["embed"], model.flat_layers, w["norm"], w["lm_head"],
                                 *_step_args(kv, model.cos, model.sin, positions, meta, model.scale, cfg.rms_norm_eps,
                                             cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, lora))


def decode_batch(table, rows: list[int], starts: list[int], ids: list[int], block_size: int):
    """A pure decode step's batch, as `ModelRunner.prepare` returns it (input ids [n], positions
    [n], `AttentionMetadata`, logits rows [n]), for n sequences that each decode one token and
    sample it: `table` the KV manager's block table (a numpy int64 array), each sequence's `rows`
    in it, its `starts` (tokens computed so far: the new token's position) and its token `ids`.
    The block tables are as wide as the longest sequence needs (the general path: as wide as
    the most blocks a row holds; attention reads only `lens` tokens either way)."""
    ids_t, pos, pages, offsets, lens, out_rows, tables = load().decode_batch(
        torch.from_numpy(table), rows, starts, ids, block_size)
    meta = AttentionMetadata(slot_pages=pages, slot_offsets=offsets, num_decode=len(rows),
                             decode_block_tables=tables, decode_context_lens=lens)
    return ids_t, pos, meta, out_rows
