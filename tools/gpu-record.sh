#!/usr/bin/env bash
# One device call that records reference results and then runs the GPU tier (docs/gpu.md).
# On the GPU machine, in the checkout:   source .gpu/enter.sh && bash tools/gpu-record.sh [name ...]
# Names (default: all): formats_matmul autocast_policy autocast_memory scaler accumulation multi
#   bench matmul ladder_resnet50 ladder_gpt ladder_course ladder_optimizer ladder_ckpt profiling
#   loading ddp; and `tests` for the GPU tier. DEADLINE (s, default 540) bounds the whole call;
#   FIRST="tests/test_grader.py notebooks/04_accumulation.ipynb" puts those tests at the front.
# Everything comes back as ONE file, $OUT/gpu-run.tgz (data/reference/*.json and the logs): a
# device call returns only a few files, and the checkout on the device is replaced at every call.
# Unpack it in the checkout here: tar xzf gpu-run.tgz data/reference && git add data/reference
set -u
T0=$SECONDS
DEADLINE=${DEADLINE:-540}
OUT=${OUT:-/tmp/gpu-out}
LOGS=$OUT/logs
mkdir -p "$LOGS" data/reference
SUMMARY=$LOGS/summary.txt
want=" ${*:-all} "
nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1
python3 -m course_lib.device > "$LOGS/device.txt" 2>&1
gpu=$(python3 -c "import re, torch; n = torch.cuda.get_device_name(0).lower().replace('nvidia', '')
print(re.sub('[^a-z0-9]+', '-', n).strip('-'))")
echo "gpu=$gpu start $(date -u +%FT%TZ)" > "$SUMMARY"

pack() { tar czf "$OUT/gpu-run.tgz" data/reference "$LOGS" 2>/dev/null; }
left() { echo $((DEADLINE - (SECONDS - T0))); }
rec() {  # name cap module args...: python -m course_lib.chapters.<module args> --json data/reference/<name>_<gpu>.json
  local name=$1 cap=$2; shift 2
  [[ $want == *" all "* || $want == *" $name "* ]] || return 0
  local l; l=$(left)
  if [ "$l" -lt 25 ]; then echo "SKIP $name (no time left)" >> "$SUMMARY"; return 0; fi
  [ "$cap" -gt "$l" ] && cap=$l
  local s=$SECONDS
  timeout -k 5 "$cap" python3 -m course_lib.chapters."$@" --json "data/reference/${name}_$gpu.json" > "$LOGS/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - s))s (at $((SECONDS - T0))s)" >> "$SUMMARY"
  pack
}
# Side by side: results that are dtypes, memory and counts, not times.
rec formats_matmul 90 ch01.matmul error &
rec autocast_policy 90 ch02.autocast_policy &
rec autocast_memory 90 ch02.autocast_dtypes &
rec scaler 120 ch03.scaler &
rec accumulation 120 ch04.accumulation &
rec multi 150 ch05.multi &
wait
# One at a time: timings (on an H100: 40-60 s each, the ResNet-50 ladder longer).
rec bench 120 ch00.bench
rec matmul 90 ch02.matmul_speed
rec ladder_gpt 180 ch09.ladder gpt
rec ladder_course 120 ch09.ladder course
rec ladder_optimizer 60 ch09.ladder optimizer
rec ladder_ckpt 60 ch09.ladder checkpointing
rec profiling 120 ch06.profiling
rec loading 120 ch07.loading
rec ddp 120 ch08.distributed record
rec ladder_resnet50 300 ch09.ladder resnet50
# The GPU tier with the time left: one notebook per worker (pytest-xdist: bash tools/gpu-prepare.sh pytest-xdist).
if [[ $want == *" all "* || $want == *" tests "* ]] && [ "$(left)" -gt 60 ]; then
  s=$SECONDS
  # FIRST (paths, space-separated) run first: those a cut-short run would otherwise not reach
  paths=$(for f in ${FIRST:-} notebooks/*.ipynb exercises/*.ipynb tests/test_*.py; do echo "$f"; done | awk '!seen[$0]++')
  # One CPU thread per process: 12 workers (and their kernels) each starting 16 torch threads on 16
  # cores left the H200 run of 2026-11-26 CPU-bound, with chapter 00 unfinished after 229 s.
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} COURSE_GPU_TIER=1 timeout -s INT -k 20 $(($(left) - 15)) python3 -m pytest $paths \
    --nbval-lax --nbval-current-env --nbval-cell-timeout=300 --nbval-sanitize-with tests/nbval_sanitize.cfg \
    -p no:cacheprovider -n "${JOBS:-12}" --dist loadfile -rfE --junitxml="$LOGS/junit.xml" > "$LOGS/test-gpu.log" 2>&1
  echo "test-gpu rc=$? $((SECONDS - s))s" >> "$SUMMARY"
fi
echo "end at $((SECONDS - T0))s" >> "$SUMMARY"
pack
cat "$SUMMARY"
