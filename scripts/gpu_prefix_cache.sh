#!/usr/bin/env bash
# The radix prefix cache on one GPU (issue 16): each workload with the cache on and off
# (--disable-radix-cache) in one run, on the Triton kernels + CUDA graphs:
#   1. GSM8K 5-shot with SGLang's protocol, the built-in model, 200 questions, FDFO, 16
#      requests, W=1: LowConfidence, then JointThreshold;
#   2. chat: 64 conversations of 4 turns on one system prompt (the built-in model);
#   3. LLaDA2.0-mini's shapes with random weights (--load-format dummy), GSM8K 5-shot, 64
#      questions: the prefill saved at a real model's size (random weights never stop early, so
#      every answer runs to --max-new-tokens; not SGLang's protocol).
# Writes JSON + logs under $OUT (default ./gpu_out); each stage has its own time limit.
#
#   bash scripts/gpu_prefix_cache.sh            # device tool: carry [".whl"]
set -u -o pipefail
RUN_TAIL=8
source "$(dirname "$0")/gpu_env.sh"  # the wheels, PYTHONPATH, OUT, FAST, run()
for ALGO in LowConfidence JointThreshold; do
  run "prefix_cache_gsm8k_$ALGO" 150 python3 -m benchmarks.prefix_cache gsm8k "${FAST[@]}" \
    --dllm-algorithm "$ALGO" --dllm-wavefront-size 1 --max-running-requests 16 \
    --num-questions 200 --output "$OUT/prefix_cache_gsm8k_$ALGO.json"
done
run prefix_cache_chat 150 python3 -m benchmarks.prefix_cache chat "${FAST[@]}" \
  --conversations 64 --turns 4 --max-running-requests 16 --output "$OUT/prefix_cache_chat.json"
MINI=/tmp/llada2-mini-shape
python3 -c "from dllm_serve.tools.tiny_checkpoint import build_tiny_checkpoint as b; \
b('$MINI', preset='llada2-mini-shape', weights=False)"
run prefix_cache_gsm8k_mini_shape 400 python3 -m benchmarks.prefix_cache gsm8k --device cuda \
  --attention-backend triton --moe-backend triton --model-path "$MINI" --load-format dummy --dllm-wavefront-size 1 --max-running-requests 16 \
  --num-questions 64 --max-new-tokens 128 --output "$OUT/prefix_cache_gsm8k_mini_shape.json"
exit $status
