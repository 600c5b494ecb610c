#!/usr/bin/env bash
# One device call's worth of GPU measurements (issues 36 and 39), section by section, each
# under its own time limit so that a slow section leaves the others their time. Results go to
# $OUT (the device tool's folder), or runs/gpu_session when it is unset.
#
#   bash scripts/gpu_session.sh                 # on an H100/H200, about 8 minutes
#   FORCE=1 bash scripts/gpu_session.sh         # the same sections on the CPU, tiny sizes
#
# Sections, most wanted first:
#   1. the bf16 d1024 step: plain, detect only, in place (cond, the default) and branch-free,
#      recompute (cond, the default) and in a loop; INFs injected; per-instruction profiles of
#      detect only and in place with command buffers off (issue 39);
#   2. the step with the Mosaic GPU kernels: its compile time and step time (issue 36, item 4);
#   3. the Mosaic checked GEMM against cuBLAS, part by part, with a profile of one shape
#      (issue 36, item 2).
set -u
cd "$(dirname "$0")"
out="${OUT:-../runs/gpu_session}"
python="${PYTHON:-python}"
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:-}:$PWD/..:$PWD"
force=()
if [[ "${FORCE:-0}" == 1 ]]; then
  force=(--force --size tiny)
fi

section() {  # section NAME SECONDS COMMAND...
  local name=$1 seconds=$2
  shift 2
  echo "=== $name (at most ${seconds} s) ==="
  local start=$SECONDS
  timeout --signal=INT "$seconds" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$out/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - start)) s ==="
}

section step 330 "$python" bench_gpu.py "${force[@]}" --dtypes bfloat16 --rounds 5 --no-gemms \
  --variants plain "detect only" "in place" "in place, branch-free" recompute "recompute, while" \
  --inject "in place" recompute --trace "$out/trace" --attribute "detect only" "in place" \
  --out "$out/step.json"
section pallas_step 120 "$python" bench_gpu.py "${force[@]}" --dtypes bfloat16 --rounds 3 \
  --no-gemms --variants plain "in place, pallas" --inject --out "$out/pallas_step.json"
kernels_force=()
if [[ "${FORCE:-0}" == 1 ]]; then
  kernels_force=(--force)
fi
section kernels 120 "$python" bench_gpu_kernels.py "${kernels_force[@]}" --rounds 5 \
  --out "$out/kernels.json"
ls -la "$out"
