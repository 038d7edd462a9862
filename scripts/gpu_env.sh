# Sourced by the scripts/gpu_*.sh runners: the GPU machine lacks pyzmq, fastapi, uvicorn,
# pydantic and openai; wheels staged by ../shared/device/stage-wheels.sh travel in .whl and are
# installed into /tmp/site (no index, no dependency resolution). Then the checkout is importable.
# Also: OUT (created), FAST (the GPU flags of the benchmark runners), status and run().
export PYTHONUNBUFFERED=1
if [[ -d .whl ]] && ! python3 -c 'import zmq' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl 2>&1 | tail -3
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
FAST=(--device cuda --attention-backend triton --moe-backend triton --max-total-tokens 2000000)
status=0
run() {  # run NAME SECONDS CMD...: one stage, its own log; a failure does not stop the rest
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1 || { echo "   exit $?"; status=1; }
  tr '\r' '\n' < "$OUT/$name.log" | grep -v '%|' | tail -n "${RUN_TAIL:-8}"
}
