"""Benchmark: LoRA training tokens/s and peak memory of pytrain against HF transformers + PEFT
on CPU, plus the cost of the masked loss's label work at Qwen3.5's real vocabulary (248320).

Why: pytrain's training step should cost no more than the reference stack's on the same model,
the same batch and the same thread count; and the masked loss's per-micro-batch label work
(``pytrain/train/loss.py: MaskedCE.prepare`` = ``set_targets``, an O(N) upload; ``build_labels``, the
one-hot [V, N] label tensor filled on the backend; ``check_labels`` with its safety read, ONE
strided read of the label tensor's pad-token column, ``read_column``) must stay a negligible
share of a step.  A benchmark, not a test: nothing is asserted about speed.  Writes a markdown
table to ``bench_results/train.md`` (``--labels-only``: the label comparison alone, to
``bench_results/labels.md``).

Models (``--models``, comma-separated, default ``default,mid,mid-v248k``; the committed run adds ``2b``):
    default    the embedded ``pytrain/assets/default-model.gguf`` (``--default-gguf``; skipped with a
               message when absent); HF runs only when its HF checkpoint (``--default-hf``, default
               /tmp/pytrain-default-model/hf, left by scripts/make_default_model.py) exists
    mid        the project's CPU benchmark shape (hidden 512, 8 layers with full attention at 3 and 7,
               8/2 heads x 64, FFN 1536, DeltaNet 4/4 x 64, vocab 151936, tied; random weights, F32),
               made and cached by scripts/bench_forward.py's code (same cache folder)
    mid-v248k  the same shape with Qwen3.5's real vocabulary, 248320 (made the same way here)
    2b         the real size: the Qwen3.5-2B shape (hidden 2048, 24 layers with full attention every
               4th, 8/2 heads x 256, FFN 6144, DeltaNet 16/16 heads x 128, vocab 248320, tied; random
               weights rounded to F16), bench_forward's spec: an HF checkpoint stored float16 and an
               F16 GGUF (3.5 GiB each; ~8 GB of disk for both, made once, several minutes).  pytrain
               keeps the F16 weights (a BF16 GGUF loads as F16 on the CPU anyway); HF + PEFT upcasts
               to ``--hf-dtype`` (float32: on an AVX2 CPU without AVX-512/bf16 instructions bfloat16
               was far slower, see bench_results/train.md's notes).  Batch 1 x 512 (``TRAIN``), at most
               1 warm-up and 3 clean timed steps; pytrain's Trainer picks its layer-wise recompute
               there on a 24 GiB machine (``--recompute``, default auto: the one-graph compute buffer
               would exceed half of the memory left after the weights), HF keeps every activation.  Peak RSS ~13 GB on the HF side.

The training step, the same on both sides: batch 2 x 256 random token ids over the whole
vocabulary, every token real (no padding), the first half of each row a "prompt" whose labels
are masked (HF: label -100; pytrain: ``train_mask`` False), so 2 x 128 = 256 target tokens;
LoRA r=16, alpha=32, dropout 0, on q/k/v/o of the full-attention layers (pytrain:
``select_targets`` default = attn_q/attn_k/attn_v/attn_output of the attention layers; PEFT:
``target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]``, which only the attention layers
have); AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8, weight decay 0) with global-norm clipping at
1.0; float32 activations everywhere (2b: pytrain's matmuls read F16 weights, see above).
    pytrain: ``Trainer(m, lora.create(...), AdamWSettings(...)).step([batch], lr)`` (forward + masked CE +
             backward graph, grad-norm graph, AdamW graph, host-side input/label upload)
    HF:      ``Qwen3_5ForCausalLM`` (sdpa attention, torch DeltaNet fallback: no
             flash-linear-attention on CPU) wrapped by ``peft.get_peft_model``, ``model.train()``,
             ``loss = model(input_ids, labels=labels, use_cache=False).loss; loss.backward();
             clip_grad_norm_(1.0); opt.step(); opt.zero_grad(set_to_none=True)``
Both sides start from B = 0 adapters, so the first step's loss is the base model's masked loss on
the batch: the table shows both, a check that the two sides train the same model on the same
targets.

Timing: each side runs in its own subprocess (peak RSS = that process's VmHWM: imports, weights,
graphs, optimizer state, everything), once per thread count of ``--threads`` (default 2; e.g.
``2,1``; ``--model-threads 2b=2`` gives one model its own counts).  ``--warmup`` steps (default
2), then timed steps until ``--steps`` (default 5) *clean* ones are in (other processes kept < 0.3 cores busy beyond the cores the side leaves free) or 3x
that many were run; tokens/s = tokens / median clean step time (and from the fastest step).
On a shared machine ``--nice -20`` (root) runs each worker in its own session (scheduler
autogroup) at niceness -20, so that other jobs yield the cores while it runs; without it, ggml's
spinning thread pool loses far more than torch whenever another process takes a core.  "tokens" = all real tokens of the batch (B*T); "target tokens" = tokens with a label.
pytrain's steps are split into phases by wrapping pytrain functions at runtime (no pytrain code
changes): host input upload (the architecture's ``input_values``/``set_inputs``), the labels
(``MaskedCE.prepare``, split into ``set_targets``: host + O(N) upload; ``build_labels``: the
fill + SET_ROWS graph on the backend; ``read_column``: the pad-column read inside
``check_labels``), graph allocation (``Runtime.alloc_graph``), compute of the forward+backward
graph(s) (a layer-wise step's every layer graph and head chunk), compute of the optimizer
graphs, and the rest.

BLAS on / off (``--blas-off MODELS``, default ``default,mid,mid-v248k``): pytrain's Runtime puts
ggml's BLAS backend (OpenBLAS: large F32 MUL_MATs, matrix OUT_PRODs of any weight type) before
the CPU backend when the build has it; those models' pytrain side also runs, at every thread
count, with ``PYTRAIN_BLAS=0`` (the CPU backend alone, ggml-cpu's own kernels), a column of the
table and rows of the phase table.  Likewise ``--one-graph MODELS`` (default ``2b``): where the
Trainer's default (recompute auto) chose layer-wise recompute, the model's pytrain side also runs
as one graph (``recompute="off"``, every activation kept, as HF does).

Profile (``--no-profile`` skips): one extra pytrain step in its own process with a ggml
scheduler eval callback that computes the graph node by node and times each node (adds per-node
dispatch overhead, so the total is larger than a real step; shares are what matter), summed by
op and by part of the model (LM head + CE over the vocabulary, attention layers, DeltaNet
layers, FFN, LoRA; a layer-wise step's second forward of a layer as "(recompute)"), and by the
backend the scheduler ran each node on (``ggml_backend_sched_get_tensor_backend``: BLAS or
CPU); and one HF step under torch.profiler (top ops by self CPU time).

Label work, before and now (``--no-labels`` skips; ``--labels-only`` runs only this): the label
tensor of a real ``MaskedCE`` (``loss.build`` over a logits tensor [248320, N] in a small graph
allocated by ``Runtime.alloc_graph``, as the trainer's graphs are), N = B*T = 512 and 2048
(``--label-rows``), half the rows masked, no pad-id target.  Each repetition fills it both ways
on the same tensor, in alternating order:
    before (host one-hot, the previous pytrain; re-implemented here for comparison only, as
            ``loss.set_labels`` did it): numpy ``loss.label_rows`` [N, V] float32, its upload with
            ``ggml.from_numpy``, ``loss.read_column`` of the pad column, row mask + scale upload;
    now (built on the device): ``MaskedCE.set_targets`` (flat indices i*V + target_i and the row
            mask, O(N)), ``build_labels`` (fill 0 + SET_ROWS of ones on the backend),
            ``check_labels`` (of which ``read_column``, timed by wrapping it).
The pad-column read is also timed warm (repeated).  The device-built tensor is checked equal to
numpy's one-hot once per N.  Shares are taken against the measured mid-v248k step (batch 2 x 256,
N = 512) and a measured pytrain step of batch 8 x 256 on the same model (N = 2048;
``--no-big-step`` skips it and the N = 512 step is scaled x4 instead, said so in the table); with
``--labels-only`` the steps come from an earlier run's json (``--step-from``, default
bench_results/train.json), whose date and commit the report names.

LM-head backward alternatives (``--no-head`` skips): the head's dX product at E = 512, N = 512,
V = 151936 and 248320, computed alone as ggml's autodiff emits it (OUT_PROD with a transposed
gradient), as MUL_MAT from a transposed copy of the weight, and with numpy's BLAS for reference.

On a GPU: ``--device cuda`` runs scripts/bench_train_gpu.py instead (the Qwen3.5-2B shape at
batch 4 x 1024, frozen weights BF16 / F16 / Q8_0 / Q4_K, HF + PEFT in bf16 on the same GPU; it
passes every argument on and its docstring says what it measures) -> bench_results/train-cuda.md.

How (from the repo root, with the project's python, the native library built and the reference
stack of scripts/requirements-reference.txt in /opt/refenv):

    python3 scripts/bench_train.py                            # -> bench_results/train.md
    python3 scripts/bench_train.py --models mid --steps 3 --no-profile --out /tmp/train.md
    python3 scripts/bench_train.py --labels-only --out bench_results   # -> labels.md + labels.json

bench_results/train.md (+ train.json beside it) was made on a shared 2-core machine by the
command its header names (``--models default,mid,mid-v248k,2b --threads 2,1 --nice -20`` and
the 2b model at 2 threads only, ``--model-threads 2b=2``).

(``--json``, default the .json beside ``--out``, keeps the raw results; ``--report-from
bench_results/train.json`` rewrites the markdown from it byte for byte (the thread counts, the
notes and the header lines come from the json), or merges several runs, adding ``--note`` lines
(with one json and ``--json`` naming it, the notes are stored into it too, so it still renders
byte for byte); a json written before the device-built labels, whose phases time
``loss.set_labels``, is refused with a message naming the version of this script that renders
it; ``--report-from bench_results/labels.json --out bench_results`` rewrites labels.md).  Without
2b the run takes ~20 minutes per thread count on 2 cores; the mid-v248k model is generated on
first use (~30 s, ~0.6 GB under the cache), the 2b one in several minutes (~8 GB).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(SCRIPTS))
import bench_forward as bf  # noqa: E402  (model specs, generation, cache, machine info, load probes)

# Qwen3.5's real vocabulary on the mid shape: the LM head and the CE dominate there.
bf.SPECS.setdefault("mid-v248k", dict(
    bf.SPECS["mid"], config=dict(bf.SPECS["mid"]["config"], vocab_size=248320),
    seed=513, desc="the mid shape with vocab 248320 (Qwen3.5's)"))

RANK, ALPHA, LR, MAX_NORM = 16, 32.0, 1e-4, 1.0
BATCH = (2, 256)
V_REAL = 248320
# Per-model step settings other than BATCH and --warmup / --steps: the real-size 2B shape trains
# on batch 1 x 512 (half the tokens targets, as everywhere) with at most 1 warm-up and 3 clean
# timed steps (a step takes tens of seconds on 2 cores).
TRAIN = {"2b": dict(batch=(1, 512), warmup=1, steps=3)}


# Extra pytrain runs of a row, beside the default one (key in the row, label in the report):
# BLAS off = PYTRAIN_BLAS=0 (ggml's CPU backend alone; --blas-off), one graph = Trainer
# recompute="off" where the default (auto) chose layer-wise recompute (--one-graph).
VARIANTS = {"pytrain_noblas": "BLAS off", "pytrain_onegraph": "one graph, recompute=off"}


def train_settings(name: str, a) -> tuple[tuple[int, int], int, int]:
    """(batch, warm-up steps, clean timed steps wanted) of a model."""
    t = TRAIN.get(name, {})
    return (tuple(t.get("batch", BATCH)), min(a.warmup, t.get("warmup", a.warmup)),
            min(a.steps, t.get("steps", a.steps)))


# --------------------------------------------------------------------------------------------
# the batch (both sides)
# --------------------------------------------------------------------------------------------

def make_batch(vocab: int, B: int, T: int, seed: int):
    """tokens [B, T] int64, train_mask [B, T] bool (second half of each row), seg [B, T] (0)."""
    import numpy as np
    tokens = np.random.default_rng(seed).integers(0, vocab, size=(B, T)).astype(np.int64)
    train = np.zeros((B, T), bool)
    train[:, T // 2:] = True
    return tokens, train, np.zeros((B, T), np.int64)


def n_targets(train) -> int:
    """Targets after the shift: position t predicts t+1 when t+1 is trained."""
    return int(train[:, 1:].sum())


def _clean_loop(step, runs: int, threads: int):
    """Timed steps until `runs` clean ones are in or 3x runs were run (see bench_forward).  A step
    is clean when other processes kept fewer than CLEAN_OTHERS cores busy beyond the cores this
    side leaves free (a 1-thread run on 2 cores does not mind one busy core)."""
    hz = os.sysconf("SC_CLK_TCK")
    limit = bf.CLEAN_OTHERS + max(0, len(os.sched_getaffinity(0)) - threads)
    times, others, own, extra = [], [], [], []
    while sum(o < limit for o in others) < runs and len(times) < 3 * runs:
        j0, t0 = bf._cpu_jiffies(), time.perf_counter()
        e = step()
        j1, t1 = bf._cpu_jiffies(), time.perf_counter()
        times.append(t1 - t0)
        others.append(max(0.0, ((j1[0] - j0[0]) - (j1[1] - j0[1])) / hz / (t1 - t0)))
        own.append((j1[1] - j0[1]) / hz / (t1 - t0))
        extra.append(e)
    clean = [i for i, o in enumerate(others) if o < limit]
    use = clean or list(range(len(times)))
    return dict(times=times, others=others, n_clean=len(clean),
                median_s=statistics.median(times[i] for i in use), best_s=min(times),
                others_cores=statistics.mean(others), own_cores=statistics.mean(own)), extra, use


# --------------------------------------------------------------------------------------------
# pytrain worker
# --------------------------------------------------------------------------------------------

class _Phases:
    """Wraps pytrain functions at runtime to split a step's wall time into phases."""

    def __init__(self, trainer):
        import pytrain.train.loss as L
        from pytrain import ggml
        from dataclasses import replace
        self.t: dict[str, float] = {}
        self.tr = trainer
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

        grad_graphs = lambda: {ggml.address(g) for g, _ in _step_graphs(trainer)}  # noqa: E731
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
        # (sub-phases, not added into the step's sum): set_targets (host + O(N) upload, of which
        # the from_numpy calls), build_labels (fill + SET_ROWS on the backend), check_labels (of
        # which the pad-column read_column).  Methods are patched on the class, so prepare's
        # self.set_targets(...) etc. and check_labels' module-level read_column hit the wrappers.
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

    def take(self) -> dict:
        out, self.t = self.t, {}
        return out


