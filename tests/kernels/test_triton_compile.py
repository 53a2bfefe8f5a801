"""Every Triton kernel compiles for the GPUs lorafleet targets (sm_80 A100, sm_90 H100/H200), in
every dtype, down to a cubin: Triton's compiler and ptxas run on any machine, no GPU needed.

The interpreter (test_triton_kernels.py) checks what the kernels compute; this checks what only
the compiler checks: tl.dot's shape and dtype rules, the layouts of the compiled bf16/fp16
paths (which the interpreter does not take: it upcasts bf16), early returns and loop bounds
loaded from memory. Runs in a subprocess with TRITON_INTERPRET=0: triton picks interpreted or
compiled when a kernel module is imported, and this test session imports them interpreted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lorafleet.kernels import attention_triton as A, lora_triton as L

INDEX = ("seg_ptr", "meta_ptr", "tables_ptr", "pages_ptr", "offsets_ptr", "lens_ptr", "q_start_ptr",
         "q_len_ptr", "start_pos_ptr")

def signature(kernel, dtype, constexprs):
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in INDEX:
            sig[name] = "*i64"
        elif name == "t_ptr":
            sig[name] = "*fp32"          # the LoRA scratch: fp32 whatever the dtype
        elif name.endswith("_ptr"):
            sig[name] = "*" + dtype
        elif name == "scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i64" if name == "E" else "i32"
    return sig

cases = []
for dtype in ("fp32", "bf16", "fp16"):
    upcast = dtype == "fp32"
    cases += [
        (L._shrink_kernel, dtype, dict(UPCAST=upcast, WIDE=False, ATOMIC=True, K_SPLIT=256, BLOCK_M=16, BLOCK_K=64,
                                       BLOCK_R=16)),
        (L._shrink_kernel, dtype, dict(UPCAST=upcast, WIDE=True, ATOMIC=False, K_SPLIT=64, BLOCK_M=64, BLOCK_K=64,
                                       BLOCK_R=64)),
        (L._expand_kernel, dtype, dict(WIDE=False, BLOCK_M=16, BLOCK_K=16, BLOCK_N=128)),
        (L._expand_kernel, dtype, dict(WIDE=True, BLOCK_M=64, BLOCK_K=64, BLOCK_N=64)),
        (A._write_kv_kernel, dtype, dict(H_P=8, D_P=128)),
        (A._decode_kernel, dtype, dict(BLK=16, TOK=64, TOK_P=64, D_P=128)),
        (A._prefill_kernel, dtype, dict(UPCAST=upcast, BLK=16, D_P=64, BLOCK_M=64, BLOCK_N=64)),
        (A._prefill_kernel, dtype, dict(UPCAST=upcast, BLK=16, D_P=128, BLOCK_M=16, BLOCK_N=32)),
    ]
# sm_90 (H100/H200): every case; sm_80 (A100): bf16, one configuration per kernel
todo = [(90, c) for c in cases] + [(80, c) for i, c in enumerate(cases) if c[1] == "bf16" and i % 8 in (0, 2, 4, 5, 6)]
for arch, (kernel, dtype, constexprs) in todo:
    src = ASTSource(fn=kernel, signature=signature(kernel, dtype, constexprs), constexprs=constexprs)
    # the LoRA kernels launch 8 warps a program at rank blocks of 64 (lora_paged): the shrink's
    # BLOCK_R, the expand's BLOCK_K
    rank_block = constexprs.get("BLOCK_R", constexprs.get("BLOCK_K"))
    warps = 8 if kernel in (L._shrink_kernel, L._expand_kernel) and rank_block == 64 else 4
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    assert compiled.asm["cubin"], kernel.__name__
    print(f"sm_{arch} {kernel.__name__} {dtype} {constexprs} {warps} warps: ok")
'''


def test_every_triton_kernel_compiles_to_a_cubin_for_sm90_and_sm80(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count(": ok") == 3 * 8 + 5
