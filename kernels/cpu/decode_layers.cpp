// A decode step's layers, its forward pass and its batch in one call each (kernels/decode_layers_cpu.py),
// over the kernels' C++ (pn::, lin::, pw::, lo::, att::): compiled after them, in the one translation
// unit kernels/cpu/lorafleet_cpu.cpp.
#include <torch/extension.h>
#include <algorithm>
#include <vector>
using OptT = c10::optional<torch::Tensor>;

// One decode step through every layer. x [T, H]: the embedded tokens, the residual stream
// (updated in place); w: schema::FIELDS tensors per layer, `reference.Layer`'s fields (None where
// the family has none; `schema` is generated from that table at build); kv: the pool
// [pages, L, 2, block, KVH, D]; lora: empty, or (pool [n], seg [S, 5]): the row tables' fields
// are [L, groups, 3 slots, 5] (`reference.lora_entry`). Returns the last layer's MLP output
// (not yet in x).
// (`layers` touches no Python object: its callers release the GIL around it, so that other
// threads (the adapter loaders, the server) run meanwhile, as they did between the Python loop's
// calls; holding the GIL through a step stalled a stream several times its median step while a
// large adapter loaded)
static torch::Tensor layers(torch::Tensor x, const std::vector<OptT>& w, const torch::Tensor& kv,
                            const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions,
                            const torch::Tensor& slot_pages, const torch::Tensor& slot_offsets,
                            const torch::Tensor& tables, const torch::Tensor& lens, double scale, double eps,
                            int64_t H, int64_t KVH, int64_t D, const std::vector<torch::Tensor>& lora) {
  constexpr int64_t F = schema::FIELDS;
  TORCH_CHECK(w.size() % F == 0 && kv.dim() == 6 && int64_t(w.size() / F) == kv.size(1),
              "decode_layers: ", F, " tensors per layer of the pool's ", kv.size(1));
  TORCH_CHECK(lora.empty() || lora.size() == 2, "decode_layers: lora is (pool, seg) or empty");
  const int64_t T = x.size(0), L = kv.size(1);
  auto delta = [&](int64_t i, schema::Group g, const torch::Tensor& in, torch::Tensor& out) {
    if (!lora.empty()) lo::lora(in, out, lora[0], lora[1], ((i * schema::GROUPS + g) * 3) * lo::FIELDS, schema::SLOTS[g]);
  };
  torch::Tensor out;  // the previous layer's MLP output: it joins x as the next norm reads it
  for (int64_t i = 0; i < L; ++i) {
    const OptT* lw = w.data() + i * F;  // the projections' scales: None at full precision; their offsets: None
    // but for a GGUF file's affine types
    using namespace schema;
    torch::Tensor h = out.defined() ? pw::add_rms_norm(x, out, *lw[in_norm], eps) : pw::rms_norm(x, *lw[in_norm], eps);
    torch::Tensor qkv = lin::linear(h, *lw[schema::qkv], lw[qkv_b], lw[qkv_s], lw[qkv_o]);
    delta(i, g_qkv, h, qkv);
    const torch::Tensor heads = qkv.view({T, H + 2 * KVH, D});
    torch::Tensor q = heads.narrow(1, 0, H), k = heads.narrow(1, H, KVH), v = heads.narrow(1, H + KVH, KVH);
    if (lw[q_norm]) {
      q = pw::rms_norm(q.reshape({-1, D}), *lw[q_norm], eps).view({T, H, D});
      k = pw::rms_norm(k.reshape({-1, D}), *lw[k_norm], eps).view({T, KVH, D});
    }
    pw::rope_(q, k, cos, sin, positions);
    const torch::Tensor layer_kv = kv.select(1, i);
    pw::write_kv(layer_kv, k, v, slot_pages, slot_offsets);
    torch::Tensor o = torch::empty({T, H, D}, x.options());
    att::paged_decode(q, layer_kv, tables, lens, scale, o);
    o = o.view({T, H * D});
    out = lin::linear(o, *lw[schema::o], lw[o_b], lw[o_s], lw[o_o]);
    delta(i, g_o, o, out);
    h = pw::add_rms_norm(x, out, *lw[post_norm], eps);
    torch::Tensor gu = lin::linear(h, *lw[gate_up], lw[gate_up_b], lw[gate_up_s], lw[gate_up_o]);
    delta(i, g_gate_up, h, gu);
    const torch::Tensor a = pw::silu_mul(gu);
    out = lin::linear(a, *lw[down], lw[down_b], lw[down_s], lw[down_o]);
    delta(i, g_down, a, out);
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

// `LlamaModel.forward` for a decode-only step (embed_s, lm_head_s: a quantized embedding's and LM
// head's scales, or None; lm_head_o: the head's group offsets, or None): the tokens' embedding rows, `layers`, the last MLP output into the
// residual stream, then the final norm and the LM head on the rows that
// sample (all of them where `rows` has every row); returns fp32 logits [S, V]. The ops of the
// Python forward, in its order, so the logits are the same bit for bit.
torch::Tensor decode_forward(torch::Tensor ids, torch::Tensor rows, torch::Tensor embed, OptT embed_s,
                             std::vector<OptT> w, torch::Tensor norm, torch::Tensor lm_head, OptT lm_head_s,
                             OptT lm_head_o, torch::Tensor kv, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions, torch::Tensor slot_pages,
                             torch::Tensor slot_offsets, torch::Tensor tables, torch::Tensor lens, double scale,
                             double eps, int64_t H, int64_t KVH, int64_t D, std::vector<torch::Tensor> lora) {
  pybind11::gil_scoped_release no_gil;
  // the embedding: packed where it is the LM head too; quantized (tied to a quantized head),
  // dequantized in the compute dtype (the norms')
  torch::Tensor x = embed_s ? qt::rows(embed, ids, *embed_s, norm.scalar_type()) : pn::rows(embed, ids);
  x.add_(layers(x, w, kv, cos, sin, positions, slot_pages, slot_offsets, tables, lens, scale, eps, H, KVH, D,
                lora));
  if (rows.size(0) != x.size(0)) x = x.index_select(0, rows);
  return lin::linear(pw::rms_norm(x, norm, eps), lm_head, c10::nullopt, lm_head_s, lm_head_o).to(at::kFloat);
}

// A pure decode step's batch tensors (`ModelRunner.inputs`'s, for rows that each decode one
// token and sample it), built in one call: table [rows, blocks] the KV manager's block table;
// per sequence its table row, its position (tokens computed so far) and its token. Returns one
// int64 array: ids, positions, slot pages, slot offsets, context lengths, logits rows (n each),
// then block tables [n, width]; width covers the longest sequence's blocks. One array, not seven
// tensors: the caller views it through numpy, and each tensor's conversion cost more than the build.
torch::Tensor decode_batch(torch::Tensor table, std::vector<int64_t> rows, std::vector<int64_t> starts,
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
  return all;
}