def pytrain_worker(a) -> None:
    sys.path.insert(0, str(REPO))
    import pytrain
    from pytrain.models import lora
    from pytrain.models.lora_targets import lora_param_count, select_targets
    from pytrain.train.optimizer import AdamWSettings
    from pytrain.train.trainer import Trainer

    B, T = a.batch
    t0 = time.perf_counter()
    m = pytrain.load_model(a.gguf, device="cpu", threads=int(a.threads))
    names = select_targets(m.config)
    ad = lora.create(m.runtime, m.config, names, RANK, ALPHA, seed=0)
    tr = Trainer(m, ad, AdamWSettings(lr=LR, max_grad_norm=MAX_NORM), recompute=a.recompute)
    load_s = time.perf_counter() - t0
    after_load = bf._proc_status()
    tokens, train, seg = make_batch(a.vocab, B, T, a.seed)
    batch = SimpleNamespace(tokens=tokens, seg=seg, train_mask=train)
    ph = _Phases(tr)
    losses, warm = [], []
    for _ in range(a.warmup):
        t1 = time.perf_counter()
        r = tr.step([batch], LR)
        warm.append(time.perf_counter() - t1)
        losses.append(r.loss)
    ph.take()
    results = []

    def step():
        r = tr.step([batch], LR)
        results.append(r)
        p = ph.take()
        p["rest"] = r.seconds - sum(v for k, v in p.items() if "." not in k)
        return p

    if a.profile:
        res = dict(side="pytrain", profile=profile_pytrain(tr, batch, m.config), blas=m.runtime.blas is not None)
        print("RESULT " + json.dumps(res), flush=True)
        return
    stats, phases, use = _clean_loop(step, a.runs, int(a.threads))
    st = bf._proc_status()
    r0 = results[0]
    keys = sorted({k for p in phases for k in p})
    phase_med = {k: statistics.median(phases[i].get(k, 0.0) for i in use) for k in keys}
    step_med = statistics.median(results[i].seconds for i in use)
    res = dict(side="pytrain", load_s=load_s, warmup_s=warm, first_loss=losses[0] if losses else r0.loss,
               losses=losses + [r.loss for r in results], tokens=r0.tokens, n_targets=r0.n_valid,
               lora_params=lora_param_count(m.config, names, RANK), lora_names=len(names),
               phases=phase_med, step_seconds=step_med, pad_id=m.tokenizer.pad_id,
               peak_rss=st["VmHWM"], rss_after_load=after_load["VmRSS"], rss_end_anon=st["RssAnon"],
               rss_end_file=st["RssFile"], graph_nodes=_graph_nodes(tr), batch=[B, T],
               loss_rows=sorted({int(g.ce.n_rows) for g in tr.graphs.values() if getattr(g, "ce", None)}),
               step_graph=_step_kind(tr), recompute=a.recompute, blas=m.runtime.blas is not None,
               backends=[_backend_name(b) for b in m.runtime.backends],
               type_policy="auto", weight_types=_weight_types(m), **stats)
    res["tokens_per_s"] = B * T / res["median_s"]
    res["target_tokens_per_s"] = res["n_targets"] / res["median_s"]
    print("RESULT " + json.dumps(res), flush=True)


def _step_graphs(tr) -> list[tuple]:
    """The trainer's step graphs as (graph, kind): a ``GradGraph``'s one graph (kind "one"), or
    a ``RecomputeGraph``'s layer-wise graphs ("pre": embedding and the layers below the first
    adapter, "fwd": one layer forward, "head": head + loss on a chunk of rows, "bwd": one layer
    recomputed and differentiated)."""
    out = []
    for g in tr.graphs.values():
        if hasattr(g, "bwd"):   # RecomputeGraph
            out += [(g.pre.graph, "pre"), *((f.graph, "fwd") for f in g.fwd), (g.head.graph, "head"),
                    *((b.graph, "bwd") for b in g.bwd.values())]
        else:
            out.append((g.graph, "one"))
    return out


def _step_kind(tr) -> str:
    """How the trainer ran the step: one graph, or layer-wise recompute (head chunk rows)."""
    kinds = []
    for g in tr.graphs.values():
        if hasattr(g, "bwd"):
            kinds.append(f"layer-wise recompute (layers {g.l0}-{g.model.config.n_layer - 1} run forward twice; "
                         f"head + loss on chunks of {g.rows} rows)")
        else:
            kinds.append("one graph")
    return "; ".join(kinds)


def _weight_types(m) -> dict[str, int]:
    """Weight tensors by GGUF type -> type as loaded (``Weights.report``), counted."""
    out: dict[str, int] = {}
    for r in getattr(m.weights, "report", {}).values():
        k = f"{r.file_type}->{r.loaded_type}" if r.file_type != r.loaded_type else str(r.loaded_type)
        out[k] = out.get(k, 0) + 1
    return out


def _backend_name(b) -> str:
    from pytrain.ggml import ffi, lib
    return ffi.string(lib.ggml_backend_name(b)).decode()


def _graph_nodes(tr) -> int:
    from pytrain.ggml import lib
    return sum(int(lib.ggml_graph_n_nodes(g)) for g, _ in _step_graphs(tr))


