#!/usr/bin/env bash
# One device call for issue 32 (docs/gpu.md): the GPU studies, exclusive on the GPU, then the GPU tier
# in lanes whose JUnit files give every notebook's seconds per cell.
#   source .gpu/enter.sh && bash tools/gpu-study.sh
# Phase 1 (one at a time, timings): the chapters' GPU recorders, each writing data/reference/<name>_<gpu>.json:
#   roofline (ch11.record_roofline), memory (ch10.record_memory), questions (ch09.record_questions),
#   fp8gpt (ch11.record_fp8; torchao from .gpu/alt/, the first version whose float8 training imports and runs).
# Phase 2 (side by side): the ten chapters in three nbval lanes (4 CPU threads each) and
#   tests/ + exercises/ on 4 xdist workers (1 thread each); then tools/celltimes.py.
# Everything comes back as $OUT/gpu-study.tgz (data/reference/*.json and the logs).
set -u
T0=$SECONDS
DEADLINE=${DEADLINE:-580}
PHASE2_AT=${PHASE2_AT:-360}
OUT=${OUT:-/tmp/gpu-out}
LOGS=$OUT/logs
mkdir -p "$LOGS" data/reference
SUMMARY=$LOGS/summary.txt
left() { echo $((DEADLINE - (SECONDS - T0))); }
pack() { tar czf "$OUT/gpu-study.tgz" data/reference "$LOGS" 2>/dev/null; }
nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1
python3 -m course_lib.device > "$LOGS/device.txt" 2>&1
gpu=$(python3 -c "import re, torch; n = torch.cuda.get_device_name(0).lower().replace('nvidia', '') if torch.cuda.is_available() else 'cpu'
print(re.sub('[^a-z0-9]+', '-', n).strip('-'))")
echo "gpu=$gpu start $(date -u +%FT%TZ)" > "$SUMMARY"
study() {  # name cap module [args...]: python -m course_lib.chapters.<module> --json data/reference/<name>_<gpu>.json
  local name=$1 cap=$2 module=$3; shift 3
  local l=$(( PHASE2_AT - (SECONDS - T0) ))
  if [ "$l" -lt 30 ]; then echo "SKIP $name (phase 1 out of time)" >> "$SUMMARY"; return 0; fi
  [ "$cap" -gt "$l" ] && cap=$l
  local s=$SECONDS
  timeout -k 5 "$cap" python3 -m "course_lib.chapters.$module" --json "data/reference/${name}_$gpu.json" \
    --deadline $((cap * 6 / 10)) "$@" > "$LOGS/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - s))s (at $((SECONDS - T0))s)" >> "$SUMMARY"
  pack
}
study roofline 60 ch11.record_roofline
study memory 80 ch10.record_memory
study questions 190 ch09.record_questions --deadline 110
# torchao: the newest carried wheel whose float8 training runs on this torch
for whl in $(ls -r .gpu/alt/torchao-*.whl 2>/dev/null); do
  rm -rf /tmp/ao && python3 -m pip install -q --no-index --no-deps --target /tmp/ao "$whl" >/dev/null 2>&1
  if PYTHONPATH=/tmp/ao:${PYTHONPATH:-} timeout 60 python3 -c "
import torch; from torchao.float8 import convert_to_float8_training
m = torch.nn.Sequential(torch.nn.Linear(64, 64)).cuda()
convert_to_float8_training(m); m(torch.randn(32, 64, device='cuda')).sum().backward()" > "$LOGS/torchao-probe.log" 2>&1; then
    echo "torchao: $(basename "$whl")" >> "$SUMMARY"
    old_path=${PYTHONPATH:-}
    export PYTHONPATH=/tmp/ao:${PYTHONPATH:-}
    study fp8gpt 150 ch11.record_fp8
    export PYTHONPATH=$old_path
    break
  fi
  echo "torchao unusable: $(basename "$whl"): $(tail -1 "$LOGS/torchao-probe.log")" >> "$SUMMARY"
done
# Phase 2
NBVAL="--nbval-lax --nbval-current-env --nbval-cell-timeout=300 --nbval-sanitize-with tests/nbval_sanitize.cfg -p no:cacheprovider -rfE"
cap=$(( $(left) - 20 ))
lane() {  # name threads paths...
  local name=$1 th=$2; shift 2
  OMP_NUM_THREADS=$th COURSE_GPU_TIER=1 timeout -s INT -k 15 $cap python3 -m pytest "$@" $NBVAL \
    --junitxml="$LOGS/junit-$name.xml" > "$LOGS/test-$name.log" 2>&1
  echo "lane $name rc=$? at $((SECONDS - T0))s" >> "$SUMMARY"
}
lane a 4 notebooks/09_capstone.ipynb notebooks/02_autocast.ipynb notebooks/01_formats.ipynb &
lane b 4 notebooks/00_setup.ipynb notebooks/04_accumulation.ipynb notebooks/03_grad_scaler.ipynb notebooks/06_profiling.ipynb &
lane c 4 notebooks/05_multiple.ipynb notebooks/08_distributed.ipynb notebooks/07_loading.ipynb &
lane d 1 tests exercises -n 4 --dist loadfile &
wait
python3 tools/celltimes.py "$LOGS"/junit-a.xml "$LOGS"/junit-b.xml "$LOGS"/junit-c.xml "$LOGS"/junit-d.xml \
  --json "data/reference/celltimes_$gpu.json" \
  --note "nbval, COURSE_GPU_TIER=1; three notebook lanes (4 CPU threads each) beside tests/ + exercises/ on 4 workers" \
  > "$LOGS/celltimes.log" 2>&1
echo "end at $((SECONDS - T0))s" >> "$SUMMARY"
pack
cat "$SUMMARY"; tail -n 3 "$LOGS"/test-*.log
