#!/usr/bin/env bash
# Issue 15's table and three GPU test files in one device call of under ten minutes (device
# tool: carry [".whl"] from ../shared/device/stage-wheels.sh):
#   bash benchmarks/results/h200/gpupath/next_calls.sh table
# (Its `replay` mode, session 30's first-replay A/B, ran in session 31 and is gone: README.)
# Everything lands in $OUT (machine.txt first: the tables count only on an H200).
set -u
OUT=${OUT:-gpu_out}
source scripts/gpu_env.sh > /dev/null 2>&1
export TRITON_INTERPRET=0
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/machine.txt"
case ${1:-table} in
table)
  timeout 330 python3 benchmarks/round_roofline.py --backends triton+graphs --iters 5 \
    --warmup 2 --out "$OUT/roofline.json" > "$OUT/roofline.log" 2>&1
  tail -16 "$OUT/roofline.log"
  timeout 220 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py \
    tests/test_engine_gpu.py tests/test_kernels_lm_head.py > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log" ;;
esac
