#!/usr/bin/env bash
# Session 27, call 5: issue 12's table in one call (run 99's commands), worker_host.py on this host, issue 15's roofline.
set -u
source scripts/gpu_env.sh > /dev/null 2>&1
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv; lscpu | grep -E "Model name|^CPU\(s\)"; } > "$OUT/machine.txt" 2>&1
cat $OUT/machine.txt
t0=$SECONDS
P=benchmarks/results/h200/runtime/gap_probe.py
PROBE_OUT=$OUT/gaps_gsm.json timeout 150 python3 $P --suite default-model --interleave --settings fdfo sync --concurrency 4 16 32 64 --prompts-per-slot 4 --repeats 2 --out $OUT/gsm.json > $OUT/gsm.log 2>&1; echo "== gsm rc=$? at $((SECONDS-t0)) s"
PROBE_OUT=$OUT/gaps_heldout.json timeout 120 python3 $P --suite default-heldout --clients engine --concurrency 16 --w2-concurrency 16 --mini-concurrency 16 --prompts-per-slot 256 --interleave --repeats 5 --settings fdfo fdfo-w2 --out $OUT/heldout.json > $OUT/heldout.log 2>&1; echo "== heldout rc=$? at $((SECONDS-t0)) s"
PROBE_OUT=$OUT/gaps_mini.json timeout 200 python3 $P --suite mini-lognormal --settings fdfo sync --mini-concurrency 16 64 --prompts-per-slot 4 --repeats 1 --out $OUT/mini.json > $OUT/mini.log 2>&1; echo "== mini rc=$? at $((SECONDS-t0)) s"
timeout 40 python3 benchmarks/worker_host.py --running 64 --modes fdfo --mean-forwards 12 --max-new-tokens 256 --prompts-per-slot 4 --repeats 3 --messages --phases > $OUT/worker_host.log 2>&1; echo "== worker_host rc=$?"
for f in gsm heldout mini; do echo "--- $f"; grep -v '%|' $OUT/$f.log | grep -E "tok/s|over"; done
tail -1 $OUT/worker_host.log
timeout $((440-(SECONDS-t0))) python3 benchmarks/round_roofline.py --backends triton+graphs --batch-sizes 1 4 16 32 64 --prefixes 1024 4096 --iters 5 --warmup 2 --out $OUT/roofline.json > $OUT/roofline.log 2>&1; echo "== roofline rc=$? at $((SECONDS-t0)) s"
grep "^|" $OUT/roofline.log
cd $OUT && tar czf logs.tgz *.log machine.txt gaps_*.json && rm -f *.log machine.txt gaps_*.json
