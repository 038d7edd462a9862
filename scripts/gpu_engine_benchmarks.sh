#!/usr/bin/env bash
# The engine end to end on one GPU with the built-in trained model (issues 4, 5, 7):
# sync vs FDFO at max_running_requests 4/16/32, wavefront packing vs lockstep at 1/4/16, and
# GSM8K (SGLang's protocol) in process. Writes JSON + logs under $OUT (default ./gpu_out).
#
#   bash scripts/gpu_engine_benchmarks.sh
#
# On a machine without pyzmq & co., stage the wheels first (see shared/device/README.md) and
# put them on PYTHONPATH; this script only runs the benchmarks.
set -u -o pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
status=0
run() {  # run NAME TIMEOUT CMD...: one stage, its own log; a failure does not stop the rest
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1 || { echo "   failed ($?)"; status=1; }
  tail -n 12 "$OUT/$name.log"
}
run fdfo_vs_sync 150 python3 -m benchmarks.offline_throughput --device cuda --max-total-tokens 2000000 --num-prompts 128 \
  --max-new-tokens 128 --modes sync fdfo --max-running-requests 4 16 32 \
  --output "$OUT/fdfo_vs_sync.json"
run packing_vs_lockstep 150 python3 -m benchmarks.offline_throughput --device cuda --max-total-tokens 2000000 \
  --num-prompts 96 --max-new-tokens 128 --modes fdfo wavefront lockstep \
  --max-running-requests 1 4 16 --output "$OUT/packing_vs_lockstep.json"
run gsm8k 150 python3 -m benchmarks.gsm8k --device cuda --max-total-tokens 2000000 --dllm-wavefront-size 1 \
  --max-running-requests 16 --num-questions 200 --output "$OUT/gsm8k.json"
exit $status