def label_graph(graph, config, recompute: bool = False) -> dict[int, str]:
    """Part of the model each node of a step graph belongs to (address -> label).

    The graph's loss is its node flagged as such (``ggml_set_loss``: the masked CE, or a
    layer-wise backward graph's surrogate); a graph without one is all forward.  ``recompute``:
    the graph is a layer-wise backward graph, whose forward nodes recompute the layer
    (labelled "... (recompute)").

    Forward nodes (up to the loss): by the weights they read (blk.N.ffn_* / post_attention_norm
    -> FFN, other blk.N weights -> the layer's mixer: attention or DeltaNet, LoRA A/B -> LoRA,
    token_embd/output as the head -> LM head + CE, as get_rows -> embedding), else inherited from
    the latest-computed source (LoRA and inputs only when nothing else is there).  Backward
    nodes: the label of the forward node whose gradient they are (ggml_graph_get_grad);
    temporaries take the label of the next registered gradient after them."""
    from pytrain import ggml
    from pytrain.ggml import ffi, lib
    n = int(lib.ggml_graph_n_nodes(graph))
    nodes = [lib.ggml_graph_node(graph, i) for i in range(n)]
    flagged = [i for i, t in enumerate(nodes) if t.flags & lib.GGML_TENSOR_FLAG_LOSS]
    loss_i = flagged[-1] if flagged else n - 1
    index = {ggml.address(t): i for i, t in enumerate(nodes)}
    kind = {i: ("DeltaNet" if r else "attention") for i, r in enumerate(config.recurrent)}
    HEAD, LORA, INPUTS = "LM head + CE", "LoRA", "inputs"
    label: dict[int, str] = {}

    def weight_label(t, op):
        nm = ggml.name(t)
        if nm.startswith("blk."):
            parts = nm.split(".")
            if ".lora_" in nm:
                return LORA
            il, w = int(parts[1]), parts[2]
            return "FFN" if (w.startswith("ffn_") or w == "post_attention_norm") else kind.get(il, "layers")
        if nm in ("token_embd.weight", "output.weight"):
            return "embedding" if op == "GET_ROWS" else HEAD
        if nm == "output_norm.weight":
            return HEAD
        return None

    for i in range(loss_i + 1):
        t = nodes[i]
        op = ggml.op_name(t)
        if op.startswith("CROSS_ENTROPY"):
            label[ggml.address(t)] = HEAD
            continue
        if op == "NONE":   # a parameter (LoRA A/B) or an input
            label[ggml.address(t)] = weight_label(t, op) or INPUTS
            continue
        found, best, best_i, low = None, None, -1, None
        for j in range(10):
            s = t.src[j]
            if s == ffi.NULL:
                continue
            w = weight_label(s if s.view_src == ffi.NULL else s.view_src, op)
            a = ggml.address(s)
            if w is not None:
                if found is None or found == LORA:
                    found = w
            elif a in label:
                lab = label[a]
                if lab in (LORA, INPUTS):
                    low = LORA if LORA in (low, lab) else lab
                elif index[a] > best_i:
                    best, best_i = lab, index[a]
        label[ggml.address(t)] = found or best or low or INPUTS
    grads = {}
    for i in range(loss_i + 1):
        g = lib.ggml_graph_get_grad(graph, nodes[i])
        if g != ffi.NULL:
            grads[ggml.address(g)] = label[ggml.address(nodes[i])]
    carry = HEAD
    for i in range(n - 1, loss_i, -1):
        a = ggml.address(nodes[i])
        carry = grads.get(a, carry)
        label[a] = carry + " (bwd)" if not carry.endswith("(bwd)") else carry
    if recompute:
        for i in range(loss_i + 1):
            label[ggml.address(nodes[i])] += " (recompute)"
    return label


def profile_pytrain(tr, batch, config) -> dict:
    """One step computed node by node (ggml sched eval callback), time summed by part and op, and
    by the backend the scheduler gave each node (BLAS or CPU: ``ggml_backend_sched_get_tensor_backend``).
    No-op nodes (views, reshapes, permutes) are left out; the median of their times (the per-node
    dispatch overhead) is subtracted from every other node.  Nodes of graphs other than the step's
    (the optimizer's, the label fill) count as "optimizer"."""
    from pytrain import ggml
    from pytrain.ggml import ffi, lib
    rt = tr.model.runtime
    if not tr.graphs:      # the step graphs exist after the warm-up; else make them
        tr.step([batch], LR)
    labels: dict[int, str] = {}
    for g, kind in _step_graphs(tr):
        labels.update(label_graph(g, config, recompute=kind == "bwd"))
    names = {ggml.address(b): _backend_name(b) for b in rt.backends}
    noop = {"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"}
    recs: list[tuple[str, str, str, float]] = []
    state = {"t": 0.0}

    @ffi.callback("bool(struct ggml_tensor *, bool, void *)")
    def cb(t, ask, _ud):
        now = time.perf_counter()
        if ask:
            state["t"] = now
            return True
        b = lib.ggml_backend_sched_get_tensor_backend(rt.sched, t)
        be = names.get(ggml.address(b), "?") if b != ffi.NULL else "?"
        recs.append((labels.get(ggml.address(t), "optimizer"), ggml.op_name(t), be, now - state["t"]))
        return True

    lib.ggml_backend_sched_set_eval_callback(rt.sched, cb, ffi.NULL)
    t0 = time.perf_counter()
    try:
        tr.step([batch], LR)
    finally:
        lib.ggml_backend_sched_set_eval_callback(rt.sched, ffi.cast("ggml_backend_sched_eval_callback", 0),
                                                 ffi.NULL)
    wall = time.perf_counter() - t0
    over = statistics.median([dt for _, op, _, dt in recs if op in noop] or [0.0])
    by_op: dict[str, float] = {}
    by_part: dict[str, float] = {}
    by_part_op: dict[str, float] = {}
    by_backend: dict[str, float] = {}
    by_op_backend: dict[str, float] = {}
    by_part_op_backend: dict[str, float] = {}
    count_op_backend: dict[str, int] = {}
    for part, op, be, dt in recs:
        if op in noop:
            continue
        dt = max(0.0, dt - over)
        for d, k in ((by_op, op), (by_part, part), (by_part_op, f"{part}: {op}"), (by_backend, be),
                     (by_op_backend, f"{op} [{be}]"), (by_part_op_backend, f"{part}: {op} [{be}]")):
            d[k] = d.get(k, 0.0) + dt
        count_op_backend[f"{op} [{be}]"] = count_op_backend.get(f"{op} [{be}]", 0) + 1
    return dict(wall=wall, overhead=over, n_nodes=len(recs), by_op=by_op, by_part=by_part,
                by_part_op=by_part_op, by_backend=by_backend, by_op_backend=by_op_backend,
                by_part_op_backend=by_part_op_backend, count_op_backend=count_op_backend,
                step_graph=_step_kind(tr), backends=[_backend_name(b) for b in rt.backends])


# --------------------------------------------------------------------------------------------
# HF worker
# --------------------------------------------------------------------------------------------

