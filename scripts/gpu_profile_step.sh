#!/usr/bin/env bash
# A short device call (about 4 minutes on an H200): where a checked step's device time and
# kernels go. The bf16 d1024 step, plain, detect only and in place: timed, profiled as timed and
# with command buffers off (device time per instruction and per check), and each variant's
# optimized HLO written out (the fusions XLA made, to read without a GPU).
#
#   bash scripts/gpu_profile_step.sh            # on an H100/H200; results in $OUT
#   FORCE=1 bash scripts/gpu_profile_step.sh    # the same on the CPU, tiny size
#
# VARIANTS, ATTRIBUTE and INJECT (bench_gpu.py's variant names, separated by "|") change what is
# timed, what is profiled with command buffers off, and what gets two injected INFs; ROUNDS the
# timing rounds; TRACE_TOP how many instructions each profile keeps in step.json.
set -u
cd "$(dirname "$0")"
out="${OUT:-../runs/gpu_profile_step}"
python="${PYTHON:-python}"
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:-}:$PWD/..:$PWD"
force=()
if [[ "${FORCE:-0}" == 1 ]]; then
  force=(--force --size tiny)
fi
{ echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  "$python" -c "import jax; print('jax', jax.__version__, jax.devices())"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>/dev/null
} >"$out/device.txt" 2>&1
cat "$out/device.txt"
IFS='|' read -ra variants <<<"${VARIANTS:-plain|detect only|in place}"
IFS='|' read -ra attribute <<<"${ATTRIBUTE:-plain|detect only|in place}"
IFS='|' read -ra inject <<<"${INJECT:-}"
timeout --signal=INT --kill-after=10 "${SECONDS_LIMIT:-240}" "$python" bench_gpu.py "${force[@]}" \
  --dtypes bfloat16 --rounds "${ROUNDS:-3}" --no-gemms --variants "${variants[@]}" \
  --trace "${TRACE_DIR:-/tmp/sdcguard_trace}" --attribute "${attribute[@]}" \
  --inject "${inject[@]}" --trace-top "${TRACE_TOP:-12}" --hlo "$out/hlo" --out "$out/step.json" \
  >"$out/step.log" 2>&1
echo "bench_gpu.py: exit $?"
grep -v "^│\|^┃\|^┡\|^└\|^┏" "$out/step.log" | tail -n 40
ls -la "$out" "$out/hlo"
