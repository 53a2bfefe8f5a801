"""One interface over the three kernel sets, chosen once per model, here and nowhere else: Triton on CUDA, the
compiled C++ kernels on the CPU, the torch reference otherwise or where a compiled kernel cannot serve (a dtype
it lacks, a failed build, no triton), named `torch` with its reason (`Kernels.why`, logged once). The model, the
LoRA batch and the engine call `Kernels` and read what it can do (`graphs`: launches capturable in a CUDA graph).

`LORAFLEET_KERNELS` overrides the choice (an engine's `kernels` option overrides that): `auto` (default),
`triton`, `cpu` (this CPU's variant), a CPU variant by name (`cpu_module`'s `avx2`, `avx512`, `avx512-panels`,
`amx`, forced on any CPU that executes it), `torch`. `triton` on a CPU tensor needs `TRITON_INTERPRET=1` (the
interpreter, slow but exact: how CI checks the Triton path against the references).

Each op keeps the semantics of its namesake in `reference.py`:
- `linear(x, w, bias, scales, offsets)` (`F.linear`): with `scales`, w is a quantized weight's codes
  (`lorafleet.model.quant`'s layout; `offsets`, a GGUF file's affine types' group offsets, or None),
  dequantized in registers where a kernel has it (`quant_triton`, the CPU's `quant_cpu`), offsets included;
- `rms_norm(x, w, eps)`, `add_rms_norm(x, delta, w, eps)`, `rope_(q, k, cos, sin, positions)`, `silu_mul(gu)`,
  `greedy(logits)`: the step's row-wise ops;
- `lora(x, out, w, seg, entry, slots, max_rows, max_rank, max_n_out, out_align)`: each adapter read through its
  row table; the last four are Triton's alone: static bounds fixing its grid, and a number dividing every
  slot's width and first column, by which it reads and writes out's rows as vectors;
- `write_kv(kv, k, v, slot_pages, slot_offsets)`, `decode(q, kv, tables, lens, scale)` (`paged_decode`),
  `prefill(q, k, v, kv, meta, scale, out)` (`paged_prefill`); `attention()` runs the three for one layer;
- `decode_forward(weights, input_ids, positions, meta, kv, logits_rows, lora)`: `LlamaModel.forward` of a
  decode-only step in one call (the CPU's `decode_layers_cpu`), else None;
- `decode_batch(table, rows, starts, ids, block_size)`: `ModelRunner.inputs` of a pure decode step (each row one
  sampled token) in one call (the CPU's `decode_layers_cpu`), else None;
- `pack(w)`: a base weight [N, K] laid out again in its own storage, which `linear` reads as it reads [N, K]
  (the CPU's `panels_cpu.pack`), else None; the model packs its projections and LM head once, at load (a
  tied head: the embedding's storage, which `rows` then reads);
- `rows(w, ids, scales, dtype)`: the embedding's rows `w[ids]` in either layout `pack` leaves, dequantized in
  `dtype` with `scales` (the CPU's `panels_cpu.rows`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from lorafleet.errors import ConfigError
from lorafleet.kernels import reference
from lorafleet.kernels.reference import AttentionMetadata

log = logging.getLogger("lorafleet.kernels")
CPU_VARIANTS = ("avx2", "avx512", "avx512-panels", "amx")  # cpu_module.VARIANTS (a test keeps them equal)
CHOICES = ("auto", "triton", "cpu", *CPU_VARIANTS, "torch")


@dataclass(frozen=True)
class Kernels:
    name: str                 # "triton", "cpu" or "torch"
    linear: Callable
    rms_norm: Callable
    add_rms_norm: Callable
    rope_: Callable
    silu_mul: Callable
    greedy: Callable
    lora: Callable
    write_kv: Callable
    decode: Callable
    prefill: Callable
    decode_forward: Callable | None = None
    decode_batch: Callable | None = None
    pack: Callable | None = None
    rows: Callable = reference.rows
    graphs: bool = False                   # a decode step's launches can be captured as a CUDA graph
    why: str = ""                          # a fallback's reason (the torch reference serving where one was wanted)
    variant: str = ""                      # the CPU kernels' variant (cpu_module.VARIANTS), "" for the others

    @property
    def label(self) -> str:
        """The name, with the CPU variant: "cpu/avx512-panels", "torch", "triton"."""
        return f"{self.name}/{self.variant}" if self.variant else self.name

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Write this step's K/V into the pages, then decode rows, then prefill rows.
        q: [T, H, D]; k, v: [T, KVH, D]; kv: one layer's view [P, 2, B, KVH, D]. Returns [T, H*D]."""
        self.write_kv(kv, k, v, meta.slot_pages, meta.slot_offsets)
        t, h, d = q.shape
        nd = meta.num_decode
        if nd == t:  # decode rows only (a decode step): no output to assemble
            return self.decode(q, kv, meta.decode_block_tables, meta.decode_context_lens, scale).reshape(t, h * d)
        out = q.new_empty(t, h, d)
        if nd:
            out[:nd] = self.decode(q[:nd], kv, meta.decode_block_tables, meta.decode_context_lens, scale)
        if meta.prefills:
            self.prefill(q, k, v, kv, meta, scale, out)
        return out.view(t, h * d)


def _lora_reference(x, out, w, seg, entry, slots, max_rows=None, max_rank=None, max_n_out=None, out_align=1) -> None:
    reference.lora(x, out, w, seg, entry, slots)


ROW_OPS = ("rms_norm", "add_rms_norm", "rope_", "silu_mul", "greedy")
REFERENCE_ROW_OPS = {op: getattr(reference, op) for op in ROW_OPS}