def hf_worker(a) -> None:
    import torch
    import transformers
    import peft
    from peft import LoraConfig, get_peft_model
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM
    torch.set_num_threads(int(a.threads))
    B, T = a.batch
    t0 = time.perf_counter()
    model = Qwen3_5ForCausalLM.from_pretrained(a.hf, dtype=getattr(torch, a.hf_dtype),
                                               attn_implementation=a.hf_attn)
    pm = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none",
                                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                          task_type="CAUSAL_LM"))
    pm.train()
    params = [p for p in pm.parameters() if p.requires_grad]
    n_lora = sum(p.numel() for p in params)
    lora_dtypes = sorted({str(p.dtype).replace("torch.", "") for p in params})
    lora_mods = sum(1 for n, _ in pm.named_modules() if n.endswith(".lora_A.default"))
    opt = torch.optim.AdamWSettings(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    load_s = time.perf_counter() - t0
    after_load = bf._proc_status()
    tokens, train, _seg = make_batch(a.vocab, B, T, a.seed)
    ids = torch.from_numpy(tokens)
    labels = ids.clone()
    labels[torch.from_numpy(~train)] = -100

    def one():
        loss = pm(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    losses, warm = [], []
    for _ in range(a.warmup):
        t1 = time.perf_counter()
        losses.append(one())
        warm.append(time.perf_counter() - t1)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t1 = time.perf_counter()
            one()
            wall = time.perf_counter() - t1
        ka = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        top = [(e.key, e.self_cpu_time_total / 1e6) for e in ka[:12]]
        print("RESULT " + json.dumps(dict(side="hf", profile=dict(wall=wall, top=top))), flush=True)
        return
    stats, _, _ = _clean_loop(lambda: losses.append(one()), a.runs, int(a.threads))
    st = bf._proc_status()
    res = dict(side="hf", load_s=load_s, warmup_s=warm, first_loss=losses[0], losses=losses,
               tokens=B * T, n_targets=int((labels[:, 1:] != -100).sum()), lora_params=n_lora,
               lora_names=lora_mods, peak_rss=st["VmHWM"], rss_after_load=after_load["VmRSS"],
               rss_end_anon=st["RssAnon"], rss_end_file=st["RssFile"], torch=torch.__version__,
               transformers=transformers.__version__, peft=peft.__version__,
               attn=model.config._attn_implementation, dtype=a.hf_dtype, lora_dtypes=lora_dtypes, **stats)
    res["tokens_per_s"] = B * T / res["median_s"]
    res["target_tokens_per_s"] = res["n_targets"] / res["median_s"]
    print("RESULT " + json.dumps(res), flush=True)


# --------------------------------------------------------------------------------------------
# label work at vocab 248320: before (host one-hot) and now (built on the device)
# --------------------------------------------------------------------------------------------

def _old_set_labels(ce, targets, n_vocab: int, pad_id: int, read_column) -> dict:
    """The previous pytrain's ``loss.set_labels`` (commit 9bbf5b4 and before), re-implemented
    here for comparison only, against a MaskedCE's inputs: the one-hot rows built in numpy
    (``loss.label_rows``, [N, V] float32), uploaded whole into the F32 [V, N] label tensor, then
    ONE read of its pad-token column, then the row mask and the loss scale uploaded.  Returns the
    parts' seconds."""
    import numpy as np
    from pytrain import ggml
    from pytrain.train import loss as L
    inp = ce.inputs
    flat = targets.reshape(-1)
    n = flat.size
    t0 = time.perf_counter()
    rows = L.label_rows(flat, n_vocab)
    t1 = time.perf_counter()
    ggml.from_numpy(inp.labels, rows)
    t2 = time.perf_counter()
    real = flat >= 0
    col = read_column(inp.labels, pad_id)
    t3 = time.perf_counter()
    assert not ((col != 0) & ~real).any()     # the old code zeroed such rows; none here
    has_label = (col != 0) | (real & (flat != pad_id))
    n_valid = int(has_label.sum())
    ggml.from_numpy(inp.row_mask, has_label.astype(np.float32).reshape(n, 1))
    ggml.from_numpy(inp.loss_scale, np.array([n / n_valid if n_valid else 0.0], np.float32))
    t4 = time.perf_counter()
    del rows
    t5 = time.perf_counter()
    return dict(label_rows=t1 - t0, upload=t2 - t1, read_column=t3 - t2, rest=t4 - t3, free=t5 - t4,
                total=t5 - t0, n_valid=n_valid)


def labels_worker(a) -> None:
    sys.path.insert(0, str(REPO))
    import numpy as np
    from pytrain import ggml
    from pytrain.train import loss as L
    from pytrain.ggml import lib
    rt = ggml.Runtime("cpu", threads=int(a.threads))
    V = a.vocab
    pad_id = a.pad_id
    rng = np.random.default_rng(7)
    last = {}
    read0 = L.read_column

    def read_column(*args):   # what check_labels calls (module global): its read timed alone
        t0 = time.perf_counter()
        try:
            return read0(*args)
        finally:
            last["read"] = time.perf_counter() - t0

    L.read_column = read_column
    out = {}
    med = statistics.median
    for N in a.rows:
        ctx = ggml.Context(n_tensors=32, graph_size=64)
        logits = lib.ggml_new_tensor_2d(ctx.ptr, lib.GGML_TYPE_F32, V, N)
        lib.ggml_set_input(logits)
        ce = L.build(rt, ctx.ptr, logits, V, N)
        lib.ggml_set_output(ce.loss)
        graph = ggml.new_graph(ctx, 64)
        lib.ggml_build_forward_expand(graph, ce.loss)
        rt.alloc_graph(graph, ctx)                            # labels placed as the trainer's are
        labels = ce.inputs.labels
        tg = rng.integers(0, V, N).astype(np.int64)
        tg[rng.permutation(N)[: N // 2]] = L.IGNORE          # half the rows masked
        tg[tg == pad_id] = pad_id + 1
        n_real = int((tg >= 0).sum())
        # touch every page once, then check that both ways give numpy's one-hot
        assert ce.prepare(tg, pad_id) == n_real
        ref = L.label_rows(tg, V)
        got = ggml.to_numpy(labels).reshape(N, V)
        assert np.array_equal(got, ref), "device-built labels differ from numpy's one-hot"
        del got
        ce.set_targets(np.full(N, L.IGNORE, np.int64))       # an all-zero tensor, so that the
        ce.build_labels()                                     # old way's check is not vacuous
        assert not read0(labels, int(tg[tg >= 0][0])).any()
        assert _old_set_labels(ce, tg, V, pad_id, read0)["n_valid"] == n_real
        got = ggml.to_numpy(labels).reshape(N, V)
        assert np.array_equal(got, ref)
        del got, ref
        old, new = [], []
        for rep in range(a.reps):
            for way in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                if way == "old":
                    d = _old_set_labels(ce, tg, V, pad_id, read_column)
                    assert d["n_valid"] == n_real
                else:
                    t0 = time.perf_counter()
                    ce.set_targets(tg)
                    t1 = time.perf_counter()
                    ce.build_labels()
                    t2 = time.perf_counter()
                    n_valid = ce.check_labels(tg, pad_id)
                    t3 = time.perf_counter()
                    assert n_valid == n_real
                    d = dict(set_targets=t1 - t0, build_labels=t2 - t1, check_labels=t3 - t2,
                             read_column=last["read"], total=t3 - t0)
                t4 = time.perf_counter()
                for _ in range(20):                           # warm: the same read repeated
                    col = read0(labels, pad_id)
                d["read_warm"] = (time.perf_counter() - t4) / 20
                assert col.shape == (N,) and not col.any()
                (old if way == "old" else new).append(d)
        out[str(N)] = dict(
            label_bytes=int(lib.ggml_nbytes(labels)), n_valid=n_real, reps=a.reps,
            # bytes copied host -> backend per micro-batch
            upload_old=N * V * 4 + N * 4 + 4, upload_new=N * 8 + N * 4 + 4,
            old={k: med(d[k] for d in old) for k in old[0] if k != "n_valid"},
            new={k: med(d[k] for d in new) for k in new[0]},
            old_all=[d["total"] for d in old], new_all=[d["total"] for d in new])
        rt.forget_graph()
        ce.close()
        ctx.close()
    st = bf._proc_status()
    print("RESULT " + json.dumps(dict(side="labels", vocab=V, pad_id=pad_id, rows=out, threads=int(a.threads),
                                      peak_rss=st["VmHWM"])), flush=True)


def headbwd_worker(a) -> None:
    """The LM head's backward product for the hidden states, in the ways ggml can compute it."""
    sys.path.insert(0, str(REPO))
    import numpy as np
    from pytrain import ggml
    from pytrain.ggml import lib
    E, N, threads = 512, a.batch[0] * a.batch[1], int(a.threads)
    rt = ggml.Runtime("cpu", threads=threads)
    rng = np.random.default_rng(0)
    out = {}
    for V in a.rows:
        f32 = lib.GGML_TYPE_F32
        data = ggml.Context(n_tensors=4)
        W = lib.ggml_new_tensor_2d(data.ptr, f32, E, V)       # the head weight (token_embd), ne [E, V]
        Wt = lib.ggml_new_tensor_2d(data.ptr, f32, V, E)      # its transpose, ne [V, E]
        dL = lib.ggml_new_tensor_2d(data.ptr, f32, V, N)      # dLoss/dLogits, ne [V, N]
        X = lib.ggml_new_tensor_2d(data.ptr, f32, E, N)       # hidden states, ne [E, N]
        buf = rt.alloc(data)
        w = rng.standard_normal((V, E), dtype=np.float32) * 0.02
        g = rng.standard_normal((N, V), dtype=np.float32) * 1e-4
        ggml.from_numpy(W, w)
        ggml.from_numpy(Wt, np.ascontiguousarray(w.T))
        ggml.from_numpy(dL, g)
        ggml.from_numpy(X, rng.standard_normal((N, E), dtype=np.float32))
        variants = {
            "fwd_mul_mat": lambda c: lib.ggml_mul_mat(c, W, X),
            "out_prod": lambda c: lib.ggml_out_prod(c, W, lib.ggml_transpose(c, dL)),
            "mul_mat_t": lambda c: lib.ggml_mul_mat(c, Wt, dL),
            "cont_mul_mat": lambda c: lib.ggml_mul_mat(c, lib.ggml_cont(c, lib.ggml_transpose(c, W)), dL),
        }
        res, ref = {}, None
        for k, make in variants.items():
            ctx = ggml.Context(n_tensors=16, graph_size=64)
            t = make(ctx.ptr)
            lib.ggml_set_output(t)
            gr = ggml.new_graph(ctx, 64)
            lib.ggml_build_forward_expand(gr, t)
            rt.alloc_graph(gr, ctx)
            times = []
            for _ in range(a.reps + 1):
                t0 = time.perf_counter()
                rt.compute(gr)
                times.append(time.perf_counter() - t0)
            res[k] = statistics.median(times[1:])
            if k != "fwd_mul_mat":   # the three dX products must agree
                v = ggml.to_numpy(t).astype(np.float64)
                if ref is None:
                    ref = v
                else:
                    assert np.allclose(v, ref, rtol=1e-3, atol=1e-6), k
            rt.forget_graph()
            ctx.close()
        times = []
        for _ in range(a.reps + 1):   # numpy (BLAS, OPENBLAS/OMP_NUM_THREADS = threads): dX = dL @ W
            t0 = time.perf_counter()
            dx = g @ w
            times.append(time.perf_counter() - t0)
        res["numpy"] = statistics.median(times[1:])
        assert np.allclose(dx, ref.reshape(dx.shape), rtol=1e-3, atol=1e-6)
        out[str(V)] = res
        rt.free(buf)
        data.close()
    print("RESULT " + json.dumps(dict(side="headbwd", E=E, N=N, threads=threads, reps=a.reps, rows=out)),
          flush=True)


# --------------------------------------------------------------------------------------------
# orchestration
# --------------------------------------------------------------------------------------------

def prepare(name: str, a) -> dict | None:
    """Model record {name, gguf, hf, vocab, desc, weights, n_params} or None (skipped)."""
    if name == "default":
        if not a.default_gguf.exists():
            print(f"[default] skipped: {a.default_gguf} is absent", flush=True)
            return None
        sys.path.insert(0, str(REPO))
        from pytrain.models.model_file import open_model
        _arch, _meta, _infos, cfg = open_model(a.default_gguf)
        hf = a.default_hf if (a.default_hf / "model.safetensors").exists() else None
        if hf is None:
            print(f"[default] HF side skipped: no HF checkpoint at {a.default_hf}", flush=True)
        return dict(name="default", gguf=a.default_gguf, hf=hf, vocab=int(cfg.n_vocab),
                    desc=f"embedded default model: hidden {cfg.n_embd}, {cfg.n_layer} layers, "
                         f"vocab {cfg.n_vocab}", weights="F32 / f32", n_params=None)
    if name not in bf.SPECS:
        print(f"[{name}] unknown model", flush=True)
        return None
    spec = bf.SPECS[name]
    d = bf.spec_dir(a.cache, name)
    if not (d / "done.json").exists():
        a.cache.mkdir(parents=True, exist_ok=True)
        print(f"[{name}] generating into {d} ...", flush=True)
        r = subprocess.run([a.ref_python, str(Path(__file__).resolve()), "--make", name, "--into", str(d)],
                           cwd=str(REPO))
        if r.returncode != 0:
            print(f"[{name}] skipped: generation failed (exit {r.returncode})", flush=True)
            return None
    done = json.loads((d / "done.json").read_text())
    return dict(name=name, gguf=d / done["gguf"], hf=d / "hf", vocab=spec["config"]["vocab_size"],
                desc=spec["desc"], n_params=done["n_params"], weights=f"{spec['outtype'].upper()} / f32")


def run_worker(python: str, side: str, model: dict, a, threads: int, profile: bool = False,
               extra=(), batch=BATCH, steps: int | None = None, warmup: int | None = None,
               blas: bool = True, recompute: str | None = None) -> dict | None:
    """One worker process; ``blas=False`` runs pytrain with PYTRAIN_BLAS=0 (its CPU backend alone),
    ``recompute`` overrides --recompute."""
    cmd = [python, str(Path(__file__).resolve()), "--worker", side, "--threads", str(threads),
           "--runs", str(a.steps if steps is None else steps),
           "--warmup", str(a.warmup if warmup is None else warmup), "--batch", str(batch[0]), str(batch[1]),
           "--vocab", str(model["vocab"]), "--hf-attn", a.hf_attn, "--hf-dtype", a.hf_dtype,
           "--recompute", recompute or a.recompute, "--nice", str(a.nice), *extra]
    if profile:
        cmd += ["--profile", "--warmup", "1"]
    if side == "pytrain":
        cmd += ["--gguf", str(model["gguf"])]
    elif side == "hf":
        cmd += ["--hf", str(model["hf"])]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    if not blas:
        env["PYTRAIN_BLAS"] = "0"
    busy = bf.wait_quiet(a.quiet_wait) if a.quiet_wait else bf.machine_busy()
    what = (f"{side}{'' if blas else ' BLAS off'}{f' recompute={recompute}' if recompute else ''}"
            f"{' profile' if profile else ''}, "
            f"{threads} thread{'s' if threads > 1 else ''}")
    print(f"  [{model['name']}] {what} ... (machine busy {busy:.2f} cores before; load average "
          f"{os.getloadavg()[0]:.2f})", flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO), start_new_session=bool(a.nice))
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            res["busy_before"] = busy
            res["threads"] = threads
            res["loadavg_before"] = os.getloadavg()
            if "tokens_per_s" in res:
                print(f"  [{model['name']}] {what}: {res['tokens_per_s']:.1f} tokens/s "
                      f"({res['target_tokens_per_s']:.1f} target tokens/s; {res['n_clean']} clean of "
                      f"{len(res['times'])}: " + ", ".join(f"{t:.3f} s ({o:.2f})" for t, o in
                                                          zip(res["times"], res["others"]))
                      + f"), first loss {res['first_loss']:.5f}, peak RSS {res['peak_rss'] / 2**30:.2f} GiB",
                      flush=True)
            return res
    sys.stderr.write(r.stdout[-3000:] + r.stderr[-6000:])
    print(f"  [{model['name']}] {what} FAILED (exit {r.returncode})", flush=True)
    return None


def machine_info(a, wall_s: float | None = None) -> list[str]:
    """Machine, versions, the command and how the workers ran (the report's header lines)."""
    import platform
    import shlex
    m = bf.machine_facts()
    cpu, mem, commit, ggml_v = m["cpu"], m["mem"], m["commit"], m["ggml"]
    th = ", ".join(map(str, a.thread_list))
    mt = "".join(f"; {x.partition('=')[0]}: {x.partition('=')[2]}" for x in a.model_threads)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "pytrain", "native", "scripts/bench_train.py",
                            "scripts/bench_forward.py"], capture_output=True, text=True, cwd=str(REPO)).stdout
    dirty = sorted({ln[3:] for ln in dirty.split("\n") if ln.strip()})
    blas = _blas_info()
    return [f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}; pytrain commit {commit}"
            + (f" (uncommitted changes in: {', '.join(dirty)})" if dirty else "")
            + (f"; the whole run took {wall_s / 60:.0f} min" if wall_s else ""),
            f"- command: `python3 scripts/bench_train.py {shlex.join(sys.argv[1:])}`",
            f"- CPU: {cpu}, {os.cpu_count()} cores visible, {mem} RAM; threads per side: **{th}**{mt} "
            f"(pytrain `threads=N`, torch `set_num_threads(N)`, OMP/MKL/OPENBLAS_NUM_THREADS=N)",
            f"- ggml {ggml_v}",
            f"- {blas}",
            f"- python {platform.python_version()} (pytrain side); worker processes at niceness {a.nice:+d}"
            + (" in a session (scheduler autogroup) of their own, so that other jobs on this shared "
               "machine yield the cores while they run" if a.nice < 0 else "")]


