"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) as plain torch, read top-down.

The model sees a *flat* batch: every token of the step, from every sequence, in one row of
`input_ids` ([T]); attention is the only place where sequences are told apart, through the
`AttentionMetadata` the runner builds and the KV pages of the unified pool. Base projections are
fused (qkv, gate_up) for fewer calls; each LoRA target still gets its own slice of the output.
"""

from __future__ import annotations

import math
import torch

from lorafleet.kernels import backend
from lorafleet.kernels.reference import AttentionMetadata, DecodeWeights, Layer
from lorafleet.model.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


def rope_cache(cfg: ModelConfig, max_len: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = rope_inv_freq(cfg)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [P, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)                                    # [P, D]
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a layer's weights that only `Kernels.linear` reads


def quant_scheme(weights: dict[str, torch.Tensor]) -> str | None:
    """"int8" or "int4" where the weights a step reads through `Kernels.linear` (the projections and
    the LM head) are quantized in that scheme (`lorafleet.model.quant`), "mixed" where they are in
    both (a GGUF file's mix: each weight keeps its own), else None."""
    schemes = {"int8" if weights[name[:-2]].dtype == torch.int8 else "int4"
               for name in weights if name.endswith("_s") and name != "embed_s"}
    return None if not schemes else schemes.pop() if len(schemes) == 1 else "mixed"


class LlamaModel(torch.nn.Module):
    """Weights live in plain tensors (see `loader.py`), named as below:

    embed [V, H]; per layer: in_norm [H], qkv [Q+2K, H] (+qkv_b), q_norm/k_norm [D] (Qwen3),
    o [H, Q] (+o_b), post_norm [H], gate_up [2I, H] (+gate_up_b), down [H, I] (+down_b);
    norm [H]; lm_head [V, H] (the embedding itself when tied). Where the kernels lay weights
    out for their `linear` (`Kernels.pack`: the CPU's panels in fp32 in AMD's layout, the `avx2`
    and `avx512-panels` variants), the projections and the LM head are packed here, once, in their own storage:
    read them through `Kernels.linear` only, and a tied embedding (the LM head's storage, so
    packed with it) through `Kernels.rows`.

    A quantized model (`lorafleet.model.quant`) holds each projection's and the LM head's codes
    under the same names and their scales beside them (`<name>_s`; the embedding's, `embed_s`,
    read through `Kernels.rows`); `dtype` is then the compute dtype, which
    activations, norms, the KV cache and adapters keep.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], max_len: int, kernels: str | None = None,
                 prefill: str = "float32"):
        """`kernels`: `backend.select`'s choice (None: LORAFLEET_KERNELS, else auto); `prefill`: a
        quantized base's prefill matmuls under float32 activations, float32 or bfloat16 (`project`)."""
        super().__init__()
        self.cfg = cfg
        self.w = weights
        t = weights["norm"]  # norms are never quantized: they carry the compute dtype
        self.dtype, self.device = t.dtype, t.device
        self.quantization = quant_scheme(weights)
        self.max_len = max_len  # the longest sequence served: the RoPE tables' length
        self.cos, self.sin = rope_cache(cfg, max_len, t.dtype, t.device)
        self.scale = cfg.head_dim ** -0.5
        self.kernels = backend.select(t.device, t.dtype, kernels)  # every op of the forward pass, for this device
        # the layers' projections: `Kernels.linear`, or with prefill="bfloat16" on a quantized base
        # under fp32, its GEMMs past the decode kernels' rows in bf16 (`backend.bf16_prefill`); the
        # LM head keeps fp32 (logits and logprobs)
        self.prefill_bf16 = prefill == "bfloat16" and self.quantization is not None and t.dtype == torch.float32
        self.project = backend.bf16_prefill(self.kernels) if self.prefill_bf16 else self.kernels.linear
        # the dtype whose tolerance the kernels are held to against the reference (self-check, verify)
        self.numerics = torch.bfloat16 if self.prefill_bf16 else t.dtype
        if self.kernels.pack is not None and self.quantization is None:  # the projections laid out for the kernels' `linear`, in place
            tied = weights["lm_head"].data_ptr() == weights["embed"].data_ptr()  # one storage: packed once, as the head
            for name in ["embed" if tied else "lm_head"] + [f"layers.{i}.{n}" for i in range(cfg.num_layers)
                                                            for n in PROJECTIONS]:
                weights[name] = self.kernels.pack(weights[name])
            if tied:  # one storage, now the head's layout: the embedding is read through `Kernels.rows`
                weights["lm_head"] = weights["embed"]
        # a GGUF file's affine types: each group's offset, which `Kernels.linear` adds to the weight
        # (each layer's also in its `Layer`)
        self.offsets = {name[:-2]: t for name, t in weights.items() if name.endswith("_o")}
        # each layer's tensors looked up once, not by name in every step (`w` stays the owner)
        self.layers = [Layer._make(weights.get(f"layers.{i}.{n}") for n in Layer._fields) for i in range(cfg.num_layers)]
        # what the one-call decode forward reads, gathered once (the weights never change)
        self.decode_weights = DecodeWeights(
            weights["embed"], weights.get("embed_s"), [t for lw in self.layers for t in lw], weights["norm"],
            weights["lm_head"], weights.get("lm_head_s"), weights.get("lm_head_o"), self.cos, self.sin, self.scale,
            cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        # the bytes of every distinct weight tensor (a tied LM head is the embedding), scales
        # included: the base's memory, counted once here (the weights never change)
        distinct = {t.data_ptr(): t for t in weights.values()}
        self.weight_bytes = sum(t.numel() * t.element_size() for t in distinct.values())

    def base_rows(self, layer: int, group: str, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows [start, end) of a fused projection's weight (`group`: qkv, o, gate_up, down) as
        served (dequantized, unpacked: through `Kernels.rows`) in fp32 on the host, and of its bias (None
        without one): what DoRA's norms read (`adapters.finish`). `group` "embed" or "lm_head": that
        weight's rows (`layer` unused; no bias), what a saved copy is compared with. Read only; any thread."""
        ids = torch.arange(start, end, device=self.device)
        if group in ("embed", "lm_head"):
            return self.kernels.rows(self.w[group], ids, self.w.get(f"{group}_s"), torch.float32).float().cpu(), None
        lw = self.layers[layer]
        w = self.kernels.rows(getattr(lw, group), ids, getattr(lw, f"{group}_s"), torch.float32).float()
        if (o := getattr(lw, f"{group}_o")) is not None:
            w += o[ids].repeat_interleave(w.shape[1] // o.shape[1], dim=1)
        bias = getattr(lw, f"{group}_b")  # on the host, as the load's buffers are
        return w.cpu(), None if bias is None else bias[ids].float().cpu()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_cache: torch.Tensor, logits_rows: torch.Tensor, lora=None) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [pages, L, 2, block, KVH, D] (a view of the pool);
        logits_rows: [S] token rows whose next-token logits are wanted. Returns logits [S, V].
        `lora` (optional, an `adapters.batch.LoraBatch`) has `apply(layer, group, x, out)` adding each
        row's adapter delta to the fused output of a projection group (qkv, o, gate_up, down), and
        `embed` / `logits` for adapters with their own embedding or LM head (then the logits may
        be wider than V: an adapter's added tokens).
        A decode-only step runs in one call where the kernels have one (`Kernels.decode_forward`,
        the CPU's): the same ops as below, `layers_` included, in C++."""
        cfg, w, ops = self.cfg, self.w, self.kernels
        heads = lora is not None and bool(lora.heads)  # adapters with their own embedding / LM head
        if ops.decode_forward is not None and attn.num_decode == input_ids.shape[0] and not heads:
            return ops.decode_forward(self.decode_weights, input_ids, positions, attn, kv_cache, logits_rows, lora)
        ids = input_ids.clamp(max=cfg.vocab_size - 1) if heads else input_ids  # an added token: its adapter's row
        x = ops.rows(w["embed"], ids, w.get("embed_s"), self.dtype)   # [T, H], the residual stream
        if heads:
            lora.embed(input_ids, x)
        out = self.layers_(x, positions, attn, kv_cache, lora)
        x.add_(out)
        pre = x[logits_rows]  # only rows that sample
        x = ops.rms_norm(pre, w["norm"], cfg.rms_norm_eps)
        if heads and "final_norm" in lora.norms:
            lora.final_norm(pre, logits_rows, x, ops.rms_norm, cfg.rms_norm_eps)
        logits = ops.linear(x, w["lm_head"], None, w.get("lm_head_s"), self.offsets.get("lm_head")).float()  # [S, V]
        return lora.logits(x, logits_rows, logits) if heads else logits

    def layers_(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv_cache: torch.Tensor,
                lora=None) -> torch.Tensor:
        """Every decoder layer over the residual stream x [T, H] (updated in place); returns the
        last layer's MLP output, which the caller adds to x."""
        cfg, ops, project = self.cfg, self.kernels, self.project
        eps = cfg.rms_norm_eps
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)
        norms = lora.norms if lora is not None else ()  # adapters' saved layer norms (modules_to_save)
        out = None
        for i, lw in enumerate(self.layers):
            # the previous layer's MLP output joins the residual stream as this norm reads it
            h = ops.rms_norm(x, lw.in_norm, eps) if out is None else ops.add_rms_norm(x, out, lw.in_norm, eps)
            if "in_norm" in norms:
                lora.norm(i, "in_norm", x, h, ops.rms_norm, eps)
            qkv = project(h, lw.qkv, lw.qkv_b, lw.qkv_s, lw.qkv_o)                         # [T, Q+2K]
            if lora is not None:
                lora.apply(i, "qkv", h, qkv)
            # [T, H+2KVH, D] cut into q, k, v heads (split_with_sizes: one call, a third of
            # Tensor.split's and three views' time)
            q, k, v = torch.split_with_sizes(qkv.view(x.shape[0], -1, cfg.head_dim), heads, 1)
            if cfg.qk_norm:
                q = ops.rms_norm(q.reshape(-1, cfg.head_dim), lw.q_norm, eps).view(q.shape)
                k = ops.rms_norm(k.reshape(-1, cfg.head_dim), lw.k_norm, eps).view(k.shape)
            ops.rope_(q, k, self.cos, self.sin, positions)                # in place
            o = ops.attention(q, k, v, kv_cache[:, i], attn, self.scale)  # [T, Q]
            out = project(o, lw.o, lw.o_b, lw.o_s, lw.o_o)
            if lora is not None:
                lora.apply(i, "o", o, out)
            h = ops.add_rms_norm(x, out, lw.post_norm, eps)
            if "post_norm" in norms:
                lora.norm(i, "post_norm", x, h, ops.rms_norm, eps)
            gu = project(h, lw.gate_up, lw.gate_up_b, lw.gate_up_s, lw.gate_up_o)                    # [T, 2I]
            if lora is not None:
                lora.apply(i, "gate_up", h, gu)
            a = ops.silu_mul(gu)
            out = project(a, lw.down, lw.down_b, lw.down_s, lw.down_o)
            if lora is not None:
                lora.apply(i, "down", a, out)
        assert out is not None  # a model has layers
        return out
