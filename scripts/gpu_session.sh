#!/usr/bin/env bash
# One device call's worth of GPU measurements (issues 36 and 39), section by section, each
# under its own time limit so that a slow section leaves the others their time. Results go to
# $OUT (the device tool's folder), or runs/gpu_session when it is unset.
#
#   bash scripts/gpu_session.sh                 # on an H100/H200, about 8 minutes
#   FORCE=1 bash scripts/gpu_session.sh         # the same sections on the CPU, tiny sizes
#
# Sections, most wanted first (565 s in all):
#   1. the bf16 d1024 step: plain, detect only, in place (cond, the default) and branch-free,
#      recompute (cond, the default), in place and recompute with XLA recording conditionals in
#      its CUDA graphs; INFs injected; per-instruction profiles of detect only and in place with
#      command buffers off (issue 39);
#   2. the Mosaic checked GEMM against cuBLAS, part by part (issue 36, item 2);
#   3. ABFT flash attention (Mosaic) against cuDNN at seq 2048 (issue 36, item 3);
#   4. the step with the Mosaic GPU kernels: its compile time and step time (issue 36, item 4).
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
  timeout --signal=INT --kill-after=10 "$seconds" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$out/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - start)) s ==="
}

{ echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  "$python" -c "import jax; print('jax', jax.__version__, jax.devices())"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>/dev/null
} >"$out/device.txt" 2>&1
cat "$out/device.txt"
section step 300 "$python" bench_gpu.py "${force[@]}" --dtypes bfloat16 --rounds 5 --no-gemms \
  --variants plain "detect only" "in place" "in place, branch-free" \
  "in place, graph conditionals" recompute "recompute, graph conditionals" \
  --inject "in place" recompute --trace "${TRACE_DIR:-/tmp/sdcguard_trace}" --attribute "detect only" "in place" \
  --out "$out/step.json"
kernels_force=()
if [[ "${FORCE:-0}" == 1 ]]; then
  kernels_force=(--force)
fi
section kernels 100 "$python" bench_gpu_kernels.py "${kernels_force[@]}" --rounds 5 \
  --out "$out/kernels.json"
section attention 75 "$python" bench_gpu_attention.py --seqs 2048 --rounds 5 --inner 3 \
  --out "$out/attention.json"
section pallas_step 90 "$python" bench_gpu.py "${force[@]}" --dtypes bfloat16 --rounds 3 \
  --no-gemms --variants plain "in place, pallas" --inject --out "$out/pallas_step.json"
ls -la "$out"
