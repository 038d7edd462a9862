#!/usr/bin/env bash
# Issue 6 part 2 on one H200, in ~8 minutes: (1) the GPU tests (every kernel test compiled, CUDA
# graphs, bs=1 sync-vs-FDFO parity and graph-vs-eager tokens), (2) the round roofline with
# graphs on (triton+graphs, triton eager, torch) at B=1,4,16,32,64 x prefix ~1k/~4k, (3) the
# engine end to end (scheduler + worker processes, FDFO, 16 and 64 concurrent requests; eager
# at 16 for comparison). Each stage has its own time limit and runs whatever the one before did.
#
#   bash scripts/gpu_perf_check.sh          # device tool: carry [".whl"]
#   STAGES="tests engine engine_default attention" TESTS=tests/test_engine_gpu.py \
#     bash scripts/gpu_perf_check.sh         # a subset of the stages / of the tests
#   ROOFLINE_ARGS="--backends triton+graphs --iters 5 --warmup 2" ENGINE_ARGS="--concurrency 16"
#     RUNTIME_ARGS=... RUNTIME_MINI_ARGS=... and *_LIMIT (seconds): what the roofline / engine /
#     runtime stages run, and for how long at most
#
# Optional stages (in STAGES only): moe_tune and runtime_profile (6b below); engine_default,
# the built-in trained model end to end (FDFO and sync at 16 requests, real weights, EOS
# honoured: where the time goes per round); attention,
# the attention kernel's launch sweep (benchmarks/attention_tune.py); runtime_default,
# runtime_depth (the same at --dllm-pipeline-depth auto) and runtime_mini, the runtime's
# benchmarks (benchmarks/runtime_bench.py, issue 12); sdar_roofline_8b,
# sdar_roofline_30b, sdar_engine_8b, sdar_engine_30b (issue 17).
#
# The GPU image lacks pyzmq (the engine's IPC): wheels staged here by
# ../shared/device/stage-wheels.sh travel in .whl and are installed into /tmp/site.
# What comes back under $OUT (at most 8 files): summary.md (machine, test tail, both tables),
# tests.log, roofline.json, engine_gpu.json, all.tar.gz (every log, profile and table).
set -u -o pipefail
OUT=${OUT:-gpu_out}
RUN=${RUN:-/tmp/gpu_perf_run}  # RUN=$OUT: every log comes back as it is written
[[ $RUN == "$OUT" ]] || rm -rf "$RUN"
mkdir -p "$OUT" "$RUN"
export TRITON_INTERPRET=0
source "$(dirname "$0")/gpu_env.sh"  # the wheels, PYTHONPATH
status=0
STAGES=${STAGES:-tests roofline engine}
TESTS=${TESTS:-tests/test_no_compile_after_ready.py tests/test_kernels_attention.py \
  tests/test_kernels_moe.py tests/test_kernels_step.py \
  tests/test_kernels_fused_ops.py tests/test_kernels_moe_sort.py tests/test_kernels_model.py \
  tests/test_cuda_graph.py tests/test_engine_gpu.py}
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
  python3 -c 'import sys, torch, triton, zmq; print(sys.version.split()[0], "torch",
    torch.__version__, "triton", triton.__version__, "pyzmq", zmq.__version__,
    torch.cuda.get_device_name())'
  git log -1 --format='%H %s' 2>/dev/null || true
} 2>&1 | tee "$RUN/machine.txt"

# 1. Tests: every kernel test compiled (small shapes + gpu-marked full shapes), then the
#    gpu-marked graph, dummy-load and engine tests.
# shellcheck disable=SC2086  # TESTS is a list of paths
stage tests ${TESTS_LIMIT:-240} python3 -m pytest -v --tb=short -p no:cacheprovider -rfEs \
  --durations=12 ${TEST_FLAGS:-} $TESTS

# 2. Roofline: graphs, eager Triton, plain PyTorch; profile tables at B=16, prefix 4k.
# shellcheck disable=SC2086  # *_ARGS are lists of flags
stage roofline ${ROOFLINE_LIMIT:-160} python3 benchmarks/round_roofline.py \
  ${ROOFLINE_ARGS:---iters 5 --warmup 2} --out "$RUN/roofline.json"

# 3. The engine end to end with random weights at LLaDA2.0-mini's shapes.
# shellcheck disable=SC2086
stage engine ${ENGINE_LIMIT:-200} python3 benchmarks/engine_gpu.py \
  ${ENGINE_ARGS:---concurrency 16 64 --graphs on off --eager-concurrency 16} \
  --max-new-tokens 128 --out "$RUN/engine_gpu.json"

# 4. (optional) The built-in trained model end to end, FDFO then sync: rounds, forwards, idle.
DEFAULT_MODEL=dllm_serve/assets/default_model
stage engine_default 120 bash -c "for m in fdfo sync; do python3 benchmarks/engine_gpu.py \
  --model-path $DEFAULT_MODEL --load-format auto --no-ignore-eos --mode \$m --concurrency 4 16 32 \
  --max-new-tokens 128 --out $RUN/engine_default_\$m.json || exit 1; done"

# 5. (optional) The attention kernel's launch sweep at B=16/32, prefix ~4k.
stage attention 150 python3 benchmarks/attention_tune.py --out "$RUN/attention_tune.json"

# 6. (optional) The runtime (issue 12): FDFO vs sync and W=2 vs W=1 on the built-in model;
#    FDFO vs sync at LLaDA2.0-mini's shapes with benchmarks/scheduled_denoise.py's schedules.
# shellcheck disable=SC2086
stage runtime_default ${RUNTIME_LIMIT:-300} python3 benchmarks/runtime_bench.py \
  ${RUNTIME_ARGS:---suite default-model default-heldout} --out "$RUN/runtime_default.json"
