#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU that reaches no package index (the device tool's),
# from the repository root, with `.gpu/` made here first by `python -m scripts.gpu_carry
# --build-native` and carried:
#   scripts/gpu_check.sh [all|more|rehearse]      (default all)
# all: one call, ended by its own deadline (DEADLINE_S seconds from its start, default 540):
#   1. setup: the carried wheels (cffi, pycparser, gguf) into a site folder of their own, the
#      carried pytrain/_native unpacked (nothing is compiled; without one, ggml is built here,
#      ~6 minutes), the converter's source into the cache;
#   2. in the background, on every core: the benchmark's models at the Qwen3.5-2B shape (a bf16
#      HF checkpoint, the converter's BF16/F16/Q8_0 GGUFs, Q4_K re-encoded by ggml);
#   3. the gate: pytrain doctor, then the GPU tests of logits against the goldens, LoRA
#      gradients against PEFT's, and no CPU fallback in any training graph;
#   4. if the gate passed: the benchmark, one worker at a time (HF + PEFT bf16, pytrain bf16
#      recompute auto, bf16 layers, q4_k layers), each given WORKER_S (150) seconds or what is
#      left before the deadline; train-cuda.json and .md rewritten after each worker.
# more: a second call while the machine is still warm (the models stay under /tmp): the rest
#   of the GPU tests, the demo config on cuda, and the profiles.
# rehearse: on any machine, step 1, doctor, the GPU tests' collection and the demo config on
#   the CPU, then stop before the first step that needs a GPU (tests/test_bare_machine.py runs
#   it in an empty HOME and cache, with no package index, compiler headers or build folders).
# Everything goes under $OUT (default ./gpu_out): steps.log (each step's exit status and time),
# setup.log, doctor.txt, gpu_tests.log, gpu_tests.xml, bench.log, train-cuda.json and .md,
# demo.log (with the run's metrics.jsonl).
set -uo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:-all}
OUT=${OUT:-$PWD/gpu_out}
WORK=${PYTRAIN_GPU_WORK:-/tmp/pytrain-gpu}     # what outlives a call on a warm machine
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
START=$(date +%s)
DEADLINE=$(( START + ${DEADLINE_S:-540} ))
log() { echo "[gpu_check $PHASE +$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/steps.log"; }
step() {  # step NAME LOGFILE COMMAND...: run, log its exit status and time
  local name=$1 file=$2; shift 2
  local t0=$(date +%s)
  "$@" >> "$OUT/$file" 2>&1
  local rc=$?
  log "$name: exit $rc in $(( $(date +%s) - t0 )) s"
  return $rc
}
left() { echo $(( DEADLINE - $(date +%s) )); }
budget() { local b=$(( $(left) - $1 )); echo $(( b > 30 ? b : 30 )); }  # seconds, keeping $1 back

setup() {
  log "start on $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"
  [ -f .gpu/commit ] && export PYTRAIN_COMMIT=$(cat .gpu/commit) && log "pytrain $PYTRAIN_COMMIT"
  if [ -d .gpu/whl ]; then
    step "carried wheels" setup.log $PY -m pip install --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target "$WORK/site" --find-links .gpu/whl cffi pycparser gguf \
      || return 1
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export PYTRAIN_CACHE=${PYTRAIN_CACHE:-$WORK/cache}
  if [ -f .gpu/src.tar.xz ] && [ ! -d "$PYTRAIN_CACHE/src" ]; then
    mkdir -p "$PYTRAIN_CACHE/src" && tar -xJf .gpu/src.tar.xz -C "$PYTRAIN_CACHE/src"
  fi
  if [ -f pytrain/_native/build_info.json ]; then
    log "pytrain/_native: already there"
  elif [ -f .gpu/native.tar.xz ]; then
    step "carried pytrain/_native" setup.log tar -xJf .gpu/native.tar.xz -C pytrain/_native \
      || return 1
  else
    step "ggml with CUDA, built here" setup.log env PYTRAIN_BLAS=0 \
      PYTRAIN_CUDA_ARCH=${PYTRAIN_CUDA_ARCH:-90} $PY native/build.py --cuda --jobs "$(nproc)" \
      || return 1
  fi
  step "where each part comes from" setup.log $PY -c 'import sys, cffi, gguf, pytrain
from pytrain import ggml
print(sys.executable, sys.version.split()[0])
print("cffi", cffi.__version__, cffi.__file__)
print("gguf", gguf.__file__)
print("pytrain", pytrain.__file__)
print("native", ggml.NATIVE_DIR, "cuda" if ggml.build_info()["cuda"] else "cpu")'
}

