#!/usr/bin/env bash
# Issue 17 on one H200: (1) the gpu-marked SDAR tests (kernels compiled at SDAR-8B's and
# SDAR-30B-A3B's shapes with 4-token blocks, Qwen3-MoE routing and experts, the step kernel at
# vocab 151936, CUDA graphs, bs=1 sync-vs-FDFO parity through the engine), (2) the round
# roofline at B=16/64 x prefix ~1k/~4k for SDAR-8B and SDAR-30B-A3B (random weights at the real
# shapes; triton+graphs and triton eager), (3) the engine end to end at 64 and 128 concurrent
# requests (SDAR-8B's shapes; FDFO, CUDA graphs, LowConfidence at 0.9, random weights).
#
#   bash scripts/gpu_sdar_check.sh                      # device tool: carry [".whl"]
#   STAGES="tests roofline_8b" bash scripts/gpu_sdar_check.sh
#
# Stages: tests roofline_8b roofline_30b engine_8b (default: all four); engine_30b is optional.
# The GPU image lacks pyzmq: wheels staged by ../shared/device/stage-wheels.sh travel in .whl.
# What comes back under $OUT: summary.md, tests.log, roofline_*.json / .md, engine_*.json.
set -u -o pipefail
OUT=${OUT:-gpu_out}
RUN=/tmp/gpu_sdar_run
rm -rf "$RUN" && mkdir -p "$OUT" "$RUN"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
if [[ -d .whl ]] && ! python3 -c 'import zmq' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl 2>&1 | tail -3
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
status=0
STAGES=${STAGES:-tests roofline_8b roofline_30b engine_8b}
stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log to $RUN/NAME.log
  local name=$1 limit=$2
  shift 2
  [[ " $STAGES " == *" $name "* ]] || return 0
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$RUN/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$RUN/$name.log"
  [[ $rc == 0 ]] || status=1
}

{
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv
  python3 -c 'import sys, torch, triton; print(sys.version.split()[0], "torch",
    torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
  git log -1 --format='%H %s' 2>/dev/null || true
} 2>&1 | tee "$RUN/machine.txt"

stage tests 300 python3 -m pytest -v --tb=short -p no:cacheprovider -rfEs --durations=12 \
  tests/test_kernels_sdar.py tests/test_kernels_moe.py tests/test_kernels_attention.py
ROOF=(--batch-sizes 16 64 --prefixes 1024 4096 --backends triton+graphs triton --iters 5
      --warmup 2 --profile 64 4096)
stage roofline_8b 240 python3 benchmarks/round_roofline.py --preset sdar-8b-shape "${ROOF[@]}" \
  --out "$RUN/roofline_8b.json"
stage roofline_30b 300 python3 benchmarks/round_roofline.py --preset sdar-30b-a3b-shape \
  "${ROOF[@]}" --out "$RUN/roofline_30b.json"
stage engine_8b 300 python3 benchmarks/engine_gpu.py --preset sdar-8b-shape --concurrency 64 128 \
  --max-new-tokens 128 --out "$RUN/engine_8b.json"
stage engine_30b 300 python3 benchmarks/engine_gpu.py --preset sdar-30b-a3b-shape \
  --concurrency 64 128 --max-new-tokens 128 --out "$RUN/engine_30b.json"

{
  echo "# gpu_sdar_check $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo '```'; cat "$RUN/machine.txt"; echo '```'
  echo "## tests"; echo '```'
  grep -E ' (FAILED|ERROR)' "$RUN/tests.log" 2>/dev/null | head -n 20
  tail -n 8 "$RUN/tests.log" 2>/dev/null; echo '```'
  for r in 8b 30b; do echo "## roofline $r"; cat "$RUN/roofline_$r.md" 2>/dev/null; echo; done
  echo "## engine"; echo '```'
  grep -h -E '^(fdfo|sync) graphs=|=== engine' "$RUN"/engine*.log 2>/dev/null; echo '```'
  echo "## notes"; echo '```'
  grep -h -i -E 'capture failed|run eagerly|Traceback|Error:' "$RUN"/*.log | sort | uniq -c | head
  echo '```'
} > "$RUN/summary.md" 2>&1
cp "$RUN"/summary.md "$RUN"/tests.log "$OUT/" 2>/dev/null
cp "$RUN"/roofline_*.json "$RUN"/roofline_*.md "$RUN"/engine_*.json "$OUT/" 2>/dev/null
cat "$RUN/summary.md"
exit $status
