"""Benchmark on a GPU: LoRA training tokens/s and peak GPU memory of pytrain, with the
frozen weights as BF16 / F16 / Q8_0 / Q4_K GGUFs, against HF transformers + PEFT (bf16) on the
same model and batch, plus a per-op profile of each side.  ``python -m scripts.bench_train
--device cuda`` (an NVIDIA GPU) or ``--device vulkan`` (ggml-vulkan: any vendor's GPU, or
Mesa's lavapipe) runs this (and passes its arguments on).

Vulkan: pytrain's worker runs on ``device="vulkan"`` (ggml-vulkan's first device; lavapipe, a
CPU device, only with ``GGML_VK_VISIBLE_DEVICES=0``).  The HF side runs where the reference
torch sees a GPU (``torch.cuda.is_available()``: CUDA, or ROCm on AMD) on that same GPU; else
the report says it was not run and why (torch has no Vulkan training backend).  The report's
title names the device as ggml lists it; on lavapipe it says that lavapipe runs on the CPU, so
its speed says nothing about a GPU (and compares nothing with the anchor).

Why: a GPU user compares pytrain's step with what HF + PEFT does on the same card.  The anchor,
measured earlier on one H200 (HF transformers 5.17 + PEFT 0.21, torch 2.11, bf16, torch's
DeltaNet fallback because flash-linear-attention refused that Triton): 6,909 tokens/s, 32.9 GiB
peak, at the shape and batch below.  Where the GPU machine has torch, transformers and PEFT the
HF side runs here in the same run (``--no-hf`` skips it); the report shows both.

The model (``--shape``, default ``2b``): the Qwen3.5-2B shape (hidden 2048, 24 layers with full
attention every 4th, 8/2 heads x 256, FFN 6144, DeltaNet 16/16 heads x 128, vocab 248320, tied;
scripts/bench_common.py's spec), random weights made once by the reference stack
(scripts/qwen35_reference.py) and stored as a bfloat16 HF checkpoint; from it the pinned
``convert_hf_to_gguf.py`` writes the BF16, F16 and Q8_0 GGUFs (three converters in parallel),
and ggml's own Q4_K quantizer re-encodes every tensor the converter's Q8_0 file quantizes
(``scripts/gguf_models.quantized_copy``: the converter writes no K-quant; this is what
llama-quantize does with a pure type).  ``--shape mid`` is the CPU benchmark's small shape: a
dry run of this script on a machine without a GPU (``--device cpu``).  ``--shape toy`` is the
smoke tests' model (hidden 64; its rows are too short for Q4_K, so ``--types bf16,f16,q8_0``):
the shape the lavapipe run uses, since lavapipe takes no buffer over 128 MiB and the mid
shape's BF16 and F16 embedding (151936 x 512) is 155.6 MB (refused at load, by name; its
Q8_0 step ran, 74 s a step on a loaded 2-core machine).

The step, the same on both sides: batch 4 x 1024 random token ids over the vocabulary, the first
half of each row a masked prompt (HF label -100, pytrain ``train_mask`` False); LoRA r 16,
alpha 32, dropout 0 on q/k/v/o of the 6 attention layers; AdamW lr 1e-4 with global-norm
clipping at 1.0.  pytrain: ``load_model(gguf, device="cuda")`` (frozen weights keep the file's
type on CUDA), ``Trainer(...).step``, once per ``--recompute`` policy (default ``auto,layers``:
the Trainer's default, which on a GPU keeps one graph while it needs under half the device's
memory, and layer-wise recompute, which keeps a few layers' activations at a time for a second
forward of most layers; a policy that ends up as the same step as an earlier one is
measured but reported once).  HF:
``Qwen3_5ForCausalLM.from_pretrained(dtype=bfloat16, attn_implementation="sdpa")`` on the GPU,
``peft.get_peft_model`` (PEFT keeps the LoRA weights float32), forward with labels, backward,
clip, AdamW step.  Both start from B = 0 adapters, so the first loss is the base model's masked
loss on the batch: the table shows both sides' (a check that they train the same model).

Measured: each side and weight type runs in its own process; ``--warmup`` steps, then
``--steps`` timed ones (wall time of a whole step, synchronised); tokens/s = B*T / median step.
Peak GPU memory: ``nvidia-smi`` samples the device's used memory every 100 ms while the worker
runs, minus what was in use before it started (the same measure for both sides: CUDA context,
weights, activations, allocator pools, everything); where the machine has no ``nvidia-smi``
(another vendor's GPU, lavapipe), pytrain's figure is ggml's instead: the device's free memory
before the model loads minus after the steps (lavapipe's memory is the system's, so other
processes move it too).  Beside it each side's own figure (torch: ``max_memory_reserved``;
pytrain: device memory in use after the steps, from ggml).  Profile
(``--profile-types``, default bf16; ``--no-profile`` skips): one extra pytrain step computed node
by node through a ggml scheduler eval callback (the scheduler synchronises after each node;
``pytrain profile``'s code, pytrain/plan/profile.py), summed by op and by part of the model; one HF step under
torch.profiler, top ops by self GPU time.

Results go to ``--json`` (default ``bench_results/train-DEVICE.json``) and the markdown rendered
from it (``--out``, default ``bench_results/train-DEVICE.md``; ``--report-from FILE`` re-renders;
scripts/bench_train_gpu_report.py)
after every worker, so a run stopped at a time limit keeps what it measured.  ``--plan`` names
the workers in order (``hf,bf16:auto,bf16:layers,q4_k:layers``: HF first, then weight type :
recompute policy) and ``--deadline`` (epoch seconds) starts none after that time and cuts each
one's ``--timeout`` to it: scripts/gpu_check.sh fits the whole benchmark in one device call.

    python -m scripts.bench_train --device cuda                        # everything, ~8 minutes on an H200
    python -m scripts.bench_train --device cuda --make-only            # only the GGUFs (CPU work)
    python -m scripts.bench_train --device cpu --shape mid --batch 1 64 --steps 1 --warmup 1 \\
        --out /tmp/gpu.md                                              # the dry run
    python -m scripts.bench_train --device vulkan                      # a Vulkan GPU -> train-vulkan.md
    GGML_VK_VISIBLE_DEVICES=0 python -m scripts.bench_train --device vulkan --shape toy \\
        --types bf16,f16,q8_0 --batch 1 64 --steps 1 --warmup 1 \\
        --out bench_results/train-vulkan-lavapipe.md                   # lavapipe: ran, no speed
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scripts import bench_common as bc
from scripts.bench_common import REPO
from scripts.bench_train_gpu_report import report, summary


def _anchor() -> dict:
    """The earlier HF + PEFT measurement on an H200 (bench_results/anchor_hf_peft_h200.json,
    which says how it was made)."""
    import json
    a = json.loads((REPO / "bench_results" / "anchor_hf_peft_h200.json").read_text())
    st = a["stack"]
    return dict(tokens_per_s=a["tokens_per_s"], peak_gib=a["peak_gib"],
                batch=tuple(a["setup"]["batch"]),
                stack=f"HF transformers {st['transformers']} + PEFT {st['peft']}, torch "
                      f"{st['torch'].split()[0]}, {a['setup']['dtype']}, torch DeltaNet fallback")


ANCHOR = _anchor()
TYPES = ("bf16", "f16", "q8_0", "q4_k")
CONVERTED = ("bf16", "f16", "q8_0")       # written by convert_hf_to_gguf.py
TIMEOUT_S = 900                            # one worker, load to last step
MIN_WORKER_S = 45                          # a worker given less cannot load the 2B model


# --------------------------------------------------------------------------------------------
# the models
# --------------------------------------------------------------------------------------------

def spec_name(shape: str) -> str:
    """The bench_common spec of ``shape`` stored as bfloat16 (registered on first use)."""
    name = f"{shape}-bf16"
    bc.SPECS.setdefault(name, dict(bc.SPECS[shape], outtype="bf16", hf_dtype="bfloat16"))
    return name


def make_models(shape: str, cache: Path, types: list[str], python: str, ggml_python: str) -> dict:
    """The HF checkpoint and one GGUF per type, made once under ``cache`` (``python``: the
    reference stack; ``ggml_python``: pytrain's, for the Q4_K quantizer); returns the record."""
    name = spec_name(shape)
    d = bc.spec_dir(cache, name)
    if not (d / "done.json").exists():
        t0 = time.time()
        subprocess.run([python, "-m", "scripts.bench_train_gpu", "--make", shape, "--into", str(d)],
                       cwd=str(REPO), check=True)
        print(f"[{name}] HF checkpoint and BF16 GGUF in {time.time() - t0:.0f} s", flush=True)
    done = json.loads((d / "done.json").read_text())
    files = {"bf16": d / done["gguf"]}
    todo = [t for t in types if t != "bf16" and not (d / f"model-{t}.gguf").exists()]
    t0 = time.time()
    # Q4_K is re-encoded from the F16 file, on the tensors the Q8_0 file quantizes
    need = set(todo) | ({"f16", "q8_0"} if "q4_k" in todo else set())
    conv = [t for t in CONVERTED if t in need and not (d / f"model-{t}.gguf").exists()]
    if conv:
        cmd = [python, "-m", "scripts.bench_train_gpu", "--convert", str(d / "hf"), "--into", str(d)]
        with cf.ThreadPoolExecutor(len(conv)) as ex:
            list(ex.map(lambda t: subprocess.run(cmd + ["--type", t], cwd=str(REPO), check=True), conv))
    if "q4_k" in todo:
        subprocess.run([ggml_python, "-m", "scripts.bench_train_gpu", "--q4k", str(d)], cwd=str(REPO),
                       check=True)
    if todo:
        print(f"[{name}] {', '.join(todo)} in {time.time() - t0:.0f} s", flush=True)
    for t in types:
        files[t] = d / f"model-{t}.gguf"
    return dict(shape=shape, dir=d, files=files, n_params=done["n_params"],
                vocab=bc.SPECS[shape]["config"]["vocab_size"], desc=bc.SPECS[shape]["desc"])


def convert(hf_dir: Path, into: Path, outtype: str) -> None:
    """One GGUF by the pinned converter, written under a temporary name and renamed."""
    from scripts import qwen35_reference as ref
    out = into / f"model-{outtype}.gguf"
    tmp = out.with_suffix(".part")
    ref.convert_to_gguf(hf_dir, tmp, outtype)
    os.replace(tmp, out)


def make_q4k(d: Path) -> None:
    """Q4_K from the F16 GGUF, on the tensors the converter's Q8_0 file quantizes."""
    from scripts.gguf_models import quantized_copy
    tmp = d / "model-q4_k.part"
    quantized_copy(d / "model-f16.gguf", d / "model-q8_0.gguf", tmp, "q4_K",
                   workers=os.cpu_count() or 1)
    os.replace(tmp, d / "model-q4_k.gguf")


# --------------------------------------------------------------------------------------------
# workers (each in its own process; one JSON line "RESULT {...}")
# --------------------------------------------------------------------------------------------

def _steps(one, warmup: int, steps: int, sync=lambda: None) -> dict:
    losses, times = [], []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        losses.append(one())
        sync()
        times.append(time.perf_counter() - t0)
    timed = times[warmup:]
    return dict(losses=losses, warmup_s=times[:warmup], times=timed,
                median_s=statistics.median(timed), best_s=min(timed))


def _device_free(device: str) -> int | None:
    """ggml's free-memory reading of the device a run on ``device`` computes on (None on the
    CPU), taken before the model loads: the worker's "device memory used" is this minus the
    reading after its steps, where nvidia-smi is missing (a Vulkan GPU of another vendor,
    lavapipe)."""
    from pytrain import ggml
    if device == "cpu":
        return None
    rt = ggml.Runtime(device)
    try:
        return rt.device_memory_info()[0]
    finally:
        rt.close()


def pytrain_worker(a) -> dict:
    from pytrain import ggml
    B, T = a.batch
    free_before = _device_free(a.device)
    t0 = time.perf_counter()
    m, tr, names, batch, train = bc.pytrain_trainer(a.gguf, a.device, None, a.policy, a.seed,
                                                    (B, T))
    load_s = time.perf_counter() - t0
    if a.profile:
        return dict(profile=bc.profile_pytrain(tr, batch))
    r = _steps(lambda: tr.step([batch], bc.LR).loss, a.warmup, a.steps)
    free, total = m.runtime.device_memory_info()
    label = m.runtime.device_label()
    return dict(r, load_s=load_s, first_loss=r["losses"][0], tokens=B * T,
                device_label=label, lavapipe=ggml.is_lavapipe(label.partition(": ")[2]),
                device_used_ggml=None if free_before is None else free_before - free,
                n_targets=bc.n_targets(train), weights_bytes=int(m.weights.total_bytes),
                **bc.step_facts(m, tr, names), device_used_end=total - free, device_total=total,
                tokens_per_s=B * T / r["median_s"])


def hf_worker(a) -> dict:
    t0 = time.perf_counter()
    hf = bc.hf_side(a.hf, "bfloat16", a.hf_attn, a.device, a.seed, tuple(a.batch))
    load_s = time.perf_counter() - t0
    if a.profile:
        hf.one()
        return dict(profile=bc.hf_profile(hf))
    r = _steps(hf.one, a.warmup, a.steps, hf.sync)
    mem = {}
    if hf.cuda:
        import torch
        mem = dict(max_allocated=torch.cuda.max_memory_allocated(),
                   max_reserved=torch.cuda.max_memory_reserved())
    return dict(r, load_s=load_s, first_loss=r["losses"][0], **hf.facts,
                tokens_per_s=hf.facts["tokens"] / r["median_s"], **mem)


def hf_device(device: str) -> str:
    """The HF side's torch device: beside a Vulkan run, torch on the same GPU through CUDA or
    ROCm (torch has no Vulkan training backend; its ROCm builds answer to "cuda" too)."""
    return "cuda" if device == "vulkan" else device


def hf_not_run(a) -> str | None:
    """Why the HF side cannot run beside ``a.device`` here (None: it can)."""
    if a.device != "vulkan":
        return None
    cmd = [a.ref_python, "-c", "import torch; print(torch.cuda.is_available())"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        return f"torch could not be asked for a GPU ({e})"
    if r.stdout.strip() == "True":
        return None
    return (f"torch has no Vulkan training backend, and the HF side's torch ({a.ref_python}) "
            f"sees no CUDA or ROCm GPU here" + ("" if r.returncode == 0 else
                                              f" ({(r.stderr.strip().splitlines() or ['?'])[-1]})"))


def run_worker(side: str, a, extra: list[str], profile: bool = False,
               timeout: int | None = None) -> dict:
    """One worker process; its RESULT line, its GPU memory, or the error it ended with."""
    timeout = timeout or a.timeout
    cmd = [a.python if side == "pytrain" else a.ref_python, "-m", "scripts.bench_train_gpu",
           "--worker", side, "--device", a.device if side == "pytrain" else hf_device(a.device),
           "--batch", *map(str, a.batch), "--warmup", str(a.warmup), "--steps", str(a.steps),
           "--hf-attn", a.hf_attn, "--seed", str(a.seed), *extra]
    if profile:
        cmd.append("--profile")
    t0 = time.time()
    with bc.GpuMemory() as mem:
        try:
            # GGML_NO_BACKTRACE: a ggml abort's message is the error's last line (not gdb's)
            p = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=timeout,
                               env=dict(os.environ, GGML_NO_BACKTRACE="1"))
            out, err, rc = p.stdout, p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out, err, rc = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
                else (e.stdout or ""), f"timed out after {timeout} s", -9
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(lines[-1][7:]) if lines else dict(error=f"exit {rc}: " + (err or out)[-3000:])
    res.update(wall_s=time.time() - t0, gpu_memory=mem.result())
    sys.stderr.write(err[-2000:] if rc else "")
    return res


# --------------------------------------------------------------------------------------------
# the run and its report
# --------------------------------------------------------------------------------------------

def machine() -> dict:
    info = dict(bc.machine_facts())
    if info["commit"] == "?":      # a copy of the tree without .git (the GPU machine's)
        info["commit"] = os.environ.get("PYTRAIN_COMMIT", "?")
    if shutil.which("nvidia-smi"):
        try:
            info["gpu"] = subprocess.check_output(
                ["nvidia-smi", "--id=0", "--query-gpu=name,driver_version,memory.total",
                 "--format=csv,noheader"], text=True, timeout=30).strip()
        except subprocess.SubprocessError:
            pass
    return info


def plan(a, types: list[str]) -> list[tuple[str, str | None]]:
    """The workers in the order they run: ("hf", None) and (weight type, recompute policy)."""
    if a.plan:
        out = []
        for item in (x.strip() for x in a.plan.split(",") if x.strip()):
            if item == "hf":
                out.append(("hf", None))
                continue
            t, _, pol = item.partition(":")
            if t not in TYPES or pol not in ("auto", "off", "layers"):
                raise SystemExit(f"--plan: {item!r} is neither hf nor TYPE:POLICY (types "
                                 f"{', '.join(TYPES)}; policies auto, off, layers)")
            out.append((t, pol))
        return out
    policies = [r.strip() for r in a.recompute.split(",") if r.strip()]
    return ([("hf", None)] if a.do_hf else []) + [(t, p) for t in types for p in policies]


def worker_timeout(a) -> int | None:
    """Seconds the next worker may take: ``--timeout``, cut to what is left before
    ``--deadline`` (None: too little is left to start one)."""
    if a.deadline is None:
        return a.timeout
    left = int(a.deadline - time.time())
    return min(a.timeout, left) if left >= MIN_WORKER_S else None


def run(a) -> dict:
    types = [t.strip() for t in a.types.split(",") if t.strip()]
    bad = [t for t in types if t not in TYPES]
    if bad:
        raise SystemExit(f"--types: {', '.join(bad)} not among {', '.join(TYPES)}")
    work = plan(a, types)
    if a.plan:                        # the models the plan's workers need, no others
        types = sorted({t for t, _ in work if t != "hf"}, key=TYPES.index)
    t0 = time.time()
    mod = make_models(a.shape, a.cache, types, a.ref_python, a.python)
    j = dict(kind="train-gpu", device=a.device, shape=a.shape, desc=mod["desc"],
             n_params=mod["n_params"], batch=list(a.batch), warmup=a.warmup, steps=a.steps,
             command=" ".join(["python", "-m", "scripts.bench_train", *sys.argv[1:]]),
             machine=machine(), anchor=ANCHOR, models_s=time.time() - t0, pytrain={}, hf=None,
             profile={}, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    if a.make_only:
        return j

    def save():
        """After every worker: a run stopped at a time limit keeps what it measured."""
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(j, indent=1, default=str))
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(report(j))

    def one(side: str, extra: list[str], profile: bool = False) -> dict | None:
        timeout = worker_timeout(a)
        if timeout is None:
            print(f"[{side} {' '.join(extra[-2:])}] not started: under {MIN_WORKER_S} s left "
                  f"before the deadline", flush=True)
            return None
        return run_worker(side, a, extra, profile=profile, timeout=timeout)

    kinds: dict[str, set] = {}
    no_hf = hf_not_run(a) if any(t == "hf" for t, _ in work) else None
    for t, pol in work:
        if t == "hf" and no_hf:
            j["hf"] = dict(not_run=no_hf)
            print(f"[hf] not run: {no_hf}", flush=True)
        elif t == "hf":
            r = one("hf", ["--hf", str(mod["dir"] / "hf")])
            if r is not None:
                j["hf"] = r
                print(f"[hf] {summary(r)}", flush=True)
        else:
            r = one("pytrain", ["--gguf", str(mod["files"][t]), "--policy", pol])
            if r is not None and r.get("step_graph") not in kinds.setdefault(t, set()):
                kinds[t].add(r.get("step_graph"))     # else: a policy chose a step measured
                r["policy"] = pol
                j["pytrain"][f"{t} {pol}"] = r
                print(f"[pytrain {t}, recompute={pol}] {summary(r)}", flush=True)
            if r is not None and r.get("device_label"):
                j["device_label"], j["lavapipe"] = r["device_label"], r["lavapipe"]
        save()
    if a.do_profile:
        for t, pol in work:
            if t != "hf" and t in a.profile_types.split(","):
                r = one("pytrain", ["--gguf", str(mod["files"][t]), "--policy", pol], profile=True)
                if r is not None:
                    j["profile"][f"{t} {pol}"] = r
                    save()
        if any(t == "hf" for t, _ in work) and not no_hf:
            r = one("hf", ["--hf", str(mod["dir"] / "hf")], profile=True)
            if r is not None:
                j["profile"]["hf"] = r
                save()
    j["total_s"] = time.time() - t0
    save()
    return j


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "vulkan", "cpu"])
    ap.add_argument("--shape", default="2b", choices=["2b", "mid", "toy"])
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--batch", type=int, nargs=2, default=list(ANCHOR["batch"]), metavar=("B", "T"))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--recompute", default="auto,layers",
                    help="pytrain Trainer(recompute=...) policies to run each type under, "
                         "comma-separated (auto, off, layers)")
    ap.add_argument("--hf-attn", default="sdpa")
    ap.add_argument("--no-hf", dest="do_hf", action="store_false")
    ap.add_argument("--no-profile", dest="do_profile", action="store_false")
    ap.add_argument("--profile-types", default="bf16")
    ap.add_argument("--make-only", action="store_true", help="make the models, measure nothing")
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get(
        "PYTRAIN_CACHE", Path.home() / ".cache" / "pytrain")) / "bench")
    ap.add_argument("--python", default=sys.executable, help="interpreter with pytrain, torch, "
                    "transformers and PEFT (on the GPU machine: the one python3)")
    ap.add_argument("--ref-python", default=None, help="interpreter for the HF side and the "
                    "models (default: --python; on a CPU machine the reference venv)")
    ap.add_argument("--timeout", type=int, default=TIMEOUT_S, help="seconds per worker")
    ap.add_argument("--plan", default=None, metavar="hf,TYPE:POLICY,...",
                    help="the workers, in order (default: hf, then every type x --recompute)")
    ap.add_argument("--deadline", type=float, default=None, metavar="EPOCH_SECONDS",
                    help="start no worker after this time, and cut each one's timeout to it")
    ap.add_argument("--out", type=Path, default=None,
                    help="the markdown report (default bench_results/train-DEVICE.md)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--report-from", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--worker", choices=["pytrain", "hf"], help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--policy", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--hf", help=argparse.SUPPRESS)
    ap.add_argument("--make", choices=["2b", "mid", "toy"], help=argparse.SUPPRESS)
    ap.add_argument("--convert", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--type", help=argparse.SUPPRESS)
    ap.add_argument("--q4k", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--into", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.out = a.out or REPO / "bench_results" / f"train-{a.device}.md"
    a.json = a.json or a.out.with_suffix(".json")
    a.ref_python = a.ref_python or a.python
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    if a.make:
        bc.make_model(spec_name(a.make), a.into)
        return 0
    if a.convert:
        convert(a.convert, a.into, a.type)
        return 0
    if a.q4k:
        make_q4k(a.q4k)
        return 0
    if a.worker:
        res = (pytrain_worker if a.worker == "pytrain" else hf_worker)(a)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    j = json.loads(a.report_from.read_text()) if a.report_from else run(a)
    if a.make_only:
        print(f"models under {bc.spec_dir(a.cache, spec_name(a.shape))}")
        return 0
    md = report(j)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(md)
    print(md)
    print(f"wrote {a.out}" + ("" if a.report_from else f" and {a.json}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
