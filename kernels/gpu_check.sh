#!/usr/bin/env bash
# The GPU path's prepared checks, for a machine with one CUDA GPU, in the order a short lease
# wants them (each under its own deadline; the next runs whatever the last gave; logs and JSON
# in $OUT, or ./bench-results):
#   micro   lorafleet/bench/gpu_micro.py: each LoRA design against the read ceiling and the reference,
#           decode attention; decides lora_triton.CONFIG (at most 5 minutes)
#   quant   lorafleet/bench/gpu_micro.py --quant: the quantized projections (Llama-3-8B's qkv, o, gate_up,
#           down at T = 1, 8, 64): quant_triton int8/int4 against bf16 F.linear, torchao's int8/int4
#           weight-only and the copy bandwidth; decides quant_triton.CONFIG (at most 5 minutes).
#           torchao, if not installed, from a wheel in build/wheels/ (the machine has no network:
#           `pip download torchao --no-deps -d build/wheels` beforehand, and carry build/wheels)
#   tests   the Triton kernel tests compiled on the GPU, the engine's Triton path against the
#           torch path (greedy tokens, CUDA graphs on)
#   1b      `lorafleet bench gpu` on the 1b shape, batch 64
#   8b      `lorafleet bench gpu` on Llama-3-8B's shapes, batches 64 and 256 (weights made on the device)
#   8b-int4 the same base quantized in int4 at load, batch 64 (against 8b's bf16 figures)
#   smol    `smol` base-only against transformers
# Usage: bash kernels/gpu_check.sh [STAGE ...]   (no stage: all of them, as time allows)
# Run it from the repository root where lorafleet is installed (`pip install -e .`) with a CUDA
# torch. Split a lease into runs of at most 8 minutes: `micro tests`, then `quant`, then `1b 8b`.
set -uo pipefail
cd "$(dirname "$0")/.."
# LORAFLEET_DEVICE=cuda: the tests run on the GPU, and tests/conftest.py then skips building the C++
# CPU kernels (a minute or two of the lent machine)
export TRITON_INTERPRET=0 LORAFLEET_DEVICE=cuda PYTHONUNBUFFERED=1
out="${OUT:-bench-results}"
mkdir -p "$out"
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(micro tests quant 1b 8b 8b-int4 smol)
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
for s in "${stages[@]}"; do
    case "$s" in
        micro) stage micro 300 python3 -m lorafleet.bench.gpu_micro --out "$out" --deadline 270 ;;
        tests) stage tests 240 python3 -m pytest -q -p no:cacheprovider --maxfail=8 tests/kernels/test_triton_kernels.py \
                   tests/kernels/test_quant_triton.py tests/engine/test_triton_path.py tests/engine/test_async_decode.py ;;
        quant)
            if ! python3 -c 'import torchao' 2>/dev/null && ls build/wheels/torchao-*.whl >/dev/null 2>&1; then
                python3 -m pip install -q --no-deps --target build/pydeps build/wheels/torchao-*.whl \
                    && export PYTHONPATH="$PWD/build/pydeps${PYTHONPATH:+:$PYTHONPATH}"
            fi
            stage quant 300 python3 -m lorafleet.bench.gpu_micro --quant --out "$out" --deadline 270 ;;
        1b) stage bench-1b 240 lorafleet bench gpu --model 1b --batch 64 --out "$out/gpu-1b.json" ;;
        8b) stage bench-8b 300 lorafleet bench gpu --model 8b --batch 64 --batch 256 --out "$out/gpu-8b.json" ;;
        8b-int4) stage bench-8b-int4 300 lorafleet bench gpu --model 8b --quantize int4 --batch 64 --out "$out/gpu-8b-int4.json" ;;
        smol) stage base-only 120 lorafleet bench run --model smol --workload base-only \
                  --systems lorafleet,transformers --device cuda --out "$out/base-only.json" ;;
        *) echo "unknown stage $s (micro, tests, quant, 1b, 8b, smol)"; status=2 ;;
    esac
done
exit $status
