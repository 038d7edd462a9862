#!/usr/bin/env bash
# In-round kernel times of the LM head, served launch against the persistent one of
# tried_flat_persistent_632e3e4.patch (1 program per SM, 128 x 256 x 64, 8 warps, 4 stages):
# torch.profiler tables of three rounds at B = 16 and 64, prefix ~1k, each tree in turn. Ran at
# 17e0903, whose head was served one program a tile (the patch applies to that tree only; since
# then the persistent launch is served): head_inround_h100.txt, profile_head_*_h100.txt.
#   git checkout 17e0903 && OUT=dir bash benchmarks/results/h200/gpupath/head_inround_probe.sh
set -u
OUT=${OUT:-gpu_out}
here=$PWD
alt=/tmp/head_persistent
rm -rf "$alt" && cp -r "$here" "$alt" && cd "$alt" \
  && git apply benchmarks/results/h200/gpupath/tried_flat_persistent_632e3e4.patch \
  && sed -i 's/(1 << 30, HeadLaunch(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3))/(1 << 30, HeadLaunch(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4, persistent=1))/' dllm_serve/kernels/lm_head.py \
  && grep -q "persistent=1))" dllm_serve/kernels/lm_head.py || { echo "patch failed"; exit 1; }
for turn in 1 2; do
  for tree in served persistent; do
    dir=$here; [[ $tree == persistent ]] && dir=$alt
    for b in 16 64; do
      (cd "$dir" && PYTHONPATH=/tmp/site:$dir python3 benchmarks/round_roofline.py \
        --backends triton+graphs --batch-sizes $b --prefixes 1024 --iters 5 --warmup 2 \
        --profile $b 1024 --out /tmp/hp_${tree}_$b.json > /tmp/hp_${tree}_$b.log 2>&1)
      ms=$(grep -o "B= *$b prefix~ *1024: *[0-9.]* ms" /tmp/hp_${tree}_$b.log | grep -o "[0-9.]* ms")
      head=$(grep "_head_kernel" /tmp/profile_triton+graphs_B${b}_P1024.txt | awk '{print $(NF-2), $(NF-1)}')
      echo "turn $turn $tree B=$b round $ms head(total,avg) $head" | tee -a "$OUT/head_inround.txt"
      cp /tmp/profile_triton+graphs_B${b}_P1024.txt "$OUT/prof_${tree}_B${b}_t$turn.txt" 2>/dev/null
    done
  done
done
