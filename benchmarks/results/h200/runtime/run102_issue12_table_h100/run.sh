#!/usr/bin/env bash
# Session 27, call 1: issue 12's table at HEAD (run 99's commands), then the engine-level GPU tests.
set -u
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/machine.txt"
lscpu | grep -m1 "Model name" >> "$OUT/machine.txt"; git log -1 --format='%H %s' >> "$OUT/machine.txt" 2>/dev/null
t0=$SECONDS
P=benchmarks/results/h200/runtime/gap_probe.py
PROBE_OUT=$OUT/gaps_gsm.json timeout 150 python3 $P --suite default-model --interleave --settings fdfo sync --concurrency 4 16 32 64 --prompts-per-slot 4 --repeats 2 --out $OUT/gsm.json > $OUT/gsm.log 2>&1; echo "== gsm rc=$? at $((SECONDS-t0)) s" | tee -a $OUT/all.log
PROBE_OUT=$OUT/gaps_heldout.json timeout 120 python3 $P --suite default-heldout --clients engine --concurrency 16 --w2-concurrency 16 --mini-concurrency 16 --prompts-per-slot 256 --interleave --repeats 5 --settings fdfo fdfo-w2 --out $OUT/heldout.json > $OUT/heldout.log 2>&1; echo "== heldout rc=$? at $((SECONDS-t0)) s" | tee -a $OUT/all.log
PROBE_OUT=$OUT/gaps_mini.json timeout 200 python3 $P --suite mini-lognormal --settings fdfo sync --mini-concurrency 16 64 --prompts-per-slot 4 --repeats 1 --out $OUT/mini.json > $OUT/mini.log 2>&1; echo "== mini rc=$? at $((SECONDS-t0)) s" | tee -a $OUT/all.log
timeout $((560-(SECONDS-t0))) python3 -m pytest -q -m gpu -x tests/test_engine_gpu.py tests/test_no_compile_after_ready.py tests/test_runtime_random.py tests/test_cuda_graph.py -k "not llada2_mini" > $OUT/gpu_tests.log 2>&1; echo "== tests rc=$? at $((SECONDS-t0)) s" | tee -a $OUT/all.log
tail -3 $OUT/gpu_tests.log
for f in gsm heldout mini; do echo "--- $f"; grep -v '%|' $OUT/$f.log | tail -12; done
