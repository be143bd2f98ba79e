#!/usr/bin/env bash
# The host-CPU sweep of memopt-kernels-cpu in one command (run from the repository root on a
# machine with torch, pybind11, scikit-build-core, cmake and ninja; no network needed): build the
# extension into a private target, run its tests, then the CPU step benchmark side by side with
# torch's fused AdamW at several thread counts. Logs and the reports (bench_t<threads>.md) go to
# ${OUT:-/tmp/memopt-cpu-sweep}.
set -o pipefail
OUT=${OUT:-/tmp/memopt-cpu-sweep}
mkdir -p "$OUT"
ROOT=$(pwd)
SITE=${SITE:-/tmp/memopt-cpu-site}
export PYTHONUNBUFFERED=1
start=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps --no-index --target "$SITE" \
  "$ROOT/packages/memopt-kernels-cpu" 2>&1 | tail -5 | tee "$OUT/build.log"
echo "build: $(( $(date +%s) - start )) s" | tee -a "$OUT/build.log"
export PYTHONPATH=$SITE:$ROOT/packages/memopt-core/src:$ROOT/packages/memopt-ecc/src${PYTHONPATH:+:$PYTHONPATH}
# DeepSpeed's CPUAdam row, offline: wheels of deepspeed and its dependencies in $DS_WHEELS
# (e.g. `pip download deepspeed` and its requirements for the host's Python, carried along); its
# C++ op is built with ninja when the row first constructs it
DS_WHEELS=${DS_WHEELS:-$ROOT/.whl/ds}
if ls "$DS_WHEELS"/deepspeed-*.whl >/dev/null 2>&1; then
  wheels=$(ls "$DS_WHEELS"/*.whl)  # numpy only where the host has none (never shadow its own)
  python3 -c "import numpy" 2>/dev/null && wheels=$(echo "$wheels" | grep -v /numpy-)
  python3 -m pip install -q --no-deps --no-index --target "$SITE-ds" $wheels 2>&1 | tail -3
  export PYTHONPATH=$PYTHONPATH:$SITE-ds
fi
python3 -c "import memopt_kernels_cpu as k, torch; print('isa', k.get_isa(), 'of', k.supported_isas(), 'threads', k.get_num_threads(), 'features', k.cpu_features(), 'torch', torch.__version__)" | tee "$OUT/env.log"
lscpu | grep -E "Model name|^CPU\(s\)|NUMA node\(s\)|L3" | tee -a "$OUT/env.log"
(cd packages/memopt-kernels-cpu && timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider \
  -n "${WORKERS:-8}" -p no:benchmark --durations=8 2>&1 | tail -25) | tee "$OUT/tests.log"
echo "pytest exit: $?"
# the issue's sizes (64M, 256M) and the many-small and Qwen profiles at the full thread count;
# 64M alone at fewer threads
bench() {  # threads profiles scale
  timeout "${BENCH_TIMEOUT:-240}" python3 tools/bench/step_bench.py --device cpu --threads "$1" \
    --profiles "$2" --scale "$3" --iters 5 --max-seconds 4 \
    --optimizers adamw,adamw-foreach,adamw-bf16,memopt-fp32,memopt-q8,memopt-bf16,memopt-fp8,memopt-ecc32-q8,flash-adamw,deepspeed-cpuadam \
    --out "/tmp/memopt-cpu-bench-t$1-s$3" 2>&1 | tail -40
  cp "/tmp/memopt-cpu-bench-t$1-s$3/step_bench.md" "$OUT/bench_t$1_s$3.md"
}
bench "${THREADS:-16}" "${PROFILES:-64M,256M,qwen2.5-0.5b}" 1
bench "${THREADS:-16}" 4096x32K 4
for t in ${FEW_THREADS:-4 1}; do bench "$t" 64M 1; done
echo "sweep: $(( $(date +%s) - start )) s"
