# Sourced by the scripts/gpu_*.sh runners: the GPU machine lacks pyzmq, fastapi, uvicorn,
# pydantic and openai; wheels staged by ../shared/device/stage-wheels.sh travel in .whl and are
# installed into /tmp/site (no index, no dependency resolution). Then the checkout is importable.
export PYTHONUNBUFFERED=1
if [[ -d .whl ]] && ! python3 -c 'import zmq' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl 2>&1 | tail -3
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
