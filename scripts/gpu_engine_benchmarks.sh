#!/usr/bin/env bash
# The engine end to end on one GPU with the built-in trained model (issues 4, 5, 7), on the
# Triton kernels + CUDA graphs (the PyTorch path is launch-bound for a 7M-parameter model on a
# GPU: the first H200 attempt of these runs hit its time limits):
#   1. sync vs FDFO at max_running_requests 4/16/32 (128 GSM8K questions, LowConfidence, W=1);
#   2. wavefront packing vs lockstep (and W=1 FDFO) at 1/4/16 (JointThreshold, 256 generated
#      problems); both fastest of 3 timed runs after a warm-up over every prompt;
#   3. GSM8K with SGLang's protocol (200 questions, FDFO, 16 requests, W=1).
# Writes JSON + logs under $OUT (default ./gpu_out); each stage has its own time limit.
#
#   bash scripts/gpu_engine_benchmarks.sh            # device tool: carry [".whl"]
set -u -o pipefail
RUN_TAIL=14
source "$(dirname "$0")/gpu_env.sh"  # the wheels, PYTHONPATH, OUT, FAST, run()
HELD=benchmarks/results/default_model/heldout_seed7_256.jsonl
run fdfo_vs_sync 220 python3 -m benchmarks.offline_throughput "${FAST[@]}" --num-prompts 128 \
  --max-new-tokens 128 --modes sync fdfo --max-running-requests 4 16 32 --repeats 3 \
  --output "$OUT/fdfo_vs_sync.json"
run packing_vs_lockstep 250 python3 -m benchmarks.offline_throughput "${FAST[@]}" \
  --dllm-algorithm JointThreshold --data-path "$HELD" --num-prompts 256 --max-new-tokens 128 \
  --repeats 3 \
  --modes fdfo wavefront lockstep --max-running-requests 1 4 16 \
  --output "$OUT/packing_vs_lockstep.json"
run gsm8k 100 python3 -m benchmarks.gsm8k "${FAST[@]}" --dllm-wavefront-size 1 \
  --max-running-requests 16 --num-questions 200 --output "$OUT/gsm8k.json"
exit $status