def _blas_info() -> str:
    """The BLAS backend line of the header (from the native build's record)."""
    try:
        info = json.loads((REPO / "pytrain" / "_native" / "build_info.json").read_text())
    except (OSError, ValueError):
        return "BLAS backend: unknown (no build_info.json)"
    if not info.get("blas"):
        return "BLAS backend: none in this build (pytrain = ggml's CPU backend alone)"
    return (f"BLAS backend: ggml-blas on {info['blas']} (contiguous F32 MUL_MATs with every dimension >= 32, and contiguous matrix OUT_PRODs with a weight of any type, converted to F32 in slabs; ggml-cpu the rest), "
            f"listed before the CPU backend; \"BLAS off\" = the same build with PYTRAIN_BLAS=0 (CPU backend alone)")


def _renice(nice: int) -> None:
    """Niceness only weighs within a scheduler autogroup (one per session): the worker runs in a
    session of its own (the orchestrator starts it so) and sets that autogroup's niceness too."""
    if nice:
        os.nice(nice)
        try:
            Path("/proc/self/autogroup").write_text(str(nice))
        except OSError:
            pass


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 0.01 else f"{s * 1e3:.1f} ms"


def _measured_steps(rows: list[dict], extra_steps: list, threads: int) -> dict[int, float]:
    """Median pytrain step (s) of mid-v248k by tokens per step (B*T): 512 from the main rows at
    ``threads``, others (batch 8 x 256) from the extra steps."""
    measured = {int(x["pytrain"]["tokens"]): x["pytrain"]["median_s"] for x in extra_steps or []
                if x.get("pytrain") and x["name"] == "mid-v248k" and x.get("threads", threads) == threads}
    big = next((r for r in rows if r["name"] == "mid-v248k" and r.get("pytrain")
                and r.get("threads") == threads), None)
    if big:
        measured.setdefault(512, big["pytrain"]["median_s"])
    return measured


def labels_section(lab: dict, measured: dict[int, float], step_what: str) -> list[str]:
    """The masked loss's label work, before (host one-hot) and now (built on the device)."""
    V = lab["vocab"]
    step512 = measured.get(512)
    lines = ["", f"## Masked-loss label work at vocab {V}: before (host one-hot) and now (built on the device)",
             "",
             f"The label tensor of a real `MaskedCE` (`loss.build` over logits [{V}, N], its graph allocated "
             f"by `Runtime.alloc_graph` on the CPU backend, {lab.get('threads', '?')} threads), half its rows "
             f"masked, no target equal to the pad id {lab['pad_id']}; both ways fill the same tensor in each "
             f"repetition (alternating which goes first), median of {next(iter(lab['rows'].values()))['reps']}; "
             f"ms per micro-batch. The device-built tensor was checked equal to numpy's one-hot (and the "
             f"host-built one too) before timing.",
             "",
             "- **before (host one-hot, the previous pytrain)**: `loss.set_labels` as it was, re-implemented in "
             "this script for comparison only: build = numpy `loss.label_rows` (N x V float32); write = its "
             "upload into the label tensor (`ggml.from_numpy`, N·V·4 bytes); pad-column read = `loss.read_column` "
             "right after the write; rest = row mask + loss scale uploads and freeing the numpy rows.",
             "- **now (built on the device)**: `MaskedCE.prepare`: build = `set_targets` (flat one-positions "
             "i·V + target_i as I64 and the F32 row mask, computed and uploaded: O(N)); write = `build_labels` "
             "(fill 0 + SET_ROWS of ones, a small graph computed on the backend that owns the tensor); "
             "pad-column read = the `read_column` inside `check_labels`; rest = the remainder of `check_labels` "
             "(loss scale upload).",
             f"- read warm = the same read repeated (20 times). Share = total / step, step = {step_what}"
             + ("" if step512 else " (no mid-v248k step measured: no share)")
             + "; a size without a measured step uses the N = 512 step scaled by tokens (said so in the row).",
             "- N here = B*T, every row of the micro-batch; pytrain's trainer runs the head and the loss on the "
             "micro-batch's target rows only (`loss.rows_bucket`: 256 rows for batch 2 x 256 with 254 targets, "
             "1024 for 8 x 256), so these sizes are the all-rows case.",
             "",
             "| N = B*T | label tensor | way | build | write the label tensor | pad-column read (cold) | "
             "read warm | rest | total per micro-batch | uploaded | share of step | step (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for N, d in lab["rows"].items():
        scaled = int(N) not in measured
        step = measured.get(int(N)) or (step512 * int(N) / 512 if step512 else None)
        o, n = d["old"], d["new"]
        ways = [("before (host one-hot)", [o["label_rows"], o["upload"], o["read_column"], o["read_warm"],
                                           o["rest"] + o["free"], o["total"]], d["upload_old"]),
                ("now (built on the device)", [n["set_targets"], n["build_labels"], n["read_column"],
                                               n["read_warm"], n["check_labels"] - n["read_column"], n["total"]],
                 d["upload_new"])]
        st = (f"{step:.2f}" + (" (scaled from N = 512)" if scaled else " (measured)")) if step else "-"
        for way, vals, up in ways:
            share = f"{100 * vals[-1] / step:.2f}%" if step else "-"
            lines.append(f"| {N} | {d['label_bytes'] / 2**20:.0f} MiB | {way} | "
                         + " | ".join(_ms(v) for v in vals[:-1]) + f" | **{_ms(vals[-1])}** | "
                         f"{_bytes(up)} | {share} | {st} |")
        (_, b, _), (_, w, _) = ways
        ratio = [f"{x / y:.1f}x" if y > 0 else "-" for x, y in zip(b, w)]
        ratio[-1] = f"**{ratio[-1]}**"
        lines.append(f"| {N} | | before / now | " + " | ".join(ratio) + f" | {d['upload_old'] / d['upload_new']:.0f}x | | |")
    return lines


def _bytes(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def labels_info(a) -> list[str]:
    """Header lines of labels.md: date, commit, machine, threads, the command."""
    import platform
    m = bf.machine_facts()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "pytrain", "scripts/bench_train.py"],
                           capture_output=True, text=True, cwd=str(REPO)).stdout.split("\n")
    dirty = sorted({ln[3:] for ln in dirty if ln.strip()})
    py = sys.executable
    try:
        py = os.path.relpath(py, REPO) if Path(py).is_relative_to(REPO) else py
    except ValueError:
        pass
    import shlex
    cmd = f"{py} scripts/bench_train.py " + shlex.join(sys.argv[1:])
    return [f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}; pytrain commit {m['commit']}"
            + (f" (uncommitted changes in: {', '.join(dirty)})" if dirty else ""),
            f"- CPU: {m['cpu']}, {os.cpu_count()} cores visible, {m['mem']} RAM; ggml threads "
            f"**{a.thread_list[0]}**; worker at niceness {a.nice:+d}"
            + (" in a session (scheduler autogroup) of its own" if a.nice < 0 else ""),
            f"- ggml {m['ggml']}; python {platform.python_version()}",
            f"- command: `{cmd}`"]


