#!/usr/bin/env bash
# SGLang's and lm-eval's own tools, unmodified, against a local dllm-serve (the built-in model,
# CPU). Outputs land beside this script. Needs: pip install -e ".[test]" lm-eval[api];
# sglang==0.5.23 --no-deps with the pure-Python modules its few_shot_gsm8k imports; its
# bench_serving also imports torchvision, so it runs from a venv ($SGL_PY) that has
# torch 2.14.1 + torchvision 0.29.1 (see benchmarks/README.md).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
OUT=benchmarks/results/cpu/peer
PORT=${PORT:-30000}
SGL_PY=${SGL_PY:-python}
MODEL=$(python -c "from dllm_serve.default_model import resolve_model_path; print(resolve_model_path(None))")
GSM8K=benchmarks/data/gsm8k/test.jsonl
python -m dllm_serve --port "$PORT" --max-running-requests 16 > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER; wait $SERVER' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 1; done

run() {  # name, command...: its output (stdout + stderr) in $OUT/name.log
  local name=$1; shift
  echo "== $name: $*" | tee "$OUT/$name.log"
  "$@" >> "$OUT/$name.log" 2>&1 || echo "FAILED: $name" | tee -a "$OUT/$name.log"
}

STEPS=${STEPS:-"gsm8k bench_serving lm_eval"}  # which groups to run
if [[ $STEPS == *gsm8k* ]]; then
run few_shot_gsm8k python -m sglang.test.few_shot_gsm8k --host 127.0.0.1 --port "$PORT" \
  --data-path "$GSM8K" --num-questions 50 --parallel 16
run gsm8k_ours python -m benchmarks.gsm8k --base-url "http://127.0.0.1:$PORT" \
  --num-questions 50 --parallel 16 --output "$OUT/gsm8k_ours_sglang_protocol.json"
fi
if [[ $STEPS == *bench_serving* ]]; then
for BACKEND in sglang sglang-oai sglang-oai-chat; do
  run "bench_serving_$BACKEND" "$SGL_PY" -m sglang.bench_serving --backend "$BACKEND" \
    --host 127.0.0.1 --port "$PORT" --tokenizer "$MODEL" --dataset-name random-ids \
    --random-input-len 64 --random-output-len 32 --num-prompts 40 --request-rate 4 \
    --max-concurrency 16 --seed 1 --output-file "$OUT/bench_serving_$BACKEND.jsonl"
done
fi
if [[ $STEPS == *lm_eval* ]]; then
# lm-eval's client gives up on a request after `timeout` s (default 300): 5-shot GSM8K answers
# of 256 tokens from a CPU server queue longer than that at 16 in flight.
ARGS="model=default_model,num_concurrent=8,max_retries=1,timeout=3600"
TASKS=$(mktemp -d)
python -m benchmarks.lm_eval_task --out "$TASKS"
run lm_eval_local_completions lm_eval --model local-completions --model_args \
  "$ARGS,base_url=http://127.0.0.1:$PORT/v1/completions" \
  --include_path "$TASKS" --tasks gsm8k_local --limit 20 --output_path "$OUT/lm_eval_completions"
run lm_eval_local_chat_completions lm_eval --model local-chat-completions --model_args \
  "$ARGS,base_url=http://127.0.0.1:$PORT/v1/chat/completions" \
  --include_path "$TASKS" --tasks gsm8k_local --limit 20 --apply_chat_template \
  --output_path "$OUT/lm_eval_chat"
fi