models_start() {  # the benchmark's models, in their own session (they outlive this call)
  [ -f "$WORK/models.pid" ] && return 0
  setsid bash -c '"$@"; echo $? > '"$WORK/models.rc" _ \
    $PY -m scripts.bench_train --device cuda --make-only --types bf16,q4_k \
    >> "$WORK/models.log" 2>&1 < /dev/null &
  echo $! > "$WORK/models.pid"
  log "benchmark models: started in the background (pid $!)"
}

models_wait() {  # until they are made or the deadline; 0 when made
  while [ ! -f "$WORK/models.rc" ] && kill -0 "$(cat "$WORK/models.pid")" 2>/dev/null \
        && [ "$(left)" -gt 60 ]; do sleep 2; done
  cat "$WORK/models.log" >> "$OUT/bench.log" 2>/dev/null
  log "benchmark models: exit $(cat "$WORK/models.rc" 2>/dev/null || echo 'not yet')"
  [ "$(cat "$WORK/models.rc" 2>/dev/null)" = 0 ]
}

doctor() { step "pytrain doctor" doctor.txt $PY -m pytrain doctor; }

gate() {
  step "GPU tests: logits, PEFT gradients, no CPU fallback" gpu_tests.log \
    timeout "$(budget 200)" $PY -m pytest -v -s -m gpu tests/test_gpu.py \
      -k "logits or kept_weights or gradients_match_peft or stay_on_the_gpu or doctor" \
      --junitxml="$OUT/gpu_tests.xml"
}

bench() {
  models_wait || { log "no models, no benchmark"; return 1; }
  step "benchmark (HF + PEFT bf16; pytrain bf16 auto, bf16 layers, q4_k layers)" bench.log \
    $PY -m scripts.bench_train --device cuda --plan hf,bf16:auto,bf16:layers,q4_k:layers \
      --deadline "$DEADLINE" --timeout "${WORKER_S:-150}" --no-profile \
      --json "$OUT/train-cuda.json" --out "$OUT/train-cuda.md"
}

more() {
  step "GPU tests: the rest" gpu_tests_more.log \
    timeout "$(budget 60)" $PY -m pytest -v -s -m gpu tests/test_gpu.py \
      -k "not (logits or kept_weights or gradients_match_peft or stay_on_the_gpu or doctor)"
  step "demo config on cuda" demo.log \
    $PY -m pytrain train config/demo.toml --no-progress --set model.device=cuda \
      --set output.dir="$WORK/demo-cuda"
  { echo "--- metrics.jsonl"; cat "$WORK/demo-cuda/metrics.jsonl"; } >> "$OUT/demo.log" 2>&1
  step "pytrain plan on cuda" plan.log $PY -m pytrain plan config/demo.toml --device cuda
  step "pytrain profile on cuda" profile-step.log \
    $PY -m pytrain profile config/demo.toml --set model.device=cuda
  models_wait && step "profiles (pytrain bf16 auto, HF)" profile.log \
    $PY -m scripts.bench_train --device cuda --plan hf,bf16:auto --deadline "$DEADLINE" \
      --timeout "${WORKER_S:-150}" --json "$OUT/profile-cuda.json" --out "$OUT/profile-cuda.md"
}

rehearse() {
  doctor || return 1
  step "GPU tests collected" gpu_tests.log $PY -m pytest --collect-only -q -m gpu tests/test_gpu.py \
    || return 1
  step "demo config on the CPU" demo.log \
    $PY -m pytrain train config/demo.toml --no-progress --set model.device=cpu \
      --set train.max_steps=6 --set output.dir="$WORK/demo-cpu" || return 1
  log "stopped before the first step that needs a GPU"
}

rc=0
case $PHASE in
  all) setup && { models_start; doctor && gate; } && bench; rc=$? ;;
  more) setup && more; rc=$? ;;
  rehearse) setup && rehearse; rc=$? ;;
  *) echo "usage: $0 [all|more|rehearse]" >&2; exit 2 ;;
esac
log "done (exit $rc)"
exit $rc
