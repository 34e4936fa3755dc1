#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU (run from the repository root):
#   scripts/gpu_check.sh [check|bench|all]      (default all)
# check:
#   1. ggml with CUDA: from a carried install prefix (.gpu/prefix.tar.xz) or built here;
#      llama.cpp's libllama (CPU) for the adapter cross-check; the benchmark's models are
#      started in the background (CPU work: an HF checkpoint and three converter runs);
#   2. pytrain doctor, and no CPU fallback in any training graph (tests/test_gpu.py);
#   3. the GPU tests: logits vs the HF/float64 goldens, LoRA gradients vs the PEFT goldens (one
#      graph and layer-wise recompute), a short training run, llama.cpp loading its adapter;
#   4. `pytrain train` of the demo config on device = "cuda".
# bench:
#   5. scripts/bench_train.py --device cuda: pytrain (BF16/F16/Q8_0/Q4_K) and HF + PEFT (bf16)
#      at the Qwen3.5-2B shape, batch 4 x 1024, with a per-op profile -> train-cuda.json.
# Each phase fits one 10-minute call of the project's device tool: run `check`, then `bench`
# at once while the machine is still warm (the build, the source and the models stay under
# /tmp between calls; `bench` on a fresh machine builds what it needs first).
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

build() {
  if $PY -c "import pytrain.ggml as g, sys; sys.exit(0 if g.Runtime('cuda') else 1)" 2>/dev/null; then
    log "ggml with CUDA: already built"
  elif [ -f .gpu/prefix.tar.xz ]; then
    mkdir -p /tmp/pytrain-prefix && tar -xJf .gpu/prefix.tar.xz -C /tmp/pytrain-prefix
    step "ggml (carried CUDA prefix, cffi module here)" build.log \
      $PY native/build.py --cuda --prebuilt /tmp/pytrain-prefix/prefix --force || return 1
  else
    step "ggml with CUDA, $JOBS jobs" build.log \
      env PYTRAIN_CUDA_ARCH=${PYTRAIN_CUDA_ARCH:-90} $PY native/build.py --cuda --jobs "$JOBS" || return 1
  fi
}

models() {  # the benchmark's models, CPU only; in its own session so it outlives this call
  if [ ! -f "$MODELS_PID" ] || ! kill -0 "$(cat "$MODELS_PID")" 2>/dev/null; then
    setsid $PY scripts/bench_train.py --device cuda --make-only --types bf16,f16,q8_0 \
      >> /tmp/pytrain-models.log 2>&1 < /dev/null &
    echo $! > "$MODELS_PID"
    log "benchmark models: started in the background (pid $(cat "$MODELS_PID"))"
  fi
}

check() {
  models
  $PY scripts/build_llama_cpp.py --jobs "$JOBS" >> "$OUT/build.log" 2>&1 &
  local llama=$!
  build || { log "build failed"; return 1; }
  wait $llama; log "llama.cpp libllama (CPU): exit $?"
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
  models
  while kill -0 "$(cat "$MODELS_PID")" 2>/dev/null; do sleep 2; done
  cat /tmp/pytrain-models.log >> "$OUT/bench.log"
  step "benchmark (pytrain bf16/f16/q8_0/q4_k, HF + PEFT bf16)" bench.log \
    $PY scripts/bench_train.py --device cuda --json "$OUT/train-cuda.json" --out /tmp/train-cuda.md
}

case $PHASE in
  check) check ;;
  bench) bench ;;
  all) check; bench ;;
  *) echo "usage: $0 [check|bench|all]" >&2; exit 2 ;;
esac
log "done"
