"""Every Triton kernel compiles for the GPUs lorafleet targets (sm_80 A100, sm_90 H100/H200), in
every dtype, at the blocks and warps it launches with, down to a cubin, and none spills registers
to local memory (ptxas -v; fp32 on sm_80 excepted: no one serves fp32 on an A100); the LoRA
expand and fused kernels write the output's tile in 16-byte vectors only (their PTX): Triton's
compiler and ptxas run on any machine, no GPU needed. The compile sees what a launch
specializes: 16-byte aligned pointers, ints that are multiples of 16, unit strides.

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

import pytest

pytestmark = pytest.mark.heavy  # compiles every Triton kernel for two GPUs

SCRIPT = r'''
import re
import subprocess
import sys
import tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from lorafleet.kernels import attention_triton as A, lora_triton as L


INDEX = ("seg_ptr", "wi_ptr", "mix_ptr", "tables_ptr", "pages_ptr", "offsets_ptr", "lens_ptr", "q_start_ptr",
         "q_len_ptr", "start_pos_ptr")

# what a launch specializes: 16-byte aligned tensors and ints that are multiples of 16 (as the
# engine's are), unit strides (constants)
ALIGNED = ("IN", "stride_x", "stride_out", "T", "RMAX", "D", "sq0", "sq1", "s_p", "s_2", "s_t", "s_h", "so0", "so1",
           "st0", "sk0", "sk1", "sv0", "sv1")
UNIT = ("s_d", "sq2", "so2", "sk2", "sv2")

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
            sig[name] = "i32"
    return sig

def lora_cases(dtype, cfg):
    # the blocks `lora_triton.lora` launches for a captured decode step (16 rows) at rank bounds 16
    # and 64, and for a prefill (64 rows), on a group whose columns are aligned (every Llama's):
    # OUT_ALIGN a 16-byte vector
    upcast = dtype == "fp32"
    vec = 4 if upcast else 8
    out = []
    for block_m, block_r in ((16, 16), (16, 64), (32 if upcast else 64, 64)):
        block_n = cfg.block_n if block_m == 16 else min(cfg.block_n, L.PREFILL_BLOCK_N)
        if cfg.design == "fused" and block_m == 16:
            out.append((L.fused_kernel, dtype, dict(UPCAST=upcast, BLOCK_M=block_m, BLOCK_K=cfg.block_k,
                                                     BLOCK_R=L.FUSED_RANK_BLOCK, BLOCK_N=block_n, OUT_ALIGN=vec),
                        cfg.warps))
        else:
            out.append((L.shrink_kernel, dtype, dict(UPCAST=upcast, K_SPLIT=cfg.k_split, BLOCK_M=block_m,
                                                      BLOCK_K=cfg.block_k, BLOCK_R=block_r), cfg.warps))
            rank_block = block_r if block_m == 16 else min(block_r, L.PREFILL_RANK_BLOCK)
            out.append((L.expand_kernel, dtype, dict(BLOCK_M=block_m, BLOCK_K=rank_block, BLOCK_N=block_n,
                                                      OUT_ALIGN=vec), cfg.warps))
    return out

cases = []
for dtype in ("fp32", "bf16", "fp16"):
    upcast = dtype == "fp32"
    cases += lora_cases(dtype, L.CONFIG)
    cases += [
        (A._write_kv_kernel, dtype, dict(H_P=8, D_P=128), 4),
        (A._decode_kernel, dtype, dict(UPCAST=upcast, BLK=16, TOK=64, TOK_P=64, G_P=16, D_P=128), A.decode_warps(128)),
        (A._decode_kernel, dtype, dict(UPCAST=upcast, BLK=16, TOK=64, TOK_P=64, G_P=16, D_P=64), A.decode_warps(64)),
        # the largest blocks `paged_prefill` launches: fp32 (upcast) 16 x 32, halves 64 x 64 (64 x 32 at D 128)
        (A._prefill_kernel, dtype, dict(UPCAST=upcast, BLK=16, D_P=64, BLOCK_M=16 if upcast else 64,
                                        BLOCK_N=32 if upcast else 64), 4),
        (A._prefill_kernel, dtype, dict(UPCAST=upcast, BLK=16, D_P=128, BLOCK_M=16 if upcast else 64, BLOCK_N=32), 4),
    ]
# the other LoRA candidates the microbenchmark times (lorafleet/bench/gpu_micro.py), in bf16
for cfg in L.CANDIDATES[1:]:
    cases += lora_cases("bf16", cfg)
# sm_90 (H100/H200): every case; sm_80 (A100): bf16
todo = [(90, c) for c in cases] + [(80, c) for c in cases if c[1] == "bf16"]
spills, scalar = [], []
for arch, (kernel, dtype, constexprs, warps) in todo:
    constexprs = {**constexprs, **{n: 1 for n in UNIT if n in kernel.arg_names}}
    sig = signature(kernel, dtype, constexprs)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if sig[n].startswith("*") or n in ALIGNED}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    assert compiled.asm["cubin"], kernel.__name__
    # ptxas -v on the kernel's PTX: its registers and spill stores (no GPU needed)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        info = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a" if arch == 90 else f"--gpu-name=sm_{arch}",
                               f.name, "-o", "/dev/null"], capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spilled = int(re.search(r"(\d+) bytes spill stores", info).group(1))
    print(f"sm_{arch} {kernel.__name__} {dtype} {constexprs} {warps} warps: {regs} registers, {spilled} spills: ok")
    if spilled and (arch == 90 or dtype != "fp32"):  # fp32 on an A100: spills allowed
        spills.append(f"{kernel.__name__} {dtype} {constexprs} {warps} warps: {spilled} spills")
    if "OUT_ALIGN" in constexprs:  # out's tile: written as 16-byte vectors only, never element by element
        stores = set(re.findall(r"\bst\.global\.[\w.]+", compiled.asm["ptx"]))
        if stores != {"st.global.v4.b32"}:
            scalar.append(f"sm_{arch} {kernel.__name__} {dtype} {constexprs}: {sorted(stores)}")
print(f"cases: {len(todo)}")
assert not spills, spills
assert not scalar, scalar
'''


def test_every_triton_kernel_compiles_to_a_cubin_for_sm90_and_sm80(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-4000:]
    cases = int(done.stdout.rsplit("cases: ", 1)[1])
    assert done.stdout.count(": ok") == cases > 0
