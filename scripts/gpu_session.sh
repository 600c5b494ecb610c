#!/usr/bin/env bash
# One device call's worth of GPU measurements (issues 36 and 39), section by section, each
# under its own time limit so that a slow section leaves the others their time. Results go to
# $OUT (the device tool's folder), or runs/gpu_session when it is unset.
#
#   bash scripts/gpu_session.sh                 # on an H100/H200, about 8 minutes
#   FORCE=1 bash scripts/gpu_session.sh         # the same sections on the CPU, tiny sizes
#
# Sections, most wanted first (570 s in all):
#   1. the bf16 d1024 step: plain, detect only, in place (a cond per GEMM, the default) and
#      recompute (a cond); profiled as timed, then plain, detect only and in place again with
#      command buffers off, so that device time is attributed per instruction and per check;
#      then INFs injected (issue 39);
#   2. the Mosaic checked GEMM against cuBLAS at issue 36's four shapes, part by part, each
#      variant's kernels' device time from a profile beside its wall time (issue 36, item 2);
#   3. ABFT flash attention against cuDNN at seq 2048: the Triton kernels and `checked` over
#      cuDNN's (the Mosaic kernel only where it is not recorded as failing; issue 36, item 3);
#   4. the step with the Mosaic GPU kernels: its compile time and step time (issue 36, item 4);
#   5. alarms: the Mosaic checked GEMM on clean data, over K and the pipeline's depth, then on
#      the LM's attention contractions (scripts/gpu_clean_alarms.py; not in the default list);
#   6. step_alarms: the same kernel on the step's own attention scores, block by block, against
#      its emulation on cuBLAS's product (scripts/gpu_step_alarms.py; not in the default list);
#   7. flash_probe: the Mosaic flash kernel, piece by piece, each in a process of its own, to
#      find what fails on a GPU (scripts/gpu_flash_probe.py; not in the default list).
#
# SECTIONS picks and orders the sections (default "step kernels attention pallas_step");
# STEP_S, KERNELS_S, ATTENTION_S, PALLAS_S, ALARMS_S, STEP_ALARMS_S and FLASH_PROBE_S their
# time limits;
# KERNEL_SHAPES ("|" between shapes) the kernels section's shapes (default: issue 36's four and
# the attention scores); STEP_LOOP ("|" between names) step variants also timed as a training
# loop, their state donated and fed back (bench_gpu.py --loop; default none); KERNEL_VARIANTS ("|" between names) what the kernels section times
# beside cuBLAS (default: every variant, bench_gpu_kernels.GEMM_VARIANTS); PALLAS_VARIANTS ("|"
# between names) the pallas step's checked variants (default "in place, pallas").
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
step() {
  local loop=()
  [[ -n "${STEP_LOOP:-}" ]] && IFS='|' read -ra loop <<<"$STEP_LOOP"
  section step "${STEP_S:-300}" "$python" bench_gpu.py "${force[@]}" --dtypes bfloat16 \
    --rounds 5 --no-gemms --variants plain "detect only" "in place" recompute \
    --loop "${loop[@]}" \
    --trace "${TRACE_DIR:-/tmp/sdcguard_trace}" --attribute plain "detect only" "in place" \
    --inject "in place" recompute --out "$out/step.json"
}
kernels() {
  local args=(--rounds 5 --device-time "${TRACE_DIR:-/tmp/sdcguard_trace}/kernels")
  if [[ "${FORCE:-0}" == 1 ]]; then
    args+=(--force)
  else  # the four shapes of issue 36, in its order, and one head's attention scores
    local shapes=(8192x1024x4096 8192x4096x1024 "lm logits" "lm logits grad_rhs" \
      "lm attention scores")
    [[ -n "${KERNEL_SHAPES:-}" ]] && IFS='|' read -ra shapes <<<"$KERNEL_SHAPES"
    args+=(--shapes "${shapes[@]}")
  fi
  if [[ -n "${KERNEL_VARIANTS:-}" ]]; then
    local variants
    IFS='|' read -ra variants <<<"$KERNEL_VARIANTS"
    args+=(--variants "${variants[@]}")
  fi
  section kernels "${KERNELS_S:-150}" "$python" bench_gpu_kernels.py "${args[@]}" \
    --out "$out/kernels.json"
}
attention() {
  section attention "${ATTENTION_S:-60}" "$python" bench_gpu_attention.py --seqs 2048 \
    --rounds 5 --inner 3 --out "$out/attention.json"
}
pallas_step() {
  local variants
  IFS='|' read -ra variants <<<"${PALLAS_VARIANTS:-in place, pallas}"
  section pallas_step "${PALLAS_S:-60}" "$python" bench_gpu.py "${force[@]}" \
    --dtypes bfloat16 --rounds 3 --no-gemms --variants plain "${variants[@]}" --inject \
    --out "$out/pallas_step.json"
}
alarms() {
  section alarms "${ALARMS_S:-120}" bash -c "'$python' gpu_clean_alarms.py --sweep && \
    '$python' gpu_clean_alarms.py"
}
step_alarms() {
  section step_alarms "${STEP_ALARMS_S:-90}" "$python" gpu_step_alarms.py "${force[@]:0:1}"
}
flash_probe() {
  section flash_probe "${FLASH_PROBE_S:-120}" "$python" gpu_flash_probe.py "${force[@]:0:1}" \
    --out "$out/flash_probe.json"
}
for name in ${SECTIONS:-step kernels attention pallas_step}; do
  case $name in
    step | kernels | attention | pallas_step | alarms | step_alarms | flash_probe) "$name" ;;
    *) echo "unknown section $name (step, kernels, attention, pallas_step, alarms," \
      "step_alarms, flash_probe)" >&2 ;;
  esac
done
ls -la "$out"
