#!/usr/bin/env bash
# sglang-router (round robin) over two dllm-serve replicas of the built-in model on this CPU, a
# mixed load through it from SGLang's bench_serving (native /generate, completions and chat
# streams, one after the other), and how many requests each replica served.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
OUT=benchmarks/results/cpu/peer
SGL_PY=${SGL_PY:-python}
MODEL=$(python -c "from dllm_serve.default_model import resolve_model_path; print(resolve_model_path(None))")
pids=()
for PORT in 30001 30002; do
  python -m dllm_serve --port $PORT --max-running-requests 8 > "$OUT/router_replica_$PORT.log" 2>&1 &
  pids+=($!)
done
python -m sglang_router.launch_router --host 127.0.0.1 --port 30000 --policy round_robin \
  --worker-urls http://127.0.0.1:30001 http://127.0.0.1:30002 > "$OUT/router.log" 2>&1 &
pids+=($!)
trap 'kill ${pids[*]}; wait' EXIT
for PORT in 30001 30002; do until curl -sf http://127.0.0.1:$PORT/health > /dev/null; do sleep 1; done; done
until curl -sf http://127.0.0.1:30000/v1/models > /dev/null; do sleep 1; done
served() {  # requests each replica finished (its dllm:num_requests_total), as JSON
  python - <<'PY'
import json
import httpx
from prometheus_client.parser import text_string_to_metric_families
out = {}
for port in (30001, 30002):
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    out[port] = sum(s.value for f in text_string_to_metric_families(text)
                    for s in f.samples if s.name == "dllm:num_requests_total")
print(json.dumps(out))
PY
}
served > "$OUT/router_served_before.txt"
for BACKEND in sglang sglang-oai sglang-oai-chat; do
  echo "== router bench_serving $BACKEND" | tee "$OUT/router_bench_serving_$BACKEND.log"
  "$SGL_PY" -m sglang.bench_serving --backend "$BACKEND" --host 127.0.0.1 --port 30000 \
    --tokenizer "$MODEL" --dataset-name random-ids --random-input-len 64 --random-output-len 32 \
    --num-prompts 40 --request-rate 8 --max-concurrency 16 --seed 2 \
    --output-file "$OUT/router_bench_serving_$BACKEND.jsonl" >> "$OUT/router_bench_serving_$BACKEND.log" 2>&1
done
served | tee "$OUT/router_served_after.txt"