def labels_report(j: dict, notes: list[str]) -> str:
    """labels.md from a labels json (``--labels-only``)."""
    lines = ["# Masked-loss labels at vocab 248320: host one-hot (before) vs built on the device (now)", "",
             "Made by `scripts/bench_train.py --labels-only` (see its docstring). What one micro-batch's "
             "label work costs in the previous pytrain (one-hot rows built in numpy and uploaded, then the "
             "pad-column read) and now (`MaskedCE.prepare`: O(N) upload, fill + SET_ROWS on the backend, the "
             "same read).", ""]
    lines += j["info"]
    la = j.get("loads") or []
    if la:
        lines.append(f"- load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in la[0])}; after: "
                     f"{', '.join(f'{x:.2f}' for x in la[-1])}; machine busy {j['labels'].get('busy_before', 0):.2f} "
                     f"cores (other processes) before the worker started")
    s = j.get("steps") or {}
    measured = {int(k): v for k, v in (s.get("measured") or {}).items()}
    lines += labels_section(j["labels"], measured, s.get("what") or "not measured")
    notes = notes or j.get("notes") or []
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


OLD_SCRIPT = "9bbf5b4"   # the last commit whose bench_train.py timed loss.set_labels


def _refuse_old(js: list[dict], files) -> None:
    """A json from before the device-built labels (phases timing loss.set_labels, a "pad"
    section) is refused: this script cannot render it."""
    for j, f in zip(js, files):
        old = bool(j.get("pad")) or any("set_labels" in (x.get("pytrain") or {}).get("phases", {})
                                       for x in (j.get("rows") or []) + (j.get("extra_steps") or []))
        if old:
            raise SystemExit(
                f"{f}: written before pytrain built the labels on the device (its step phases time "
                f"loss.set_labels, its \"pad\" section the host one-hot); this version of the script does not "
                f"render it. Render it with the script of commit {OLD_SCRIPT}, e.g.\n"
                f"  mkdir -p /tmp/pytrain-{OLD_SCRIPT} && git archive {OLD_SCRIPT} scripts | tar -x -C "
                f"/tmp/pytrain-{OLD_SCRIPT} && python3 /tmp/pytrain-{OLD_SCRIPT}/scripts/bench_train.py "
                f"--report-from {Path(f).resolve()} --out ...")


