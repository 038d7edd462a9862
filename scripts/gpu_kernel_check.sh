#!/usr/bin/env bash
# Issue 6 on the H200: the Triton kernel tests compiled on the GPU (small shapes and the
# gpu-marked LLaDA2.0-mini shapes), then the per-round roofline (triton vs plain PyTorch).
#
#   bash scripts/gpu_kernel_check.sh [tests|roofline|all] [extra args for round_roofline.py]
#
# Logs and results go under $OUT (the device tool's output folder; default ./gpu_out).
# Needs only what the GPU image has (torch, triton, pytest, numpy, safetensors, tokenizers).
set -u -o pipefail
STAGE=${1:-all}
shift || true
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TRITON_INTERPRET=0
status=0

{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c 'import sys, torch, triton; print(sys.version.split()[0], "torch", torch.__version__,
    "triton", triton.__version__, torch.cuda.get_device_name())'
} 2>&1 | tee "$OUT/machine.txt"

if [[ $STAGE == tests || $STAGE == all ]]; then
  timeout 420 python3 -m pytest -q -p no:cacheprovider -rs --durations=15 \
    tests/test_kernels_attention.py tests/test_kernels_moe.py tests/test_kernels_step.py \
    tests/test_kernels_model.py 2>&1 | tee "$OUT/kernel_tests.log" || status=1
fi

if [[ $STAGE == roofline || $STAGE == all ]]; then
  timeout 540 python3 benchmarks/round_roofline.py --out "$OUT/roofline.json" "$@" 2>&1 \
    | tee "$OUT/roofline.log" || status=1
fi
exit $status
