"""Benchmark: LoRA training tokens/s and peak memory of pytrain against HF transformers + PEFT
on CPU, with where a pytrain step goes (host phases, and a per-op profile).

Why: pytrain's training step should cost no more than the reference stack's on the same model,
the same batch and the same thread count.  A benchmark, not a test: nothing is asserted about
speed.  Writes a markdown table to ``bench_results/train.md`` (+ the raw ``train.json``).

Models (``--models``, comma-separated, default ``default,mid,mid-v248k``; the committed run adds
``2b``; the specs are scripts/bench_common.py's SPECS):
    default    the embedded ``pytrain/assets/default-model.gguf`` (``--default-gguf``; skipped
               when absent); HF runs only when its HF checkpoint (``--default-hf``, default
               /tmp/pytrain-default-model/hf, left by scripts/make_default_model.py) exists
    mid        the project's CPU benchmark shape (hidden 512, 8 layers, vocab 151936; random
               weights, F32), made once by the reference stack and cached under ``--cache``
    mid-v248k  the same shape with Qwen3.5's real vocabulary, 248320
    2b         the Qwen3.5-2B shape (random weights rounded to F16; an HF checkpoint stored
               float16 and an F16 GGUF, ~8 GB of disk, made once in several minutes).  HF + PEFT
               upcasts to ``--hf-dtype`` (float32: on an AVX2 CPU without bf16 instructions
               bfloat16 was far slower).  Batch 1 x 512 (``TRAIN``), at most 1 warm-up and 3
               clean timed steps; pytrain's Trainer picks layer-wise recompute there on a 24 GiB
               machine (``--recompute``, default auto), HF keeps every activation.
    toy        the smoke tests' model (tests/test_scripts_bench.py), batch 1 x 32
    smollm2, gemma3-270m
               real models users start from, at their own file types (REAL in
               scripts/bench_common.py; fetched by ``make real-model``, skipped when not):
               SmolLM2-135M-Instruct Q4_1 (llama) and Gemma 3 270M Q4_K_M (gemma3).  pytrain
               trains the GGUF itself, its types chosen as ``pytrain train`` chooses them
               (pytrain/run/type_choice.py, policy auto: Q4_1 becomes F32 where memory allows;
               under bf16 compute the quantized types measured faster as BF16 copies become
               BF16); kept quantized types round the forward's activations as llama.cpp does,
               so the first losses differ a little.  HF + PEFT runs on an HF folder of the
               same weights, dequantized from the GGUF by transformers' GGUF loading and saved
               float32 (made once, cached under ``--cache``).  The report states each file's
               type and what pytrain loaded each matrix as, under f32 and bf16 compute.

bf16 rows (``--bf16 auto|on|off``, default auto = when /proc/cpuinfo lists ``avx512_bf16`` or
``amx_bf16``; ``on`` also elsewhere, where both sides emulate bf16 slowly): each row (model x
threads) also runs, in the same invocation, pytrain with ``compute_type="bf16"`` (the frozen
weight matrices loaded as BF16 and multiplied, forward and backward, by oneDNN's bf16 matmul in
ggml-blas; LoRA, the other ops and AdamW stay float32; ``row["pytrain_bf16"]``) and HF + PEFT
with the model in the other dtype than ``--hf-dtype`` (``row["hf_bf16"]``, or ``row["hf_f32"]``
beside ``--hf-dtype bfloat16``; the 2b checkpoint's float16 is converted on load).  The report
then opens with a table of all four sides: tokens/s, pytrain f32 / HF f32, pytrain bf16 / HF
bf16, each pytrain figure against the faster HF reference (named), peak RSS, first-step losses
(bf16 rounding moves them a little) and the kernels: pytrain's oneDNN implementation
(``pytrain.ggml.bf16_kernel()``) and, for each HF side, one extra untimed step after the timed
ones under oneDNN verbose (matmul / inner_product implementations and how often they ran) and
torch.profiler (aten::mm / bmm / ... counts: torch's float32 products go to its CPU BLAS, not
oneDNN).  The committed bf16 figures are ``bench_results/train-bf16.md`` (``--out`` it).

The training step, the same on both sides: batch 2 x 256 random token ids over the vocabulary,
no padding, the first half of each row a masked prompt (HF: label -100; pytrain: ``train_mask``
False); LoRA r=16, alpha=32, dropout 0 on q/k/v/o of the full-attention layers (every layer of
the real models: pytrain's default targets, PEFT's target_modules q/k/v/o_proj); AdamW (lr 1e-4,
betas 0.9/0.999, eps 1e-8, weight decay 0) with global-norm clipping at 1.0; float32
activations.  pytrain: ``Trainer(...).step([batch], lr)``; HF: ``Qwen3_5ForCausalLM`` (sdpa
attention, torch DeltaNet fallback; the real models: ``LlamaForCausalLM``,
``Gemma3ForCausalLM``) under ``peft.get_peft_model``, forward with labels,
backward, ``clip_grad_norm_``, ``opt.step()``.  Both sides start from B = 0 adapters, so the
first step's loss is the base model's masked loss on the batch: the table shows both.

Timing: each side runs in its own subprocess (peak RSS = its VmHWM), once per thread count of
``--threads`` (default 2; ``--model-threads 2b=2`` gives one model its own counts).
``--warmup`` steps, then timed steps until ``--steps`` *clean* ones are in (other processes
kept < 0.3 cores busy beyond the cores the side leaves free) or 3x that many were run;
tokens/s = tokens / median clean step.  ``--nice -20`` (root) runs each worker in its own
session at niceness -20, so that other jobs yield the cores.  pytrain's steps are split into
phases by wrapping pytrain functions at runtime: host input upload, the labels
(``MaskedCE.prepare``: ``set_targets``, ``build_labels``, the pad-column ``read_column``),
graph allocation, compute of the forward+backward graph(s), compute of the optimizer graphs,
the rest.  ``--blas-off MODELS`` also runs those models' pytrain side with ``PYTRAIN_BLAS=0``
(ggml's CPU backend alone); ``--one-graph MODELS`` (default ``2b``) also runs, where recompute
auto chose layer-wise recompute, one graph (``recompute="off"``).

Profile (``--no-profile`` skips): one extra pytrain step in its own process computed node by
node, by part of the model and op and backend: ``pytrain profile``'s code
(pytrain/plan/profile.py); and one HF step under torch.profiler (top ops by self CPU time).

Where the limit is (``--no-limits`` skips it; scripts/bench_limits.py says how): each
worker also counts its step's matrix-product FLOPs (pytrain: the MUL_MAT / OUT_PROD nodes of
the graphs its first warm-up step computed; HF: FlopCounterMode on its first warm-up step),
and after its timed steps probes its library's matmul rate at the ``--probe-top K`` (default
3) shapes holding the most FLOPs and at a ``--probe-square N`` cube (default 2048; 0: none);
pytrain's side also computes one step node by node for the time outside the products (that
profiled step is the report's pytrain profile at the first thread count: no process of its
own).  The report's "Where the limit is" section: FLOPs, achieved and peak GFLOP/s,
utilization, the probes, the kernels.  ``--no-hf`` runs pytrain's sides alone.

On a GPU: ``--device cuda`` or ``--device vulkan`` runs scripts/bench_train_gpu.py instead (it
passes every argument on and its docstring says what it measures) ->
bench_results/train-cuda.md, train-vulkan.md.

How (from the repo root, with the project's python, the native library built and the reference
stack of scripts/requirements-reference.txt in /opt/refenv):

    python -m scripts.bench_train                            # -> bench_results/train.md
    python -m scripts.bench_train --models mid --steps 3 --no-profile --out /tmp/train.md
    python -m scripts.bench_train --report-from bench_results/train.json   # re-render
    python -m scripts.bench_train --models mid,mid-v248k,2b --model-threads 2b=2 \
        --out bench_results/train-bf16.md                  # the bf16 rows (on a bf16 CPU)
    python -m scripts.bench_train --models smollm2,gemma3-270m --out /tmp/train-real.md

``--report-from`` rewrites the markdown from ``--json`` files of earlier runs (merging several;
``--note`` lines are added, and stored into a single json named by ``--json``; results of runs
before the bf16 rows render as they did).  Without 2b the
run takes ~20 minutes per thread count on 2 cores.  The masked loss's label work before and after
it moved onto the device (bench_results/labels.md) and the LM-head backward alternatives were
measured by this script at commit 9bbf5b4 and before; those investigations are finished.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from scripts import bench_common as bc
from scripts import bench_limits as bl
from scripts.bench_train_report import (BATCH, HF_OTHER, VARIANTS, bf16_ratio_lines,
                                        machine_info, report)
from scripts.bench_common import LR, REPO, SPECS

# Per-model step settings other than BATCH and --warmup / --steps: the real-size 2B shape trains
# on batch 1 x 512 with at most 1 warm-up and 3 clean timed steps (a step takes tens of seconds);
# the smoke tests' toy model on its own batch.
TRAIN = {"2b": dict(batch=(1, 512), warmup=1, steps=3), "toy": dict(batch=SPECS["toy"]["batch"])}



def train_settings(name: str, a) -> tuple[tuple[int, int], int, int]:
    """(batch, warm-up steps, clean timed steps wanted) of a model."""
    t = TRAIN.get(name, {})
    return (tuple(t.get("batch", BATCH)), min(a.warmup, t.get("warmup", a.warmup)),
            min(a.steps, t.get("steps", a.steps)))


# --------------------------------------------------------------------------------------------
# pytrain worker
# --------------------------------------------------------------------------------------------

class _Phases:
    """Wraps pytrain functions at runtime to split a step's wall time into phases."""

    def __init__(self, trainer):
        from dataclasses import replace

        import pytrain.step.loss as L
        from pytrain import ggml
        from pytrain.plan.profile import step_graphs
        self.t: dict[str, float] = {}
        me = self

        def timed(key_fn, fn):
            def w(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    key = key_fn(*a, **k)
                    me.t[key] = me.t.get(key, 0.0) + time.perf_counter() - t0
            return w

        grad_graphs = lambda: {ggml.address(g) for g, _ in step_graphs(trainer)}  # noqa: E731
        const = lambda k: (lambda *a, **kw: k)  # noqa: E731
        CE = L.MaskedCE
        inside = {"set_targets": False}
        set_targets0 = CE.set_targets

        def set_targets(*a, **k):
            inside["set_targets"] = True
            try:
                return set_targets0(*a, **k)
            finally:
                inside["set_targets"] = False

        # "labels" = the whole MaskedCE.prepare of a micro-batch; keys with a dot are its parts
        # (not added into the step's sum).  Methods are patched on the class, so prepare's
        # self.set_targets(...) and check_labels' module-level read_column hit the wrappers.
        CE.prepare = timed(const("labels"), CE.prepare)
        CE.set_targets = timed(const("labels.set_targets"), set_targets)
        CE.build_labels = timed(const("labels.build_labels"), CE.build_labels)
        CE.check_labels = timed(const("labels.check_labels"), CE.check_labels)
        L.read_column = timed(const("labels.read_column"), L.read_column)
        ggml.from_numpy = timed(lambda *a, **k: ("labels.set_targets.upload" if inside["set_targets"]
                                                 else "from_numpy.other"), ggml.from_numpy)
        m = trainer.model     # host inputs go through the model's architecture entry
        m.arch = replace(m.arch, input_values=timed(lambda *a, **k: "inputs", m.arch.input_values),
                         set_inputs=timed(lambda *a, **k: "inputs", m.arch.set_inputs))
        ggml.Runtime.alloc_graph = timed(lambda *a, **k: "alloc_graph", ggml.Runtime.alloc_graph)
        ggml.Runtime.compute = timed(
            lambda self_, graph, *a, **k: ("compute fwd+bwd" if ggml.address(graph) in grad_graphs()
                                           else "compute optimizer"), ggml.Runtime.compute)
        # the optimizer's graphs stay allocated outside the scheduler (Runtime.compute_resident)
        ggml.Runtime.compute_resident = timed(const("compute optimizer"), ggml.Runtime.compute_resident)

    def take(self) -> dict:
        out, self.t = self.t, {}
        return out


def _kernel(compute_type: str) -> dict:
    """pytrain's bf16 matmul kernel (oneDNN's implementation name), for a bf16 run."""
    from pytrain import ggml
    return dict(bf16_kernel=ggml.bf16_kernel()) if compute_type == "bf16" else {}


def pytrain_worker(a) -> dict:
    from pytrain.plan.products import counting
    B, T = a.batch
    t0 = time.perf_counter()
    choice = [] if a.type_choice else None
    m, tr, names, batch, train = bc.pytrain_trainer(a.gguf, "cpu", int(a.threads), a.recompute,
                                                    a.seed, (B, T), a.compute_type, choice)
    load_s = time.perf_counter() - t0
    after_load = bc.proc_status()
    ph = _Phases(tr)
    losses, warm = [], []
    products = None
    if a.worker_limits and not a.warmup:     # the products are counted on an untimed step
        with counting(m.runtime) as products:
            losses.append(tr.step([batch], LR).loss)
    for i in range(a.warmup):
        t1 = time.perf_counter()
        if a.worker_limits and i == 0:       # the first warm-up step's products, as it ran them
            with counting(m.runtime) as products:
                losses.append(tr.step([batch], LR).loss)
        else:
            losses.append(tr.step([batch], LR).loss)
        warm.append(time.perf_counter() - t1)
    ph.take()
    if a.profile:
        return dict(side="pytrain", profile=bc.profile_pytrain(tr, batch),
                    blas=m.runtime.blas is not None)
    results = []

    def step():
        r = tr.step([batch], LR)
        results.append(r)
        p = ph.take()
        p["rest"] = r.seconds - sum(v for k, v in p.items() if "." not in k)
        return p

    stats, phases, use = bc.clean_loop(step, a.runs, int(a.threads))
    st = bc.proc_status()
    r0 = results[0]
    keys = sorted({k for p in phases for k in p})
    res = dict(side="pytrain", load_s=load_s, warmup_s=warm,
               first_loss=losses[0] if losses else r0.loss,
               losses=losses + [r.loss for r in results], tokens=r0.tokens, n_targets=r0.n_valid,
               phases={k: statistics.median(phases[i].get(k, 0.0) for i in use) for k in keys},
               step_seconds=statistics.median(results[i].seconds for i in use),
               pad_id=m.tokenizer.pad_id, peak_rss=st["VmHWM"],
               rss_after_load=after_load["VmRSS"], rss_end_anon=st["RssAnon"],
               rss_end_file=st["RssFile"], batch=[B, T],
               loss_rows=sorted({int(g.ce.n_rows) for g in tr.graphs.values()
                                 if getattr(g, "ce", None)}),
               recompute=a.recompute, type_policy="auto", compute_type=a.compute_type,
               **({"type_choice": "; ".join(x.removeprefix("weights: ") for x in choice)}
                  if choice else {}),
               compute=m.compute, **_kernel(a.compute_type), **bc.step_facts(m, tr, names),
               **stats)
    res["tokens_per_s"] = B * T / res["median_s"]
    res["target_tokens_per_s"] = res["n_targets"] / res["median_s"]
    if a.worker_limits:      # after the timed steps and the peak RSS: disturbs neither
        res["limits"] = bl.pytrain_limits(m.runtime, tr, batch, products, a.compute_type,
                                          a.probe_top, a.probe_square)
    return res


# --------------------------------------------------------------------------------------------
# HF worker
# --------------------------------------------------------------------------------------------

def hf_worker(a) -> dict:
    import torch
    torch.set_num_threads(int(a.threads))
    t0 = time.perf_counter()
    hf = bc.hf_side(a.hf, a.hf_dtype, a.hf_attn, "cpu", a.seed, tuple(a.batch))
    load_s = time.perf_counter() - t0
    after_load = bc.proc_status()
    losses, warm = [], []
    flops = None
    if a.worker_limits and not a.warmup:     # the FLOPs are counted on an untimed step
        loss, flops = bl.hf_flops_step(hf)
        losses.append(loss)
    for i in range(a.warmup):
        t1 = time.perf_counter()
        if a.worker_limits and i == 0:       # the first warm-up step under FlopCounterMode
            loss, flops = bl.hf_flops_step(hf)
            losses.append(loss)
        else:
            losses.append(hf.one())
        warm.append(time.perf_counter() - t1)
    if a.profile:
        return dict(side="hf", profile=bc.hf_profile(hf, 12))
    stats, _, _ = bc.clean_loop(lambda: losses.append(hf.one()), a.runs, int(a.threads))
    st = bc.proc_status()
    # one more step, untimed, after the peak RSS was read: which kernels the products ran on
    kernels = bc.hf_kernels(hf) if a.kernels else None
    res = dict(side="hf", load_s=load_s, warmup_s=warm, first_loss=losses[0], losses=losses,
               peak_rss=st["VmHWM"], rss_after_load=after_load["VmRSS"],
               rss_end_anon=st["RssAnon"], rss_end_file=st["RssFile"], kernels=kernels,
               **hf.facts, **stats)
    res["tokens_per_s"] = res["tokens"] / res["median_s"]
    res["target_tokens_per_s"] = res["n_targets"] / res["median_s"]
    if a.worker_limits:
        res["limits"] = bl.hf_limits(a.hf_dtype, bl.parse_shapes(a.probe_shapes or ""), flops)
    return res


# --------------------------------------------------------------------------------------------
# orchestration
# --------------------------------------------------------------------------------------------

def prepare(name: str, a) -> dict | None:
    """Model record {name, gguf, hf, vocab, desc, weights, n_params} or None (skipped)."""
    if name == "default":
        if not a.default_gguf.exists():
            print(f"[default] skipped: {a.default_gguf} is absent", flush=True)
            return None
        from pytrain.models.model_file import open_model
        cfg = open_model(a.default_gguf)[3]
        hf = a.default_hf if (a.default_hf / "model.safetensors").exists() else None
        if getattr(a, "no_hf", False):      # (bench_dpo's own arguments have none)
            hf = None
        elif hf is None:
            print(f"[default] HF side skipped: no HF checkpoint at {a.default_hf}", flush=True)
        return dict(name="default", gguf=a.default_gguf, hf=hf, vocab=int(cfg.n_vocab),
                    desc=f"embedded default model: hidden {cfg.n_embd}, {cfg.n_layer} layers, "
                         f"vocab {cfg.n_vocab}", weights="F32 / f32", n_params=None)
    if name in bc.REAL:
        return prepare_real(name, a)
    if name not in SPECS:
        print(f"[{name}] unknown model", flush=True)
        return None
    spec = SPECS[name]
    d = bc.ensure_model(name, a.cache, a.ref_python, "bench_train")
    if d is None:
        return None
    done = json.loads((d / "done.json").read_text())
    return dict(name=name, gguf=d / done["gguf"],
                hf=None if getattr(a, "no_hf", False) else d / "hf",
                vocab=spec["config"]["vocab_size"],
                desc=spec["desc"], n_params=done["n_params"],
                weights=f"{spec['outtype'].upper()} / f32")


def prepare_real(name: str, a) -> dict | None:
    """Model record of a real model (bench_common.REAL): its fetched GGUF, the HF folder of
    its weights (made when absent), its file type and tensor types.  ``type_choice``: pytrain
    loads it as a training run would."""
    d = bc.ensure_model(name, a.cache, a.ref_python, "bench_train")
    if d is None:
        return None
    done = json.loads((d / "done.json").read_text())
    gguf = bc.real_gguf(name)
    file_type, counts = bc.gguf_types(gguf)
    tensors = ", ".join(f"{k} x {v}" for k, v in counts.items())
    return dict(name=name, gguf=gguf, hf=None if getattr(a, "no_hf", False) else d / "hf",
                vocab=done["vocab"], desc=f"{bc.REAL[name]['desc']}; {gguf.name}",
                n_params=done["n_params"], file_type=file_type, type_choice=True,
                weights=f"file type {file_type} ({tensors}) / f32 (HF: dequantized to float32)")


def run_worker(python: str, side: str, model: dict, a, threads: int, profile: bool = False,
               batch=BATCH, steps: int | None = None, warmup: int | None = None,
               blas: bool = True, recompute: str | None = None, compute_type: str = "f32",
               hf_dtype: str | None = None, limits: bool = False,
               probe_shapes: str = "") -> dict | None:
    """One worker process; ``blas=False`` runs pytrain with PYTRAIN_BLAS=0 (its CPU backend
    alone), ``recompute`` overrides --recompute, ``compute_type`` is pytrain's, ``hf_dtype``
    overrides --hf-dtype; ``limits``: the worker also measures where the limit is
    (scripts/bench_limits.py; the HF side's torch probes at ``probe_shapes``)."""
    hf_dtype = hf_dtype or a.hf_dtype
    cmd = [python, "-m", "scripts.bench_train", "--worker", side, "--threads", str(threads),
           "--runs", str(a.steps if steps is None else steps),
           "--warmup", str(a.warmup if warmup is None else warmup),
           "--batch", str(batch[0]), str(batch[1]), "--vocab", str(model["vocab"]),
           "--hf-attn", a.hf_attn, "--hf-dtype", hf_dtype, "--compute-type", compute_type,
           "--recompute", recompute or a.recompute, "--nice", str(a.nice)]
    if profile:
        cmd += ["--profile", "--warmup", "1"]
    elif limits:
        cmd += ["--limits", "--probe-top", str(a.probe_top), "--probe-square", str(a.probe_square)]
        if side == "hf":
            cmd += ["--probe-shapes", probe_shapes]
    cmd += ["--gguf", str(model["gguf"])] if side == "pytrain" else ["--hf", str(model["hf"])]
    if side == "pytrain" and model.get("type_choice"):
        cmd += ["--type-choice"]
    env = bc.worker_env(threads, **({} if blas else {"PYTRAIN_BLAS": "0"}))
    busy = bc.wait_quiet(a.quiet_wait) if a.quiet_wait else bc.machine_busy()
    kind = compute_type if side == "pytrain" else hf_dtype
    what = (f"{side} {kind}{'' if blas else ' BLAS off'}"
            f"{f' recompute={recompute}' if recompute else ''}"
            f"{' profile' if profile else ''}, {threads} thread{'s' if threads > 1 else ''}")
    print(f"  [{model['name']}] {what} ... (machine busy {busy:.2f} cores before; load average "
          f"{os.getloadavg()[0]:.2f})", flush=True)
    res, r = bc.run_result(cmd, env, start_new_session=bool(a.nice))
    if res is None:
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-6000:])
        print(f"  [{model['name']}] {what} FAILED (exit {r.returncode})", flush=True)
        return None
    res.update(busy_before=busy, threads=threads, loadavg_before=os.getloadavg())
    if "tokens_per_s" in res:
        print(f"  [{model['name']}] {what}: {res['tokens_per_s']:.1f} tokens/s "
              f"({res['target_tokens_per_s']:.1f} target tokens/s; {res['n_clean']} clean of "
              f"{len(res['times'])}: " + ", ".join(f"{t:.3f} s ({o:.2f})" for t, o in
                                                  zip(res["times"], res["others"]))
              + f"), first loss {res['first_loss']:.5f}, peak RSS "
              f"{res['peak_rss'] / 2**30:.2f} GiB", flush=True)
    return res


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------