_said: set[str] = set()


def torch_kernels(why: str = "") -> Kernels:
    """The references; `why`: what fell back to them, said once on the `lorafleet.kernels` logger."""
    if why and why not in _said:
        _said.add(why)
        log.warning("the torch reference kernels serve: %s", why)
    return Kernels("torch", reference.linear, lora=_lora_reference, write_kv=reference.write_kv,
                   decode=reference.paged_decode, prefill=reference.paged_prefill, why=why, **REFERENCE_ROW_OPS)


def cpu_kernels(dtype: torch.dtype, variant: str | None = None) -> Kernels:
    """The C++ kernels of `variant` (default: the process's, `cpu_module.current`) where they serve
    (built; fp32 and bf16), with the reference for prefill attention; the torch reference, saying
    why, where they do not. The variant becomes the process's (`cpu_module.use`)."""
    from lorafleet.kernels import (build, cpu_module, decode_layers_cpu, linear_cpu, lora_cpu, paged_attention_cpu,
                                   panels_cpu, pointwise_cpu)

    if dtype not in (torch.float32, torch.bfloat16):
        return torch_kernels(f"the C++ CPU kernels take float32 and bfloat16, not {str(dtype).removeprefix('torch.')}")
    variant = cpu_module.use(variant or cpu_module.current())
    if cpu_module.load(variant) is None:
        return torch_kernels(f"the C++ CPU kernels ({variant}) are unavailable ({build.why_not(cpu_module.name(variant))})")

    def lora(x, out, w, seg, entry, slots, max_rows=None, max_rank=None, max_n_out=None, out_align=1):
        lora_cpu.lora(x, out, w, seg, entry, slots)

    return Kernels("cpu", linear_cpu.linear, lora=lora, write_kv=pointwise_cpu.write_kv,
                   decode=paged_attention_cpu.paged_decode, prefill=reference.paged_prefill,
                   decode_forward=decode_layers_cpu.decode_forward, decode_batch=decode_layers_cpu.decode_batch,
                   pack=panels_cpu.pack, rows=panels_cpu.rows, variant=variant,
                   **{op: getattr(pointwise_cpu, op) for op in ROW_OPS})


def triton_kernels() -> Kernels:
    from lorafleet.kernels import attention_triton, lora_triton, quant_triton

    def prefill(q, k, v, kv, meta, scale, out):
        attention_triton.paged_prefill(q, kv, meta.prefill_starts, meta.prefill_lens, meta.prefill_positions,
                                       meta.prefill_block_tables, scale, out, meta.max_prefill_len)

    def linear(x, w, bias=None, scales=None, offsets=None):  # (a quantized embedding's rows: `reference.rows`)
        return reference.linear(x, w, bias) if scales is None else quant_triton.linear(x, w, bias, scales, offsets)

    return Kernels("triton", linear, lora=lora_triton.lora, write_kv=attention_triton.write_kv,
                   decode=attention_triton.paged_decode, prefill=prefill, graphs=True, **REFERENCE_ROW_OPS)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select(device: torch.device, dtype: torch.dtype, want: str | None = None) -> Kernels:
    """The kernels for a model on `device` at `dtype`: `want` (one of CHOICES), else
    LORAFLEET_KERNELS, else auto (the module doc)."""
    want = want or os.environ.get("LORAFLEET_KERNELS") or "auto"
    if want not in CHOICES:
        raise ConfigError(f"kernels {want!r} (LORAFLEET_KERNELS or the engine's kernels): use one of {', '.join(CHOICES)}")
    if want == "auto":
        if device.type == "cuda":
            if triton_available():
                return triton_kernels()
            return torch_kernels("triton is not installed: the GPU runs the torch reference (slow)")
        return cpu_kernels(dtype) if device.type == "cpu" else torch_kernels()
    if want == "triton":
        if not triton_available():
            raise ConfigError("LORAFLEET_KERNELS=triton but triton is not installed")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("LORAFLEET_KERNELS=triton on the CPU needs TRITON_INTERPRET=1 (the interpreter)")
        return triton_kernels()
    if want == "cpu" or want in CPU_VARIANTS:
        if device.type != "cpu":
            raise ConfigError(f"kernels {want} but the model runs on {device.type}")
        return cpu_kernels(dtype, None if want == "cpu" else want)
    return torch_kernels()


def bf16_prefill(k: Kernels) -> Callable:
    """`k.linear` for a quantized base under float32 activations (`EngineConfig.quantized_prefill`
    "bfloat16"), its matmuls of more rows than the bf16 decode kernels take (a prefill chunk) in
    bf16: x rounded to bf16 once, the weights dequantized in bf16 by blocks, torch's bf16 GEMM
    (fp32 sums; oneDNN's bf16 dot products where the CPU has them, AVX512_BF16 or AMX: faster than
    the fp32 kernel past those rows, as measured in docs/benchmarks.md), the result rounded to bf16
    and widened back, the bias added in fp32. Fewer rows (decode) keep the fp32 kernels."""
    if k.name == "cpu":
        from lorafleet.kernels import quant_cpu

        rows = quant_cpu.max_rows(torch.bfloat16)
    else:
        rows = 16

    def linear(x, w, bias=None, scales=None, offsets=None):
        if scales is None or x.dtype != torch.float32 or x.shape[0] <= rows:
            return k.linear(x, w, bias, scales, offsets)
        y = k.linear(x.to(torch.bfloat16), w, None, scales, offsets).float()
        return y if bias is None else y.add_(bias)
    return linear
