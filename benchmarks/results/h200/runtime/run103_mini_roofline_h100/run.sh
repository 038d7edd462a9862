#!/usr/bin/env bash
# Session 27, call 2 (same machine): its host, the mini table again (2 turns), worker_host.py on this host, the roofline at HEAD.
set -u
source scripts/gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv; lscpu | grep -E "Model name|^CPU\(s\)|MHz"; git log -1 --format='%H %s'; } > "$OUT/machine.txt" 2>&1
cat $OUT/machine.txt
t0=$SECONDS
P=benchmarks/results/h200/runtime/gap_probe.py
PROBE_OUT=$OUT/gaps_mini2.json timeout 260 python3 $P --suite mini-lognormal --settings fdfo sync --mini-concurrency 16 64 --prompts-per-slot 4 --repeats 2 --interleave --out $OUT/mini2.json > $OUT/mini2.log 2>&1; echo "== mini2 rc=$? at $((SECONDS-t0)) s"
grep -v '%|' $OUT/mini2.log | grep -E "tok/s|over" | tail -12
timeout 60 python3 benchmarks/worker_host.py --running 64 --modes fdfo --mean-forwards 12 --max-new-tokens 256 --prompts-per-slot 4 --repeats 3 --messages --phases > $OUT/worker_host.log 2>&1; echo "== worker_host rc=$?"; tail -2 $OUT/worker_host.log
timeout $((570-(SECONDS-t0))) python3 benchmarks/round_roofline.py --backends triton+graphs --batch-sizes 1 4 16 32 64 --prefixes 1024 4096 --iters 5 --warmup 2 --out $OUT/roofline.json > $OUT/roofline.log 2>&1; echo "== roofline rc=$? at $((SECONDS-t0)) s"
grep "^|" $OUT/roofline.log | head -20