def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="default,mid,mid-v248k")
    ap.add_argument("--threads", default=None,
                    help="thread counts, comma-separated (e.g. 2,1; default 2); the profile uses "
                         "the first (--report-from: default the run's)")
    ap.add_argument("--model-threads", action="append", default=[], metavar="NAME=T[,T...]",
                    help="thread counts for one model instead of --threads (e.g. 2b=2)")
    ap.add_argument("--blas-off", default="default,mid,mid-v248k", metavar="MODELS",
                    help="models whose pytrain side also runs with PYTRAIN_BLAS=0 ('' for none)")
    ap.add_argument("--one-graph", default="2b", metavar="MODELS",
                    help="models whose pytrain side, when recompute auto chose layer-wise "
                         "recompute, also runs as one graph (recompute=off) ('' for none)")
    ap.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="dtype of the main HF + PEFT reference (the 'HF' columns)")
    ap.add_argument("--bf16", default="auto", choices=["auto", "on", "off"],
                    help="also run each row in bfloat16: pytrain compute_type bf16 and HF + PEFT "
                         "in the other dtype than --hf-dtype (auto: when the CPU has avx512_bf16 "
                         "or amx_bf16; on: also without them, emulated and slow)")
    ap.add_argument("--recompute", default="auto", choices=["auto", "off", "layers"])
    ap.add_argument("--steps", type=int, default=5, help="clean timed steps wanted per side")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pytrain" / "bench")
    ap.add_argument("--ref-python", default="/opt/refenv/bin/python")
    ap.add_argument("--pytrain-python", default=sys.executable)
    ap.add_argument("--default-gguf", type=Path, default=bc.DEFAULT_GGUF)
    ap.add_argument("--default-hf", type=Path, default=Path("/tmp/pytrain-default-model/hf"))
    ap.add_argument("--hf-attn", default="sdpa")
    ap.add_argument("--nice", type=int, default=0,
                    help="niceness of the worker processes; on a shared machine -20 (root)")
    ap.add_argument("--no-profile", dest="do_profile", action="store_false")
    ap.add_argument("--no-hf", action="store_true",
                    help="run pytrain's sides only (no HF + PEFT reference; its model is still "
                         "made by the reference stack when not cached)")
    ap.add_argument("--no-limits", dest="limits", action="store_false",
                    help="skip the \"Where the limit is\" measurements (product FLOPs, matmul "
                         "probes, the profiled step's time outside the products)")
    ap.add_argument("--probe-top", type=int, default=3, metavar="K",
                    help="probe the K product shapes holding the most of a step's FLOPs "
                         "(default 3)")
    ap.add_argument("--probe-square", type=int, default=2048, metavar="N",
                    help="also probe an N x N x N product (default 2048; 0: none)")
    ap.add_argument("--quiet-wait", type=float, default=120.0,
                    help="before each process, wait up to this many seconds for other processes "
                         "to use < 0.3 cores (0: do not wait)")
    ap.add_argument("--out", type=Path, default=None,
                    help="the markdown (default bench_results/train.md)")
    ap.add_argument("--note", dest="notes", action="append", default=[])
    ap.add_argument("--json", type=Path, default=None,
                    help="also save the raw results here (default: the .json beside --out; "
                         "with --report-from of one json: store the --note lines into it)")
    ap.add_argument("--report-from", type=Path, nargs="+", default=None,
                    help="only rewrite the markdown from --json files of earlier runs")
    # internal
    ap.add_argument("--make", choices=sorted({**SPECS, **bc.REAL}), help=argparse.SUPPRESS)
    ap.add_argument("--type-choice", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--into", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=["pytrain", "hf"], help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--limits", dest="worker_limits", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--probe-shapes", default="", help=argparse.SUPPRESS)
    ap.add_argument("--compute-type", default="f32", choices=["f32", "bf16"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--no-kernels", dest="kernels", action="store_false", help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=5, help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--hf", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1234, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.model_thread_lists = {k.strip(): [int(t) for t in v.split(",") if t.strip()]
                            for k, _, v in (mt.partition("=") for mt in a.model_threads)}
    return a


def _write(md: str, out: Path) -> None:
    print(md)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    print(f"wrote {out}")


def report_from(a) -> int:
    """--report-from: merge earlier runs (rows in order, all loads) into one markdown."""
    js = [json.loads(f.read_text()) for f in a.report_from]
    a.thread_list = [int(t) for t in str(a.threads or ",".join(
        map(str, js[0].get("threads") or [2]))).split(",") if t.strip()]
    out = a.out or REPO / "bench_results" / "train.md"
    if a.notes and a.json and len(js) == 1 and a.json.resolve() == a.report_from[0].resolve():
        js[0]["notes"] = a.notes      # the json keeps the notes: it still renders byte for byte
        a.json.write_text(json.dumps(js[0], default=str, indent=1))
        print(f"notes stored into {a.json}")
    a.notes = a.notes or [n for j in js for n in j.get("notes", [])]
    _write(report([r for j in js for r in j["rows"]], a, [x for j in js for x in j["loads"]],
                  js[0].get("info"), [x for j in js for x in j.get("extra_steps") or []]), out)
    return 0


def bf16_rows(mode: str) -> bool:
    """Whether each row also runs in bfloat16 (--bf16): auto = when this CPU has bf16 units."""
    if mode != "auto":
        return mode == "on"
    from pytrain.models.precision import cpu_bf16_units
    units = cpu_bf16_units()
    print(f"--bf16 auto: CPU bf16 units {', '.join(units) or 'none'}: bf16 rows "
          f"{'run' if units else 'not run'}", flush=True)
    return bool(units)


def probe_shapes(p: dict | None, a) -> list[list[int]]:
    """(M, N, K, batch) of the products the HF side's torch probe runs: those pytrain's ggml
    probe ran (its step's largest, and the square), or the square alone."""
    if p and p.get("limits"):
        return [x["mnkb"] for x in p["limits"]["probes"]]
    n = a.probe_square
    return [[n, n, n, 1]] if n else []


def bench_row(name: str, model: dict, a, threads: int, first: bool) -> dict:
    """One model at one thread count: pytrain (and its variants), HF, and the profiles."""
    batch, warmup, steps = train_settings(name, a)
    print(f"[{name}] batch {batch[0]} x {batch[1]}, {warmup} warm-up + {steps} clean steps, "
          f"{threads} threads", flush=True)
    row = dict(model, threads=threads, batch=list(batch))
    if a.no_hf:
        row["no_hf"] = True
    if a.limits and a.onednn_isa:
        row["onednn_isa"] = a.onednn_isa
    kw = dict(batch=batch, steps=steps, warmup=warmup)
    run = lambda python, side, **k: run_worker(python, side, model, a, threads, **k)  # noqa: E731
    row["pytrain"] = run(a.pytrain_python, "pytrain", limits=a.limits, **kw)
    if name in a.blas_off.split(","):
        row["pytrain_noblas"] = run(a.pytrain_python, "pytrain", blas=False, **kw)
    shapes = bl.format_shapes(probe_shapes(row["pytrain"], a))
    hkw = dict(kw, limits=a.limits, probe_shapes=shapes)
    row["hf"] = run(a.ref_python, "hf", **hkw) if model["hf"] else None
    if a.bf16_rows:
        row["pytrain_bf16"] = run(a.pytrain_python, "pytrain", compute_type="bf16",
                                  limits=a.limits, **kw)
        other = "float32" if a.hf_dtype == "bfloat16" else "bfloat16"
        if model["hf"]:      # the second reference: hf_bf16 (or hf_f32 beside a bf16 "hf")
            row[HF_OTHER[other]] = run(a.ref_python, "hf", hf_dtype=other, **hkw)
    p = row["pytrain"]
    if name in a.one_graph.split(",") and p and "recompute" in (p.get("step_graph") or ""):
        row["pytrain_onegraph"] = run(a.pytrain_python, "pytrain", recompute="off", **kw)
    for k, v in {"hf": "HF", **VARIANTS}.items():
        if p and row.get(k):
            print(f"  [{name}] pytrain / {v} = "
                  f"{p['tokens_per_s'] / row[k]['tokens_per_s']:.2f}", flush=True)
    for line in bf16_ratio_lines(row):
        print(f"  [{name}] {line}", flush=True)
    # the limits' profiled step is the profile (no process of its own); kept once per row
    own = {k: row[k]["limits"].pop("profile") for k in ("pytrain", "pytrain_bf16")
           if (row.get(k) or {}).get("limits")}
    if a.do_profile and first:
        if "pytrain" in own:
            row["pytrain_profile"] = own["pytrain"]
        else:
            pp = run(a.pytrain_python, "pytrain", profile=True, batch=batch)
            row["pytrain_profile"] = pp and pp["profile"]
        if model["hf"]:
            hp = run(a.ref_python, "hf", profile=True, batch=batch)
            row["hf_profile"] = hp and hp["profile"]
    return row


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(x == "--device" or x.startswith("--device=") for x in argv):
        from scripts import bench_train_gpu   # the GPU benchmark (its --device cpu: a dry run)
        return bench_train_gpu.main(argv)
    a = parse(argv)
    if a.make:
        bc.make_model(a.make, a.into)
        return 0
    if a.worker:
        bc.renice(a.nice)
        res = pytrain_worker(a) if a.worker == "pytrain" else hf_worker(a)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    if a.report_from:
        return report_from(a)
    a.thread_list = [int(t) for t in str(a.threads or "2").split(",") if t.strip()]
    a.bf16_rows = bf16_rows(a.bf16)
    t_isa = time.perf_counter()
    a.onednn_isa = bl.onednn_isa(a.pytrain_python) if a.limits else ""
    if a.limits:
        print(f"oneDNN: {a.onednn_isa or 'no verbose output'} "
              f"({time.perf_counter() - t_isa:.1f} s)", flush=True)
    a.out = a.out or REPO / "bench_results" / "train.md"
    a.json = a.json or a.out.with_suffix(".json")
    t_start = time.time()
    loads, rows = [os.getloadavg()], []
    for name in [m.strip() for m in a.models.split(",") if m.strip()]:
        model = prepare(name, a)
        for ti, threads in enumerate(a.model_thread_lists.get(name, a.thread_list) if model else []):
            rows.append(bench_row(name, model, a, threads, ti == 0))
            loads.append(os.getloadavg())
    if not rows:
        print("nothing was benchmarked")
        return 1
    info = machine_info(a, time.time() - t_start)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(dict(rows=rows, loads=loads, info=info, notes=a.notes,
                                      threads=a.thread_list, wall_s=time.time() - t_start),
                                 default=str, indent=1))
    print(f"raw results in {a.json}")
    _write(report(rows, a, loads, info), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
