#!/usr/bin/env bash
# The step benchmark of ApexW (memopt-apexw) against torch AdamW and the peers, in one command
# from the repository root of an offline CUDA host with torch and triton: installs the carried
# wheels (.whl/: torchao, bitsandbytes, flashoptim; numpy from .whl/optional/ only where the host
# lacks it) and memopt's packages (memopt-kernels-cpu, which needs a build, left out) into $SITE
# and runs tools/bench/step_bench.py once per profile, each run under its own
# timeout and all of them within $SWEEP_SECONDS, so that one stuck row cannot eat the device call.
# The slow peer (torchao's AdamW8bit: compiles per shape, about 3 s a step on 4096x32K) runs in a
# second pass, after the other rows of every profile. step_bench rewrites its report after every
# row, so a run stopped by its timeout keeps the rows it finished.
# Output: ${OUT:-/tmp/memopt-apexw-sweep}/<profile>[-slow]/step_bench.{md,json}, their logs, env.log,
# ApexW's mode cache (apexw-modes.json) and the merged step_bench.md / step_bench.json. Defaults fit
# one device call (SWEEP_SECONDS); PROFILES="..." runs fewer profiles, ROWS/SLOW_ROWS fewer rows.
set -o pipefail
OUT=${OUT:-/tmp/memopt-apexw-sweep}
mkdir -p "$OUT"
ROOT=$(pwd)
SITE=${SITE:-/tmp/s2}
export PYTHONUNBUFFERED=1
# ApexW's mode="auto" decisions (measured in this sweep) come back with the results
export MEMOPT_APEXW_CACHE=${MEMOPT_APEXW_CACHE:-$OUT/apexw-modes.json}
start=$(date +%s)
SWEEP_SECONDS=${SWEEP_SECONDS:-550}  # the whole sweep, install included (a device call has 600)
PROFILES=${PROFILES:-8x64M 4096x32K 16384x8K qwen2.5-0.5b resnet50}
ROWS=${ROWS:-adamw,adamw-bf16,apexw-bf16,apexw-q8,apexw-bf16-graph,apexw-q8-graph,apexw-auto-bf16,apexw-bf16-params,flashoptim-peer,bnb-adamw8bit}
SLOW_ROWS=${SLOW_ROWS-adamw,torchao-adamw8bit}  # adamw again: the "time / AdamW" base; empty: no pass
PROFILE_TIMEOUT=${PROFILE_TIMEOUT:-90}
SLOW_TIMEOUT=${SLOW_TIMEOUT:-45}
BENCH_ARGS=${BENCH_ARGS:---iters 20 --max-seconds 1}
DEVICE=${DEVICE:-cuda}  # cpu (with BENCH_ARGS="--scale 4096 ...") only to try the script itself

wheels=$(cd "$ROOT" && ls .whl/*.whl 2>/dev/null | xargs -n1 basename | sort)
if [ "$(cat "$SITE/.carried-wheels" 2>/dev/null)" != "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$ROOT"/.whl/*.whl \
    2>&1 | tail -3
  echo "$wheels" > "$SITE/.carried-wheels"
fi
if ! python3 -c "import numpy" 2>/dev/null; then  # bitsandbytes imports it
  if ls "$ROOT"/.whl/optional/numpy-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
      "$ROOT"/.whl/optional/numpy-*.whl 2>&1 | tail -3
  else
    echo "no numpy on this host and none carried: the bitsandbytes row will be skipped"
  fi
fi
# The packages are installed, not put on PYTHONPATH as src folders: their .dist-info registers the
# kernel backends' entry points, without which ApexW(mode="fused") finds no backend on a fresh
# checkout (src/*.egg-info is not in the repository).
PKGS=()
for d in "$ROOT"/packages/*/; do
  case $d in */memopt-kernels-cpu/) continue ;; esac
  PKGS+=("$d")
done
python3 -m pip install -q --no-build-isolation --no-deps --no-index --no-compile --target "$SITE" \
  "${PKGS[@]}" 2>&1 | tail -3
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true; } \
  | tee "$OUT/env.log"
python3 - <<'EOF' 2>&1 | grep -v Warning | tee -a "$OUT/env.log"
import importlib
for name in ("torch", "triton", "numpy", "torchao", "bitsandbytes", "flashoptim", "memopt_apexw"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "(no __version__)"))
    except Exception as exc:
        print(name, "cannot be imported:", type(exc).__name__, str(exc).splitlines()[0][:160])
