#!/usr/bin/env bash
# What session 30 left for the device, in two calls of under ten minutes each (device tool:
# carry [".whl"] from ../shared/device/stage-wheels.sh):
#   bash benchmarks/results/h200/gpupath/next_calls.sh table    # issue 15's table + GPU tests
#   bash benchmarks/results/h200/gpupath/next_calls.sh replay   # next_replay_at_capture.patch A/B
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
replay)
  alt=/tmp/replay_at_capture
  rm -rf "$alt" && cp -r "$PWD" "$alt" \
    && (cd "$alt" && git apply benchmarks/results/h200/gpupath/next_replay_at_capture.patch) \
    || { echo "patch failed"; exit 1; }
  for turn in 1 2; do
    for tree in "$PWD" "$alt"; do
      (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout 120 python3 -m pytest -q \
        -p no:cacheprovider -s tests/test_no_compile_after_ready.py 2>&1 \
        | grep -a "startup\|slowest\|AssertionError\|passed\|failed" \
        | sed "s|^|turn $turn $(basename "$tree"): |") | tee -a "$OUT/replay_ab.txt"
    done
  done ;;
esac