def report(rows: list[dict], labels: dict | None, a, loads: list, info: list[str] | None = None,
           extra_steps: list | None = None, heads: dict | None = None) -> str:
    extra_steps = extra_steps or []
    hf = next((r["hf"] for r in rows if r.get("hf")), None)
    la = ", ".join(f"{x:.2f}" for x in loads[0]) if loads else "?"
    lb = ", ".join(f"{x:.2f}" for x in loads[-1]) if loads else "?"
    lines = ["# LoRA training throughput: pytrain vs HF transformers + PEFT (CPU)", "",
             "Made by `python3 scripts/bench_train.py` (see its docstring for the exact step on each "
             "side). Tokens/s = tokens / median wall time of one optimizer step (forward, masked CE, "
             "backward, grad norm + clipping, AdamW) after warm-up, over the *clean* timed steps (other "
             "processes kept < 0.3 cores busy beyond the cores a side leaves free; the machine is shared; when no step was clean, over all "
             "of them), and from the fastest step (contention only adds time). Steps = clean / all timed. "
             "Each side runs in its own process; peak RSS = VmHWM of that process. Own CPU-s per step = "
             "CPU time the process used per step (mean cores used x median step; includes the spin-waiting "
             "of both sides' thread pools).", ""]
    lines += info or machine_info(a)
    one = [x[0] for x in loads] + [y["loadavg_before"][0] for r in rows for y in (r.get("pytrain"), r.get("hf"))
                                   if y and "loadavg_before" in y]
    rng_ = f"; 1-min load average over the run {min(one):.2f} to {max(one):.2f}" if one else ""
    lines.append(f"- load average (1, 5, 15 min) at start: {la}; at end: {lb}{rng_} (2 cores: a load "
                 f"above 2 means other processes were running)")
    if hf:
        dts = {}
        for r in rows:
            if r.get("hf"):
                dts.setdefault(r["hf"].get("dtype", "float32"), []).append(r["name"])
        dt = ("; ".join(f"{d} ({', '.join(dict.fromkeys(ns))})" for d, ns in dts.items()) if len(dts) > 1
              else next(iter(dts)))
        lines.append(f"- HF: torch {hf['torch']}, transformers {hf['transformers']}, peft {hf['peft']}, "
                     f"attn_implementation={hf['attn']}, {dt}, train mode; torch DeltaNet fallback "
                     f"(no flash-linear-attention)")
    batches = {}
    for r in rows:
        bb = tuple(r.get("batch") or BATCH)
        batches.setdefault(bb, []).append(r["name"])
    bdesc = "; ".join(f"batch {b[0]} x {b[1]}"
                      + (f" ({', '.join(dict.fromkeys(ns))})" if len(batches) > 1 else "")
                      + f", {b[0] * (b[1] // 2)} target tokens" for b, ns in batches.items()) or \
        f"batch {BATCH[0]} x {BATCH[1]}, {BATCH[0] * (BATCH[1] // 2)} target tokens"
    lines.append(f"- LoRA r={RANK}, alpha={ALPHA:g}, dropout 0, q/k/v/o of the full-attention layers; "
                 f"AdamW lr {LR:g}, wd 0, clip {MAX_NORM:g}; {bdesc}; no padding, the first half of each "
                 f"row masked")
    variants = [k for k in VARIANTS if any(r.get(k) for r in rows)]
    vhead = "".join(f"pytrain {VARIANTS[k]}: tokens/s, steps, peak RSS | pytrain / {VARIANTS[k]} | " for k in variants)
    lines += ["", "| model | threads | batch | tokens (targets) | steps pytrain / HF | pytrain tokens/s (targets/s) | "
              "HF tokens/s (targets/s) | ratio pytrain/HF | best-step tokens/s pytrain / HF (ratio) | pytrain peak RSS | HF peak RSS | "
              + vhead
              + "own CPU-s per step pytrain / HF | first-step loss pytrain / HF | LoRA params pytrain / HF | other load (cores) pytrain / HF |",
              "|---|---|---|---|---|---|---|---|---|---|---|" + "---|---|" * len(variants) + "---|---|---|---|"]
    for r in rows:
        p, h = r.get("pytrain"), r.get("hf")
        B, T = r.get("batch") or BATCH
        bt = [B * T / y["best_s"] if y else None for y in (p, h)]
        best = " / ".join(f"{v:.1f}" if v else "-" for v in bt) + (f" ({bt[0] / bt[1]:.2f})" if p and h else "")
        ratio = f"**{p['tokens_per_s'] / h['tokens_per_s']:.2f}**" if p and h else "-"
        nsteps = " / ".join(f"{x['n_clean']}/{len(x['times'])}" if x else "-" for x in (p, h))
        x = p or h
        cells = [r["name"], str(r.get("threads", "?")), f"{B} x {T}", f"{x['tokens']} ({x['n_targets']})" if x else "-",
                 nsteps,
                 f"{p['tokens_per_s']:.1f} ({p['target_tokens_per_s']:.1f})" if p else "-",
                 f"{h['tokens_per_s']:.1f} ({h['target_tokens_per_s']:.1f})" if h else "-", ratio, best,
                 bf.fmt_gib(p["peak_rss"]) if p else "-", bf.fmt_gib(h["peak_rss"]) if h else "-"]
        for k in variants:
            q = r.get(k)
            cells += [f"{q['tokens_per_s']:.1f}, {q['n_clean']}/{len(q['times'])}, {bf.fmt_gib(q['peak_rss'])}"
                      if q else "-",
                      f"**{p['tokens_per_s'] / q['tokens_per_s']:.2f}**" if p and q else "-"]
        cells += [" / ".join(f"{y['own_cores'] * y['median_s']:.2f}" if y else "-" for y in (p, h)),
                  " / ".join(f"{y['first_loss']:.5f}" if y else "-" for y in (p, h)),
                  " / ".join(f"{y['lora_params']:,} ({y['lora_names']})" if y else "-" for y in (p, h)),
                  " / ".join(f"{y['others_cores']:.2f}" if y else "-" for y in (p, h))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Shapes:", ""]
    seen = set()
    for r in rows:
        if r["name"] in seen:
            continue
        seen.add(r["name"])
        n = f"; {r['n_params'] / 1e6:.1f} M parameters" if r.get("n_params") else ""
        hfnote = "" if r.get("hf") else " (HF side not run: no HF checkpoint)"
        p = r.get("pytrain") or {}
        wt = ", ".join(f"{k} x {v}" for k, v in (p.get("weight_types") or {}).items())
        how = (f"; pytrain loads its weight tensors as {wt} and trains it with "
               f"{p['step_graph']} (Trainer recompute={p.get('recompute', 'auto')})" if p.get("step_graph") else "")
        lines.append(f"- **{r['name']}**: {r['desc']}{n}; weights {r['weights']}{hfnote}{how}")

    lines += ["", "## Where a pytrain step goes (median per step)", "",
              "Host phases are timed by wrapping pytrain functions at runtime. `labels` = "
              "`MaskedCE.prepare` of each micro-batch, the one-hot labels built on the device: "
              "`set_targets` (host + the O(N) upload of the flat one-positions and the row mask), "
              "`build_labels` (the fill + SET_ROWS graph computed on the backend) and the pad-column "
              "`read_column` (inside `check_labels`), measured inside the real step; N = the loss rows "
              "of the step's graph (the micro-batch's target rows, `loss.rows_bucket`).", "",
              "| model | threads | batch | step (s) | compute fwd+bwd | compute optimizer | alloc_graph | inputs | "
              "labels (N) | of which set_targets / build_labels / pad-column read | rest |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    steps = []
    for r in rows:
        steps += [(r["name"], r, r.get("pytrain"))] + [(f"{r['name']} ({v})", r, r.get(k)) for k, v in VARIANTS.items()]
    steps += [(x["name"], x, x.get("pytrain")) for x in extra_steps]
    for name, r, p in steps:
        if not p:
            continue
        ph = p["phases"]
        st = p["step_seconds"]
        cells = [name, str(r.get("threads", "?")), "x".join(map(str, p.get("batch", BATCH))), f"{st:.3f}"]
        for k in ("compute fwd+bwd", "compute optimizer", "alloc_graph", "inputs", "labels"):
            v = ph.get(k, 0.0)
            cells.append(f"{_ms(v)} ({100 * v / st:.1f}%)")
        cells[-1] += f" (N = {', '.join(map(str, p['loss_rows']))})" if p.get("loss_rows") else ""
        rc = ph.get("labels.read_column", 0.0)
        cells.append(" / ".join(_ms(ph.get("labels." + k, 0.0)) for k in ("set_targets", "build_labels"))
                     + f" / {_ms(rc)} ({100 * rc / st:.4f}%)")
        v = ph.get("rest", 0.0)
        cells.append(f"{_ms(v)} ({100 * v / st:.1f}%)")
        lines.append("| " + " | ".join(cells) + " |")

    profs = [(f"{r['name']} ({r.get('threads')} threads)", r.get("pytrain_profile"), r.get("hf_profile"))
             for r in rows
             if r.get("pytrain_profile") or r.get("hf_profile")]
    if profs:
        lines += ["", "## Profile of one step", "",
                  "pytrain: one step computed node by node under a ggml scheduler eval callback, each node "
                  "timed and summed by part of the model (forward, and (bwd) for the backward nodes that "
                  "compute that part's gradients; (recompute) for a layer-wise step's second forward of a "
                  "layer) and by op, with the backend the scheduler ran it on in brackets (BLAS = ggml-blas on "
                  "OpenBLAS, CPU = ggml-cpu); compare the profiled step with the unprofiled "
                  "one above for the dispatch overhead. HF: torch.profiler, top ops by self CPU time.", ""]
        for name, pp, hp in profs:
            if pp:
                tot = sum(pp["by_op"].values())
                parts = ", ".join(f"{k} {v:.3f} s ({100 * v / tot:.0f}%)" for k, v in
                                  sorted(pp["by_part"].items(), key=lambda kv: -kv[1]))
                byop = pp.get("by_op_backend") or pp["by_op"]
                ops = ", ".join(f"{k} {v:.3f} s ({100 * v / tot:.0f}%)" for k, v in
                                sorted(byop.items(), key=lambda kv: -kv[1])[:10])
                bypo = pp.get("by_part_op_backend") or pp["by_part_op"]
                pops = ", ".join(f"{k} {v:.3f} s ({100 * v / tot:.0f}%)" for k, v in
                                 sorted(bypo.items(), key=lambda kv: -kv[1])[:12])
                lines += [f"- **{name}** pytrain (profiled step {pp['wall']:.2f} s, {pp['n_nodes']} nodes "
                          f"computed, node times sum {tot:.2f} s"
                          + (f"; {pp['step_graph']}" if pp.get("step_graph") else "") + f"): by part: {parts}"]
                if pp.get("by_backend"):
                    lines.append("  - by backend: " + ", ".join(
                        f"{k} {v:.3f} s ({100 * v / tot:.0f}%)"
                        for k, v in sorted(pp["by_backend"].items(), key=lambda kv: -kv[1])))
                lines += [f"  - top ops: {ops}", f"  - top part x op: {pops}"]
            if hp:
                top = ", ".join(f"{k} {v:.3f} s" for k, v in hp["top"][:10])
                lines.append(f"- **{name}** HF (profiled step {hp['wall']:.2f} s): top self-CPU ops: {top}")

    if labels:
        lines += labels_section(labels, _measured_steps(rows, extra_steps, a.thread_list[0]),
                                "the measured pytrain step of **mid-v248k** in this run (batch 2 x 256, N = 512; "
                                "for N = 2048 batch 8 x 256 when it ran, i.e. without `--no-big-step`)")

    if heads:
        lines += ["", "## LM-head backward alternatives (vocab-sized matmuls alone)", "",
                  f"The head's gradient with respect to the hidden states, dX = W^T-side product of the frozen "
                  f"head weight W (ggml ne [E={heads['E']}, V]) and dLogits (ne [V, N={heads['N']}]), timed alone "
                  f"with pytrain.ggml on the CPU backend ({heads['threads']} threads, median of {heads['reps']}): "
                  f"`OUT_PROD(W, transpose(dL))` is what ggml's autodiff emits for MUL_MAT's src1 today; "
                  f"`MUL_MAT(Wt, dL)` is the same product from a persistent transposed copy Wt (ne [V, E]); "
                  f"`CONT(TRANSPOSE(W))` + MUL_MAT makes that copy every step; the forward head MUL_MAT(W, X) and "
                  f"numpy's BLAS matmul of the same shapes are references.", "",
                  "| vocab | forward MUL_MAT(W, X) | OUT_PROD(W, dL^T) (today) | MUL_MAT(Wt, dL) | "
                  "CONT(W^T) + MUL_MAT | numpy (BLAS) dX | GFLOP per product |",
                  "|---|---|---|---|---|---|---|"]
        for V, d in heads["rows"].items():
            gf = 2 * heads["E"] * int(V) * heads["N"] / 1e9
            cell = lambda k: (f"{d[k]:.3f} s ({gf / d[k]:.0f} GFLOP/s)" if d.get(k) else "-")  # noqa: E731
            lines.append(f"| {V} | {cell('fwd_mul_mat')} | {cell('out_prod')} | {cell('mul_mat_t')} | "
                         f"{cell('cont_mul_mat')} | {cell('numpy')} | {gf:.1f} |")

    lines += ["", "Details:", ""]
    for r in rows:
        for side in ("pytrain", *VARIANTS, "hf"):
            x = r.get(side)
            if x:
                sname = f"pytrain {VARIANTS[side]}" if side in VARIANTS else side
                lines.append(f"- {r['name']} {sname}, {r.get('threads')} threads: load {x['load_s']:.2f} s, warm-up "
                             f"{', '.join(f'{t:.3f}' for t in x['warmup_s'])} s, steps "
                             f"{', '.join(f'{t:.3f} ({o:.2f})' for t, o in zip(x['times'], x['others']))} s "
                             f"(other cores in brackets); losses {', '.join(f'{v:.4f}' for v in x['losses'])}; "
                             f"RSS after load {bf.fmt_gib(x['rss_after_load'])}, at end anon "
                             f"{bf.fmt_gib(x['rss_end_anon'])} + file {bf.fmt_gib(x['rss_end_file'])}; cores used "
                             f"{x['own_cores']:.2f}; machine busy {x['busy_before']:.2f} cores before"
                             + (f"; {x['graph_nodes']} graph nodes; pad id {x['pad_id']}"
                                + (f"; backends {', '.join(x['backends'])}" if x.get("backends") else "")
                                if side != "hf" else
                                (f"; LoRA weights {', '.join(x['lora_dtypes'])}" if x.get("lora_dtypes") else "")))
    if a.notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in a.notes]
    return "\n".join(lines) + "\n"


def run_labels(a) -> dict | None:
    """The label work before/now in its own worker process (first thread count)."""
    rec = dict(name="labels", vocab=V_REAL)
    extra = ["--rows", *a.label_rows.split(","), "--pad-id", "248044", "--reps", str(a.reps)]
    lab = run_worker(a.pytrain_python, "labels", rec, a, a.thread_list[0], extra=extra)
    for N, d in (lab or {}).get("rows", {}).items():
        o, n = d["old"], d["new"]
        print(f"  [labels] N={N}: before (host one-hot) {_ms(o['total'])} = label_rows {_ms(o['label_rows'])} "
              f"+ upload {_ms(o['upload'])} + read {_ms(o['read_column'])} + rest; now (device) "
              f"{_ms(n['total'])} = set_targets {_ms(n['set_targets'])} + build_labels {_ms(n['build_labels'])} "
              f"+ check_labels {_ms(n['check_labels'])} (read {_ms(n['read_column'])}); "
              f"before/now {o['total'] / n['total']:.1f}x", flush=True)
    return lab


def _labels_paths(out: Path | None) -> tuple[Path, Path]:
    """labels.md and labels.json for --labels-only: ``out`` a folder or a .md path."""
    out = out or REPO / "bench_results"
    md = out if out.suffix == ".md" else out / "labels.md"
    return md, md.with_suffix(".json")


def labels_only(a) -> int:
    """--labels-only: the label work alone -> labels.md + labels.json; shares against the
    mid-v248k steps of an earlier run (--step-from)."""
    md_path, json_path = _labels_paths(a.out)
    steps = dict(measured={}, what=None)
    if a.step_from and a.step_from.exists():
        sj = json.loads(a.step_from.read_text())
        m = _measured_steps(sj.get("rows") or [], sj.get("extra_steps") or [], a.thread_list[0])
        when = next((ln[2:] for ln in sj.get("info") or [] if ln.startswith("- date:")), "date unknown")
        old = any("set_labels" in (x.get("pytrain") or {}).get("phases", {})
                  for x in (sj.get("rows") or []) + (sj.get("extra_steps") or []))
        try:
            src = a.step_from.resolve().relative_to(REPO)
        except ValueError:
            src = a.step_from
        steps = dict(measured={str(k): v for k, v in m.items()},
                     what=f"the pytrain step of **mid-v248k** ({a.thread_list[0]} threads) measured in "
                          f"`{src}` ({when}): batch 2 x 256 for N = 512, 8 x 256 for N = 2048"
                          + ("; that run still built the labels on the host (for its loss rows, the target "
                             "rows: N = 256 at 2 x 256, 1024 at 8 x 256), so its steps include that cost"
                             if old else ""))
        if not m:
            print(f"[labels] no mid-v248k step at {a.thread_list[0]} threads in {a.step_from}: no shares", flush=True)
    loads = [os.getloadavg()]
    lab = run_labels(a)
    loads.append(os.getloadavg())
    if not lab:
        return 1
    j = dict(kind="labels", labels=lab, steps=steps, loads=loads, info=labels_info(a),
             notes=a.notes)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(j, default=str, indent=1))
    md = labels_report(j, a.notes)
    print()
    print(md)
    md_path.write_text(md)
    print(f"wrote {md_path} and {json_path}")
    return 0


