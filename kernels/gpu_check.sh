#!/usr/bin/env bash
# The GPU path's one prepared check, for a machine with one CUDA GPU (under 8 minutes on an H200):
#   1. the Triton kernel tests, compiled on the GPU (TRITON_INTERPRET=0), against the references;
#   2. the engine on the Triton kernels (with CUDA graphs) against the torch path, on the GPU;
#   3. `lorafleet bench gpu`: each kernel's time and bandwidth against the device's copy
#      bandwidth, decode throughput with 0 / 1 / 8 / 1,000 adapters and mixed vs uniform ranks,
#      decode-graph captures, replays and re-captures (JSON in $OUT or ./bench-results).
# Run it from the repository root in an environment where lorafleet is installed with a CUDA torch.
set -uo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=0 LORAFLEET_DEVICE=cuda
out="${OUT:-bench-results}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
status=0
timeout 240 python -m pytest -q -p no:cacheprovider -x tests/kernels/test_triton_kernels.py \
    tests/engine/test_triton_path.py || status=1
timeout 300 lorafleet bench gpu --out "$out/gpu.json" || status=1
exit $status
