#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU (run from the repository root):
#   scripts/gpu_check.sh [build|check|bench|all]      (default all)
# build:
#   1. ggml with CUDA: from a carried install prefix (.gpu/prefix.tar.xz, ~30 s) or built here
#      (~6 minutes on 16 cores); in the background, in their own sessions so that they outlive
#      the call: llama.cpp's libllama (CPU) for the adapter cross-check, and the benchmark's
#      models (CPU work: a bf16 HF checkpoint and three converter runs);
# check (builds first if needed):
#   2. pytrain doctor, and no CPU fallback in any training graph (tests/test_gpu.py);
#   3. the GPU tests: logits vs the HF/float64 goldens, LoRA gradients vs the PEFT goldens (one
#      graph and layer-wise recompute), a short training run, llama.cpp loading its adapter;
#   4. `pytrain train` of the demo config on device = "cuda";
# bench (builds first if needed, waits for the models):
#   5. scripts/bench_train.py --device cuda: pytrain (BF16/F16/Q8_0/Q4_K) and HF + PEFT (bf16)
#      at the Qwen3.5-2B shape, batch 4 x 1024, with per-op profiles -> train-cuda.json.
# Each phase is meant to fit one 10-minute call of the project's device tool: with a carried
# prefix run `check`, then `bench` at once while the machine is still warm (the build, the
# source and the models stay under /tmp between calls); without one, `build` first.
# Everything goes under $OUT (default ./gpu_out), at most 8 files: steps.log (each step's exit
# status and time), build.log, doctor.txt, gpu_tests.log, gpu_tests.xml, demo.log (with the
# run's metrics.jsonl), bench.log, train-cuda.json.  Made for the device tool (no package index
# there): first run `python scripts/gpu_carry.py [--prefix PREFIX]` here and carry `.gpu`.
set -uo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:-all}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
JOBS=$(nproc)
START=$(date +%s)
log() { echo "[gpu_check $PHASE +$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/steps.log"; }
step() {  # step NAME LOGFILE COMMAND...: run, log its exit status and time, keep going
  local name=$1 file=$2; shift 2
  local t0=$(date +%s)
  "$@" >> "$OUT/$file" 2>&1
  local rc=$?
  log "$name: exit $rc in $(( $(date +%s) - t0 )) s"
  return $rc
}

log "start on $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"
[ -f .gpu/commit ] && export PYTRAIN_COMMIT=$(cat .gpu/commit) && log "pytrain $PYTRAIN_COMMIT"
if [ -d .gpu/whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/pytrain-site .gpu/whl/*.whl && export PYTHONPATH=/tmp/pytrain-site
fi
export PYTRAIN_CACHE=${PYTRAIN_CACHE:-/tmp/pytrain-cache}
if [ -f .gpu/src.tar.xz ] && [ ! -d "$PYTRAIN_CACHE/src" ]; then
  mkdir -p "$PYTRAIN_CACHE/src" && tar -xJf .gpu/src.tar.xz -C "$PYTRAIN_CACHE/src"
fi
# a prefix built on another machine links cuBLAS by soname: point the loader at this
# machine's toolkit too
TOP=$(nvcc --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
[ -n "$TOP" ] && export LD_LIBRARY_PATH="$TOP/lib64:$TOP/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
MODELS_PID=/tmp/pytrain-models.pid
LLAMA_PID=/tmp/pytrain-llama.pid

background() {  # background NAME PIDFILE LOG COMMAND...: once, in its own session
  local name=$1 pidfile=$2 logfile=$3; shift 3
  if [ -f "$pidfile" ] && { kill -0 "$(cat "$pidfile")" 2>/dev/null || [ -f "$pidfile.rc" ]; }; then
    return 0
  fi
  setsid bash -c '"$@"; echo $? > '"$pidfile.rc" _ "$@" >> "$logfile" 2>&1 < /dev/null &
  echo $! > "$pidfile"
  log "$name: started in the background (pid $!)"
}

wait_for() {  # wait_for NAME PIDFILE LOG OUTFILE: until it ends; its log and exit status
  local name=$1 pidfile=$2 logfile=$3 file=$4 t0=$(date +%s)
  while [ ! -f "$pidfile.rc" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; do sleep 2; done
  cat "$logfile" >> "$OUT/$file" 2>/dev/null
  log "$name: exit $(cat "$pidfile.rc" 2>/dev/null || echo '?') (waited $(( $(date +%s) - t0 )) s)"
}

build() {
  background "llama.cpp libllama (CPU)" "$LLAMA_PID" /tmp/pytrain-llama.log \
    $PY scripts/build_llama_cpp.py --jobs 4     # leaves the cores to the CUDA build
  background "benchmark models" "$MODELS_PID" /tmp/pytrain-models.log \
    $PY scripts/bench_train.py --device cuda --make-only --types bf16,f16,q8_0
  if [ -f /tmp/pytrain-cuda-built ]; then
    return 0
  elif [ -f .gpu/prefix.tar.xz ]; then
    mkdir -p /tmp/pytrain-prefix && tar -xJf .gpu/prefix.tar.xz -C /tmp/pytrain-prefix
    step "ggml (carried CUDA prefix, cffi module here)" build.log \
      $PY native/build.py --cuda --prebuilt /tmp/pytrain-prefix/prefix --force || return 1
  else
    step "ggml with CUDA, $JOBS jobs" build.log \
      env PYTRAIN_BLAS=0 PYTRAIN_CUDA_ARCH=${PYTRAIN_CUDA_ARCH:-90} $PY native/build.py --cuda --jobs "$JOBS" || return 1
  fi
  touch /tmp/pytrain-cuda-built
}

check() {
  build || { log "build failed"; return 1; }
  wait_for "llama.cpp libllama (CPU)" "$LLAMA_PID" /tmp/pytrain-llama.log build.log
  step "pytrain doctor" doctor.txt $PY -m pytrain doctor
  step "GPU tests" gpu_tests.log \
    $PY -m pytest -v -s -m gpu tests/test_gpu.py --junitxml="$OUT/gpu_tests.xml"
  step "demo config on cuda" demo.log \
    $PY -m pytrain train config/demo.toml --no-progress --set model.device=cuda \
      --set output.dir=/tmp/pytrain-demo-cuda
  { echo "--- metrics.jsonl"; cat /tmp/pytrain-demo-cuda/metrics.jsonl; } >> "$OUT/demo.log" 2>&1
}

bench() {
  build || { log "build failed"; return 1; }
  wait_for "benchmark models" "$MODELS_PID" /tmp/pytrain-models.log bench.log
  step "benchmark (pytrain bf16/f16/q8_0/q4_k, HF + PEFT bf16)" bench.log \
    $PY scripts/bench_train.py --device cuda --timeout 240 --json "$OUT/train-cuda.json" \
      --out /tmp/train-cuda.md
}

case $PHASE in
  build) build ;;
  check) check ;;
  bench) bench ;;
  all) check; bench ;;
  *) echo "usage: $0 [build|check|bench|all]" >&2; exit 2 ;;
esac
log "done"
