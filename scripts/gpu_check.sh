#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU (run from the repository root):
#   1. ggml with CUDA: from a carried install prefix (.gpu/prefix.tar.xz) or built here;
#      llama.cpp's libllama (CPU) for the adapter cross-check;
#   2. pytrain doctor, and no CPU fallback in any training graph (tests/test_gpu.py);
#   3. the GPU tests: logits vs the HF/float64 goldens, LoRA gradients vs the PEFT goldens (one
#      graph and layer-wise recompute), a short training run, llama.cpp loading its adapter;
#   4. `pytrain train` of the demo config on device = "cuda".
# Everything goes under $OUT (default ./gpu_out), at most 8 files, each step's time in
# steps.log.  Made for the project's device tool (no package index there): first run
# `python scripts/gpu_carry.py [--prefix PREFIX]` here and carry `.gpu`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
JOBS=$(nproc)
START=$(date +%s)
log() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/steps.log"; }
step() {  # step NAME LOGFILE COMMAND...: run, log its exit status and time, keep going
  local name=$1 file=$2; shift 2
  local t0=$(date +%s)
  "$@" >> "$OUT/$file" 2>&1
  local rc=$?
  log "$name: exit $rc in $(( $(date +%s) - t0 )) s"
  return $rc
}

log "start on $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"
if [ -d .gpu/whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/pytrain-site .gpu/whl/*.whl && export PYTHONPATH=/tmp/pytrain-site
fi
export PYTRAIN_CACHE=${PYTRAIN_CACHE:-/tmp/pytrain-cache}
if [ -f .gpu/src.tar.xz ]; then
  mkdir -p "$PYTRAIN_CACHE/src" && tar -xJf .gpu/src.tar.xz -C "$PYTRAIN_CACHE/src"
fi
# a prefix built on another machine links cuBLAS by soname: point the loader at this
# machine's toolkit too
TOP=$(nvcc --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
[ -n "$TOP" ] && export LD_LIBRARY_PATH="$TOP/lib64:$TOP/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"

if [ -f .gpu/prefix.tar.xz ]; then
  mkdir -p /tmp/pytrain-prefix && tar -xJf .gpu/prefix.tar.xz -C /tmp/pytrain-prefix
  step "ggml (carried CUDA prefix, cffi module here)" build.log \
    $PY native/build.py --cuda --prebuilt /tmp/pytrain-prefix/prefix --force || exit 1
else
  step "ggml with CUDA, $JOBS jobs" build.log \
    env PYTRAIN_CUDA_ARCH=${PYTRAIN_CUDA_ARCH:-90} $PY native/build.py --cuda --jobs "$JOBS" || exit 1
fi
step "llama.cpp libllama (CPU)" build.log $PY scripts/build_llama_cpp.py --jobs "$JOBS"
step "pytrain doctor" doctor.txt $PY -m pytrain doctor
step "GPU tests" gpu_tests.log \
  $PY -m pytest -v -s -m gpu tests/test_gpu.py --junitxml="$OUT/gpu_tests.xml"
step "demo config on cuda" demo.log \
  $PY -m pytrain train config/demo.toml --no-progress --set model.device=cuda \
    --set output.dir=/tmp/pytrain-demo-cuda
cp /tmp/pytrain-demo-cuda/metrics.jsonl "$OUT/demo_metrics.jsonl" 2>/dev/null
log "done"
