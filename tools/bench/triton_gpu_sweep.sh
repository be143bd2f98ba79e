#!/usr/bin/env bash
# The GPU sweep of memopt-kernels-triton in one command (run from the repository root on a CUDA
# host with torch + triton, no network needed): the gpu-marked tests, then the step benchmark.
# Logs go to ${OUT:-/tmp/memopt-triton-sweep}.
set -o pipefail
OUT=${OUT:-/tmp/memopt-triton-sweep}
mkdir -p "$OUT"
ROOT=$(pwd)
# installed, not src folders on PYTHONPATH: the .dist-info registers the triton backend's entry
# point (src/*.egg-info is not in the repository)
SITE=${SITE:-/tmp/memopt-triton-site}
python3 -m pip install -q --no-build-isolation --no-deps --no-index --no-compile --target "$SITE" \
  "$ROOT/packages/memopt-core" "$ROOT/packages/memopt-kernels-triton" 2>&1 | tail -3
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
cd packages/memopt-kernels-triton || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.log"
python3 -c "import triton, torch, numpy; print('triton', triton.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__)" | tee -a "$OUT/env.log"
WORKERS=${WORKERS:-12}
timeout "${TEST_TIMEOUT:-260}" python3 -m pytest -m gpu -n "$WORKERS" -q -p no:cacheprovider -p no:benchmark --durations=12 --maxfail=30 2>&1 | tee "$OUT/gpu_tests.log" | tail -60
echo "pytest exit: $?"
timeout "${BENCH_TIMEOUT:-170}" python3 "$ROOT/tools/bench/triton_kernel_bench.py" ${BENCH_ARGS:---sweep --iters 20} 2>&1 | tee "$OUT/bench.log"
echo "bench exit: $?"
