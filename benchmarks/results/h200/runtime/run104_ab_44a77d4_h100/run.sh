#!/usr/bin/env bash
# Session 27, call 3 (same machine): mini FDFO at 64, 44a77d4 (run 99's tree) against HEAD, alternating.
set -u
source scripts/gpu_env.sh
HERE=$PWD
for turn in 1 2; do
  for tree in old new; do
    if [[ $tree == old ]]; then cd tmp_gpu/old; export PYTHONPATH=/tmp/site:$HERE/tmp_gpu/old; else cd $HERE; export PYTHONPATH=/tmp/site:$HERE; fi
    PROBE_OUT=$OUT/gaps_${tree}_$turn.json timeout 120 python3 benchmarks/results/h200/runtime/gap_probe.py --suite mini-lognormal --settings fdfo --mini-concurrency 64 --prompts-per-slot 4 --repeats 1 --out $OUT/ab_${tree}_$turn.json > $OUT/ab_${tree}_$turn.log 2>&1
    echo "== $tree turn $turn rc=$?: $(grep -E 'tok/s' $OUT/ab_${tree}_$turn.log | tail -1)"
    cd $HERE
  done
done
