set -x
cd /tmp/clean
export OMP_NUM_THREADS=1
R=/tmp/cpu_final
M=/tmp/tiny-llada2
git log --oneline -1
sha256sum $M/model.safetensors dllm_serve/assets/default_model/model.safetensors
uptime
python -m benchmarks.offline_throughput --model-path $M --device cpu --num-prompts 64 --max-new-tokens 128 --max-running-requests 4 16 --modes sync fdfo wavefront --repeats 2 --output $R/tiny_offline.json 2>/dev/null
uptime
for MRR in 4 16; do for MODE in --no-dllm-fdfo --dllm-fdfo; do
python -m benchmarks.gsm8k --model-path $M --device cpu $MODE --max-running-requests $MRR --num-questions 50 --max-new-tokens 64 --output $R/tiny_gsm8k_${MODE#--}_mrr$MRR.json 2>/dev/null
uptime
done; done
python -m benchmarks.offline_throughput --device cpu --num-prompts 64 --max-new-tokens 128 --max-running-requests 4 16 --modes sync fdfo wavefront --repeats 2 --output $R/default_offline.json 2>/dev/null
uptime
for MRR in 4 16; do for MODE in --no-dllm-fdfo --dllm-fdfo; do
python -m benchmarks.gsm8k --device cpu $MODE --max-running-requests $MRR --num-questions 50 --output $R/default_gsm8k_${MODE#--}_mrr$MRR.json 2>/dev/null
uptime
done; done
python -m dllm_serve --device cpu --port 31234 --max-running-requests 16 --dllm-fdfo --dllm-wavefront-size 1 --log-level warning > $R/server.log 2>&1 &
SERVER=$!
until curl -sf http://127.0.0.1:31234/health > /dev/null; do sleep 1; done
python -m benchmarks.gsm8k --base-url http://127.0.0.1:31234 --num-questions 50 --output $R/default_gsm8k_server_fdfo_mrr16.json 2>/dev/null
uptime
python -m benchmarks.serving --base-url http://127.0.0.1:31234 --dataset gsm8k --num-prompts 50 --max-concurrency 16 --output $R/default_serving_gsm8k_c16.json 2>/dev/null
uptime
python -m benchmarks.serving --base-url http://127.0.0.1:31234 --dataset random --random-input-len 256 --random-output-len 64 --random-range-ratio 1.0 --request-rate 2 --num-prompts 32 --output $R/default_serving_random_rate2.json 2>/dev/null
uptime
kill $SERVER; wait $SERVER
python -m benchmarks.plot $R --out-dir $R/plots
