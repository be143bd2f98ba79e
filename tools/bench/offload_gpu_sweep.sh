#!/usr/bin/env bash
# The GPU-host run of memopt-offload in one command (from the repository root of an offline CUDA
# host with torch, pybind11, scikit-build-core, cmake and ninja): `nox -s gpu_tests` from the
# carried nox wheels (.whl/), then the Qwen2.5-0.5B end-to-end benchmark (tools/bench/offload_e2e.py)
# with torch AdamW, torchao's CPUOffloadOptimizer (carried wheel), DeepSpeed's ZeRO-Offload (carried
# wheels in .whl/ds/, if there) and every AdamBridge row, then
# the AdamBridge bf16 and compact rows again at fewer kernel threads. Logs and JSON go to
# ${OUT:-/tmp/memopt-offload-sweep}.
set -o pipefail
OUT=${OUT:-/tmp/memopt-offload-sweep}
mkdir -p "$OUT"
ROOT=$(pwd)
SITE=${SITE:-/tmp/memopt-offload-site}
export PYTHONUNBUFFERED=1
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$ROOT"/.whl/*.whl \
  2>&1 | tail -3
# DeepSpeed's ZeRO-Offload row, when its wheels and its dependencies' are carried in .whl/ds/
# (numpy only where the host has none: never shadow its own)
if ls "$ROOT"/.whl/ds/deepspeed-*.whl >/dev/null 2>&1; then
  wheels=$(ls "$ROOT"/.whl/ds/*.whl)
  python3 -c "import numpy" 2>/dev/null && wheels=$(echo "$wheels" | grep -v /numpy-)
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" $wheels 2>&1 | tail -3
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
if [ "${GPU_TESTS:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-330}" python3 -m nox -s gpu_tests 2>&1 \
    | grep -E "passed|failed|error|Error|nox >|FAILED" | tail -40 | tee "$OUT/gpu_tests.log"
  echo "gpu_tests: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu_tests.log"
fi
# the compiled kernels come from the build gpu_tests made (or a fresh one); the Triton kernels
# are installed too, since the device update finds them through their entry point
MK=${MK:-/tmp/memopt-offload-mk}
python3 -m pip install -q --no-build-isolation --no-deps --no-index --target "$MK" \
  "$ROOT/packages/memopt-kernels-cpu" "$ROOT/packages/memopt-kernels-triton" 2>&1 | tail -3
export PYTHONPATH=$MK:$ROOT/packages/memopt-core/src:$ROOT/packages/memopt-offload/src:$PYTHONPATH
timeout "${BENCH_TIMEOUT:-240}" python3 tools/bench/offload_e2e.py --json "$OUT/e2e.json" \
  ${ROWS:+--rows "$ROWS"} 2>&1 | grep -v SyntaxWarning | tail -60 | tee "$OUT/e2e.log"
for t in ${FEW_THREADS:-12}; do
  timeout "${BENCH_TIMEOUT:-240}" python3 tools/bench/offload_e2e.py --threads "$t" \
    --rows "${FEW_ROWS:-bridge-bf16,bridge-compact}" --json "$OUT/e2e_t$t.json" 2>&1 \
    | grep -v SyntaxWarning | tail -30 | tee "$OUT/e2e_t$t.log"
done
echo "sweep: $(( $(date +%s) - start )) s" | tee -a "$OUT/e2e.log"