EOF
echo "setup: $(( $(date +%s) - start )) s" | tee -a "$OUT/env.log"

# bench NAME ROWS TIMEOUT PROFILE: one step_bench run, cut to what is left of the sweep's time
bench() {
  local left=$(( SWEEP_SECONDS - ($(date +%s) - start) ))
  local limit=$(( $3 < left ? $3 : left ))
  if [ "$limit" -lt 15 ]; then
    echo "$1: not run, $left s left of SWEEP_SECONDS" | tee -a "$OUT/sweep.log"
    return
  fi
  # shellcheck disable=SC2086
  timeout -k 5 "$limit" python3 "$ROOT/tools/bench/step_bench.py" --device "$DEVICE" --profiles "$4" \
    --rows "$2" $BENCH_ARGS --out "$OUT/$1" 2>&1 | grep -v -E "Warning|warn\(" > "$OUT/$1.log"
  local rc=${PIPESTATUS[0]}
  grep -E "^ +[^ |]+ .*( ms|Error)|^skipping" "$OUT/$1.log" | tail -20
  local why=
  [ "$rc" = 124 ] && why=" (timed out after $limit s)"
  echo "$1: exit $rc$why at $(( $(date +%s) - start )) s" | tee -a "$OUT/sweep.log"
}

for p in $PROFILES; do bench "$p" "$ROWS" "$PROFILE_TIMEOUT" "$p"; done
if [ -n "$SLOW_ROWS" ]; then
  for p in $PROFILES; do bench "$p-slow" "$SLOW_ROWS" "$SLOW_TIMEOUT" "$p"; done
fi

# One report of every run: the first run's header with every run's skipped rows and versions,
# the rows in profile order (the slow runs without their repeated AdamW row); a row a timeout or
# the sweep's time limit left unmeasured is listed as such.
ROWS=$ROWS SLOW_ROWS=$SLOW_ROWS python3 - "$OUT" $PROFILES <<'EOF'
import json, math, os, sys
from pathlib import Path

sys.path.insert(0, "tools/bench")
import step_bench

out, profiles = Path(sys.argv[1]), sys.argv[2:]
wanted = {False: os.environ["ROWS"].split(","), True: os.environ["SLOW_ROWS"].split(",")}
labels = {c.name: c.label for c in step_bench.CONFIGS}
header, rows, runs, merged = None, [], [], {"skipped": {}, "versions": {}}
for p in profiles:
    for run, slow in ((p, False), (f"{p}-slow", True)):
        if slow and not os.environ["SLOW_ROWS"]:
            continue
        try:
            data = json.loads((out / run / "step_bench.json").read_text())
        except (OSError, ValueError):
            data = {"header": {"status": "not run"}, "rows": []}
        if "command" in data["header"]:
            header = header or dict(data["header"])
            runs.append(run)
        for key, seen in merged.items():
            for item in data["header"].get(key, "").split("; " if key == "skipped" else ", "):
                if item not in ("", "-", "none"):
                    seen[item] = None
        status = data["header"]["status"]
        got = {r["config"] for r in data["rows"]}
        got |= {s.split(":")[0] for s in data["header"].get("skipped", "").split("; ")}
        rows += [step_bench.Row(**r) for r in data["rows"] if not (slow and r["config"] == "adamw")]
        shapes = step_bench.PROFILES[p]
        for name in wanted[slow]:
            if name not in got and name in labels:
                why = "the run was stopped by its timeout" if status != "not run" else "not run"
                print(f"{run}: {name} not measured ({why}; see sweep.log)")
                rows.append(step_bench.Row(
                    p, name, labels[name], len(shapes), sum(math.prod(s) for s in shapes),
                    error=f"not measured: {why} (sweep.log)",
                ))
if header is not None:
    header["command"] = "bash tools/bench/apexw_gpu_sweep.sh (one step_bench.py run per profile)"
    header["status"] = "merged from the runs " + ", ".join(runs)
    header["skipped"] = "; ".join(merged["skipped"]) or "none"
    header["versions"] = ", ".join(merged["versions"]) or "-"
    header.pop("seconds", None)
    (out / "step_bench.md").write_text(step_bench.markdown(rows, header))
    (out / "step_bench.json").write_text(
        json.dumps({"header": header, "rows": [r.__dict__ for r in rows]}, indent=1)
    )
    print(step_bench.markdown(rows, header))
EOF
echo "sweep: $(( $(date +%s) - start )) s" | tee -a "$OUT/sweep.log"
