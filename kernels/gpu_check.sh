#!/usr/bin/env bash
# The GPU path's one prepared check, for a machine with one CUDA GPU (245 s on an H200 on 2026-12-04):
#   1. the Triton kernel tests, compiled on the GPU (TRITON_INTERPRET=0), against the references;
#   2. the engine on the Triton kernels (with CUDA graphs) against the torch path, on the GPU;
#   3. `lorafleet bench gpu`: each kernel's time and bandwidth against the device's copy
#      bandwidth, decode throughput with 0 / 1 / 8 / 1,000 adapters and mixed vs uniform ranks,
#      decode-graph captures, replays and re-captures (JSON in $OUT or ./bench-results);
#   4. `smol` base-only against transformers on the GPU (the >= 10x goal), if time is left.
# Run it from the repository root in an environment where lorafleet is installed with a CUDA torch.
# Each stage has its own deadline and the next one runs whatever the last gave, so one run (a GPU
# may be lent for minutes) reports every stage; each stage's output also goes to a log in $out.
set -uo pipefail
cd "$(dirname "$0")/.."
# LORAFLEET_CPU_KERNELS=0: nothing here runs the C++ CPU kernels, whose build (tests/conftest.py
# builds them up front) would cost a minute or two of the lent machine
export TRITON_INTERPRET=0 LORAFLEET_DEVICE=cuda LORAFLEET_CPU_KERNELS=0 PYTHONUNBUFFERED=1
out="${OUT:-bench-results}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' || true
status=0
stage() {  # stage NAME SECONDS COMMAND...: run it under its deadline, logged; a failure fails the check
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name (deadline ${limit} s)"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: rc $rc in $((SECONDS - start)) s"
    [ "$rc" = 0 ] || status=1
}
stage tests 200 python3 -m pytest -q -p no:cacheprovider --maxfail=8 tests/kernels/test_triton_kernels.py \
    tests/engine/test_triton_path.py
stage bench-gpu 300 lorafleet bench gpu --out "$out/gpu.json"
if [ "$SECONDS" -lt 420 ]; then
    stage base-only 120 lorafleet bench run --model smol --workload base-only --systems lorafleet,transformers \
        --device cuda --out "$out/base-only.json"
fi
exit $status