# the same with the worker's adaptive pipeline depth (--dllm-pipeline-depth auto), to compare
# shellcheck disable=SC2086
stage runtime_depth ${RUNTIME_LIMIT:-300} python3 benchmarks/runtime_bench.py \
  ${RUNTIME_ARGS:---suite default-model default-heldout} --pipeline-depth auto \
  --out "$RUN/runtime_depth_auto.json"
# shellcheck disable=SC2086
stage runtime_mini ${RUNTIME_MINI_LIMIT:-420} python3 benchmarks/runtime_bench.py \
  ${RUNTIME_MINI_ARGS:---suite mini-lognormal mini-histogram --repeats 2} \
  --out "$RUN/runtime_mini.json"

# 6b. (optional) The fused MoE launch sweep (benchmarks/moe_tune.py: prints a MOE_LAUNCHES
#     table for kernels/fused_moe.py), and a cProfile of the FDFO worker at 64 requests on the
#     built-in model (DLLM_SERVE_PROFILE_WORKER; a table per worker in runtime_profile/).
stage moe_tune ${MOE_TUNE_LIMIT:-300} python3 benchmarks/moe_tune.py --out "$RUN/moe_tune.json"
[[ " $STAGES " == *" runtime_profile "* ]] && mkdir -p "$RUN/runtime_profile"
stage runtime_profile 150 env DLLM_SERVE_PROFILE_WORKER="$RUN/runtime_profile/wprof" \
  python3 benchmarks/runtime_bench.py --suite default-model --concurrency 64 \
  --w2-concurrency 64 --prompts-per-slot 4 --repeats 1 --out "$RUN/runtime_profile/runtime.json"
for f in "$RUN"/runtime_profile/wprof.*; do  # a cumulative-time table beside each dump
  [[ -f $f && $f != *.txt ]] || continue
  python3 -c 'import pstats, sys
pstats.Stats(sys.argv[1]).sort_stats("cumulative").print_stats("dllm_serve", 45)' "$f" > "$f.txt"
done

# 7. (optional) SDAR (issue 17): the round roofline at SDAR-8B's / SDAR-30B-A3B's shapes (B=16 /
#    64, prefix ~1k / ~4k), the engine end to end at 64 and 128 requests. Its gpu tests:
#    TESTS="tests/test_kernels_sdar.py" TEST_FLAGS="-m gpu".
SDAR_ROOF=(--batch-sizes 16 64 --prefixes 1024 4096 --backends triton+graphs --iters 5
           --warmup 2 --profile 64 4096)
stage sdar_roofline_8b 240 python3 benchmarks/round_roofline.py --preset sdar-8b-shape \
  "${SDAR_ROOF[@]}" --out "$RUN/roofline_sdar_8b.json"
stage sdar_roofline_30b 300 python3 benchmarks/round_roofline.py --preset sdar-30b-a3b-shape \
  "${SDAR_ROOF[@]}" --out "$RUN/roofline_sdar_30b.json"
stage sdar_engine_8b 300 python3 benchmarks/engine_gpu.py --preset sdar-8b-shape \
  --concurrency 64 128 --max-new-tokens 128 --out "$RUN/engine_sdar_8b.json"
stage sdar_engine_30b 300 python3 benchmarks/engine_gpu.py --preset sdar-30b-a3b-shape \
  --concurrency 64 128 --max-new-tokens 128 --out "$RUN/engine_sdar_30b.json"

{
  echo "# gpu_perf_check $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo '```'; cat "$RUN/machine.txt"; echo '```'
  echo "## tests"; echo '```'
  grep -E ' (FAILED|ERROR)' "$RUN/tests.log" 2>/dev/null | head -n 20
  tail -n 20 "$RUN/tests.log" 2>/dev/null; echo '```'
  echo "## roofline"; cat "$RUN/roofline.md" 2>/dev/null || tail -n 30 "$RUN/roofline.log"
  for r in sdar_8b sdar_30b; do
    [[ -f $RUN/roofline_$r.md ]] && { echo "## roofline $r"; cat "$RUN/roofline_$r.md"; }
  done
  echo; echo "## engine"; echo '```'
  grep -h -E '^(fdfo|sync) graphs=|^graphs=.*startup|=== (sdar_)?engine' "$RUN"/*engine*.log
  echo '```'
  echo "## attention"; echo '```'; grep -h -E '^best|=== attention' "$RUN/attention.log"; echo '```'
  echo "## runtime"; echo '```'
  grep -h -E '^(default-|mini-|fdfo_over|w2_over)|=== runtime' "$RUN"/runtime*.log; echo '```'
  echo "## notes"; echo '```'
  grep -h -i -E 'capture failed|run eagerly|Traceback|Error:' "$RUN"/*.log | sort | uniq -c | head -n 15
  echo '```'
} > "$RUN/summary.md" 2>&1
if [[ $RUN != "$OUT" ]]; then
  cp "$RUN/summary.md" "$OUT/"
  for f in tests.log roofline.json engine_gpu.json attention_tune.json runtime_default.json \
    runtime_depth_auto.json runtime_mini.json moe_tune.json; do
    [[ -f $RUN/$f ]] && cp "$RUN/$f" "$OUT/"
  done
  tar -czf "$OUT/all.tar.gz" -C "$RUN" .
fi
cat "$RUN/summary.md"
exit $status
