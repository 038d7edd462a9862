#!/usr/bin/env bash
# Session 32's device calls on the first prefill after a cold-cache start (first_prefill_*.txt;
# device tool: carry [".whl"] from ../shared/device/stage-wheels.sh):
#   bash benchmarks/results/h200/gpupath/first_prefill_calls.sh probe    # call 1
#   bash benchmarks/results/h200/gpupath/first_prefill_calls.sh site     # calls 2-6
#   bash benchmarks/results/h200/gpupath/first_prefill_calls.sh malloc   # call 7
#   bash benchmarks/results/h200/gpupath/first_prefill_calls.sh cpu      # call 9
#   bash benchmarks/results/h200/gpupath/first_prefill_calls.sh pmu      # session 33
#   bash benchmarks/results/h200/gpupath/first_prefill_calls.sh spin     # session 33
#   bash benchmarks/results/h200/gpupath/first_prefill_calls.sh dry      # session 33
# Each run of tests/test_no_compile_after_ready.py -k slower starts from an empty Triton cache
# (TRITON_CACHE_DIR fresh) unless it says warm; first_prefill_site/sitecustomize.py's switches
# say what each probe turn measures.
set -u
OUT=${OUT:-gpu_out}
source scripts/gpu_env.sh > /dev/null 2>&1
export TRITON_INTERPRET=0
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/machine.txt"
HERE=benchmarks/results/h200/gpupath
SITE=$PWD/$HERE/first_prefill_site

serve() {  # serve NAME CACHE_DIR [VAR=VALUE...]: the test once, its slow prefills and probes
  local name=$1 cache=$2; shift 2
  env "$@" PYTHONPATH="$PYTHONPATH:$SITE" TRITON_CACHE_DIR="$cache" timeout 200 python3 -m pytest \
    -q -s -p no:cacheprovider tests/test_no_compile_after_ready.py -k slower > "$OUT/$name.txt" 2>&1
  echo "== $name $*"
  grep -E "PROBE|PROFILE #0|slowest prefills \(|passed|failed" "$OUT/$name.txt" | cut -c1-300
}

case ${1:-probe} in
probe)  # the scheduler and worker in one process, then the Engine
  P=$HERE/first_prefill_probe.py; C=/tmp/cold_$RANDOM
  TRITON_CACHE_DIR=$C timeout 200 python3 $P > "$OUT/probe_cold.txt" 2>&1
  TRITON_CACHE_DIR=$C timeout 100 python3 $P > "$OUT/probe_warm.txt" 2>&1
  TRITON_CACHE_DIR=/tmp/cold_$RANDOM CUDA_MODULE_LOADING=EAGER timeout 200 python3 $P \
    > "$OUT/probe_cold_eager.txt" 2>&1
  grep -A4 "^prefill |" "$OUT"/probe_*.txt
  serve engine_cold /tmp/cold_$RANDOM ;;
site)
  C=/tmp/cold_$RANDOM
  serve early_cold "$C" DLLM_PROBE_PREFILL=1 DLLM_PROBE_EARLY=1
  serve early_warm "$C" DLLM_PROBE_PREFILL=1 DLLM_PROBE_EARLY=1
  serve plain /tmp/cold_$RANDOM
  serve lazy /tmp/cold_$RANDOM DLLM_PROBE_PREFILL=1
  C=/tmp/cold_$RANDOM
  serve profile_cold "$C" DLLM_PROBE_PREFILL=1 DLLM_PROBE_PROFILE=1
  serve profile_warm "$C" DLLM_PROBE_PREFILL=1 DLLM_PROBE_PROFILE=1
  serve items /tmp/cold_$RANDOM DLLM_PROBE_PREFILL=1 DLLM_PROBE_ITEMS=1 ;;
malloc)
  serve no_fastbins /tmp/cold_$RANDOM GLIBC_TUNABLES=glibc.malloc.mxfast=0
  serve trim /tmp/cold_$RANDOM DLLM_PROBE_TRIM=1 ;;
cpu)
  serve cpu_cold1 /tmp/cold_$RANDOM DLLM_PROBE_CPU=1
  serve cpu_cold2 /tmp/cold_$RANDOM DLLM_PROBE_CPU=1 ;;
pmu)  # hardware counters of each prefill launch: two cold starts, then one warm
  C=/tmp/cold_$RANDOM
  serve pmu_cold1 "$C" DLLM_PROBE_PMU=1
  serve pmu_warm "$C" DLLM_PROBE_PMU=1
  serve pmu_cold2 /tmp/cold_$RANDOM DLLM_PROBE_PMU=1 ;;
spin)  # a fixed loop timed five times before each early prefill launch
  serve spin_cold1 /tmp/cold_$RANDOM DLLM_PROBE_SPIN=1
  serve spin_cold2 /tmp/cold_$RANDOM DLLM_PROBE_SPIN=1
  serve spin_cold3 /tmp/cold_$RANDOM DLLM_PROBE_SPIN=1 ;;
dry)  # a served-path prefill before ready; then glibc malloc on transparent huge pages
  serve dry_cold1 /tmp/cold_$RANDOM DLLM_PROBE_DRY=1 DLLM_PROBE_CPU=1
  serve dry_cold2 /tmp/cold_$RANDOM DLLM_PROBE_DRY=1 DLLM_PROBE_CPU=1
  serve thp_cold1 /tmp/cold_$RANDOM GLIBC_TUNABLES=glibc.malloc.hugetlb=1 DLLM_PROBE_CPU=1
  serve thp_cold2 /tmp/cold_$RANDOM GLIBC_TUNABLES=glibc.malloc.hugetlb=1 DLLM_PROBE_CPU=1 ;;
esac