def main() -> int:
    if any(x == "--device" or x.startswith("--device=") for x in sys.argv[1:]):
        import bench_train_gpu   # the GPU benchmark (its --device cpu: a dry run of it)
        return bench_train_gpu.main(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="default,mid,mid-v248k")
    ap.add_argument("--threads", default=None,
                    help="thread counts, comma-separated (e.g. 2,1; default 2); profile and the label work use "
                         "the first (--report-from: default the run's)")
    ap.add_argument("--model-threads", action="append", default=[], metavar="NAME=T[,T...]",
                    help="thread counts for one model instead of --threads (e.g. 2b=2), repeatable")
    ap.add_argument("--blas-off", default="default,mid,mid-v248k", metavar="MODELS",
                    help="models whose pytrain side also runs with PYTRAIN_BLAS=0 (ggml's CPU backend alone) "
                         "at each thread count, comma-separated ('' for none)")
    ap.add_argument("--one-graph", default="2b", metavar="MODELS",
                    help="models whose pytrain side, when the default --recompute chose layer-wise recompute, also "
                         "runs as one graph (recompute=off) at each thread count ('' for none)")
    ap.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="dtype HF + PEFT loads and trains the base model in (LoRA weights stay float32)")
    ap.add_argument("--recompute", default="auto", choices=["auto", "off", "layers"],
                    help="pytrain Trainer(recompute=...): auto = layer-wise when the one-graph compute buffer "
                         "would exceed half of the memory left after the weights")
    ap.add_argument("--steps", type=int, default=5, help="clean timed steps wanted per side")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pytrain" / "bench")
    ap.add_argument("--ref-python", default="/opt/refenv/bin/python")
    ap.add_argument("--pytrain-python", default=sys.executable)
    ap.add_argument("--default-gguf", type=Path, default=bf.DEFAULT_GGUF)
    ap.add_argument("--default-hf", type=Path, default=Path("/tmp/pytrain-default-model/hf"))
    ap.add_argument("--hf-attn", default="sdpa")
    ap.add_argument("--nice", type=int, default=0,
                    help="niceness of the worker processes; on a shared machine -20 (root) gives them the "
                         "cores while they run (each in its own session / autogroup)")
    ap.add_argument("--no-profile", dest="do_profile", action="store_false")
    ap.add_argument("--no-labels", "--no-padread", dest="do_labels", action="store_false",
                    help="skip the label work before/now (host one-hot vs built on the device)")
    ap.add_argument("--labels-only", action="store_true",
                    help="only the label work before/now; --out: a folder (labels.md + labels.json "
                         "there) or a .md path (the json beside it)")
    ap.add_argument("--step-from", type=Path, default=REPO / "bench_results" / "train.json",
                    help="with --labels-only: the earlier run (--json) whose mid-v248k steps the shares "
                         "are taken against")
    ap.add_argument("--no-big-step", dest="big_step", action="store_false",
                    help="skip the pytrain step of batch 8 x 256 (N = 2048) on mid-v248k")
    ap.add_argument("--no-head", dest="do_head", action="store_false",
                    help="skip the LM-head backward alternatives")
    ap.add_argument("--label-rows", "--pad-rows", dest="label_rows", default="512,2048",
                    help="N (rows of the label tensor) for the label work")
    ap.add_argument("--quiet-wait", type=float, default=120.0,
                    help="before each process, wait up to this many seconds for other processes to "
                         "use < 0.3 cores (0: do not wait)")
    ap.add_argument("--out", type=Path, default=None,
                    help="the markdown (default bench_results/train.md; with --labels-only the folder "
                         "bench_results, or a .md path)")
    ap.add_argument("--note", dest="notes", action="append", default=[])
    ap.add_argument("--json", type=Path, default=None,
                    help="also save the raw results here (default: the .json beside --out; with --report-from "
                         "of one json: store the --note lines into it)")
    ap.add_argument("--report-from", type=Path, nargs="+", default=None,
                    help="only rewrite the markdown from a --json file of an earlier run")
    # internal
    ap.add_argument("--make", choices=sorted(bf.SPECS), help=argparse.SUPPRESS)
    ap.add_argument("--into", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=["pytrain", "hf", "labels", "headbwd"], help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=5, help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--hf", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--pad-id", type=int, default=248044, help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=5,
                    help="repetitions of each way in the label work (median); LM-head variants: 3")
    ap.add_argument("--seed", type=int, default=1234, help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.make:
        bf.make_model(a.make, a.into)
        return 0
    if a.worker:
        _renice(a.nice)
    if a.worker == "pytrain":
        pytrain_worker(a)
        return 0
    if a.worker == "hf":
        hf_worker(a)
        return 0
    if a.worker == "headbwd":
        headbwd_worker(a)
        return 0
    if a.worker == "labels":
        labels_worker(a)
        return 0

    if a.report_from:   # merge earlier runs: rows in order, the first label work found, all loads
        js = [json.loads(f.read_text()) for f in a.report_from]
        a.threads = a.threads or ",".join(map(str, js[0].get("threads") or [2]))
    a.thread_list = [int(t) for t in str(a.threads or "2").split(",") if t.strip()]
    model_threads = {}
    for mt in a.model_threads:
        k, _, v = mt.partition("=")
        model_threads[k.strip()] = [int(t) for t in v.split(",") if t.strip()]
    blas_off = {m.strip() for m in a.blas_off.split(",") if m.strip()}
    one_graph = {m.strip() for m in a.one_graph.split(",") if m.strip()}
    if a.report_from:
        if any(j.get("kind") == "labels" for j in js):   # a --labels-only run: labels.md
            if len(js) > 1:
                raise SystemExit("--report-from: a labels json (--labels-only) is rendered alone")
            md_path, _ = _labels_paths(a.out)
            md = labels_report(js[0], a.notes)
            print(md)
            md_path.parent.mkdir(parents=True, exist_ok=True)
            md_path.write_text(md)
            print(f"wrote {md_path}")
            return 0
        _refuse_old(js, a.report_from)
        a.out = a.out or REPO / "bench_results" / "train.md"
        if a.notes and a.json and len(js) == 1 and a.json.resolve() == a.report_from[0].resolve():
            js[0]["notes"] = a.notes      # the json keeps the notes: it still renders byte for byte
            a.json.write_text(json.dumps(js[0], default=str, indent=1))
            print(f"notes stored into {a.json}")
        a.notes = a.notes or [n for j in js for n in j.get("notes", [])]
        labels = next((j["labels"] for j in js if j.get("labels")), None)
        md = report([r for j in js for r in j["rows"]], labels, a, [x for j in js for x in j["loads"]],
                    js[0].get("info"), [x for j in js for x in j.get("extra_steps") or []],
                    next((j["heads"] for j in js if j.get("heads")), None))
        print(md)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(md)
        print(f"wrote {a.out}")
        return 0
    if a.labels_only:
        return labels_only(a)
    a.out = a.out or REPO / "bench_results" / "train.md"
    a.json = a.json or a.out.with_suffix(".json")
    t_start = time.time()
    loads = [os.getloadavg()]
    rows = []
    for name in [m.strip() for m in a.models.split(",") if m.strip()]:
        model = prepare(name, a)
        if model is None:
            continue
        batch, warmup, steps = train_settings(name, a)
        for ti, threads in enumerate(model_threads.get(name, a.thread_list)):
            print(f"[{name}] batch {batch[0]} x {batch[1]}, {warmup} warm-up + {steps} clean steps, "
                  f"{threads} threads", flush=True)
            row = dict(model, threads=threads, batch=list(batch))
            kw = dict(batch=batch, steps=steps, warmup=warmup)
            row["pytrain"] = run_worker(a.pytrain_python, "pytrain", model, a, threads, **kw)
            if name in blas_off:
                row["pytrain_noblas"] = run_worker(a.pytrain_python, "pytrain", model, a, threads, blas=False,
                                                   **kw)
            row["hf"] = run_worker(a.ref_python, "hf", model, a, threads, **kw) if model["hf"] else None
            if row["pytrain"] and row["hf"]:
                print(f"  [{name}] pytrain/HF = "
                      f"{row['pytrain']['tokens_per_s'] / row['hf']['tokens_per_s']:.2f}", flush=True)
            if name in one_graph and row["pytrain"] and "recompute" in (row["pytrain"].get("step_graph") or ""):
                row["pytrain_onegraph"] = run_worker(a.pytrain_python, "pytrain", model, a, threads,
                                                     recompute="off", **kw)
            for k, v in VARIANTS.items():
                if row["pytrain"] and row.get(k):
                    print(f"  [{name}] pytrain / pytrain {v} = "
                          f"{row['pytrain']['tokens_per_s'] / row[k]['tokens_per_s']:.2f}", flush=True)
            if a.do_profile and ti == 0:
                pp = run_worker(a.pytrain_python, "pytrain", model, a, threads, profile=True, batch=batch)
                row["pytrain_profile"] = pp and pp["profile"]
                if model["hf"]:
                    hp = run_worker(a.ref_python, "hf", model, a, threads, profile=True, batch=batch)
                    row["hf_profile"] = hp and hp["profile"]
            rows.append(row)
            loads.append(os.getloadavg())
    extra_steps = []
    big = next((m for m in (prepare(n, a) for n in ["mid-v248k"]) if m), None) if a.big_step else None
    if big:
        print(f"[mid-v248k] pytrain, batch 8 x 256 (N = 2048), {a.thread_list[0]} threads", flush=True)
        x = run_worker(a.pytrain_python, "pytrain", big, a, a.thread_list[0], batch=(8, 256), steps=3, warmup=1)
        extra_steps.append(dict(name="mid-v248k", threads=a.thread_list[0], pytrain=x))
    heads = None
    if a.do_head:
        heads = run_worker(a.pytrain_python, "headbwd", dict(name="head", vocab=V_REAL), a, a.thread_list[0],
                           extra=["--rows", "151936", "248320", "--reps", "3"])
        if heads:
            for V, d in heads["rows"].items():
                print(f"  [head] V={V}: " + ", ".join(f"{k} {v:.3f} s" for k, v in d.items()), flush=True)
    labels = run_labels(a) if a.do_labels else None
    loads.append(os.getloadavg())
    if not rows and not labels and not heads:
        print("nothing was benchmarked")
        return 1
    info = machine_info(a, time.time() - t_start)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(dict(rows=rows, labels=labels, loads=loads, info=info, notes=a.notes,
                                          extra_steps=extra_steps, heads=heads, threads=a.thread_list,
                                          wall_s=time.time() - t_start),
                                     default=str, indent=1))
        print(f"raw results in {a.json}")
    md = report(rows, labels, a, loads, info, extra_steps, heads)
    print()
    print(md)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(md)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
