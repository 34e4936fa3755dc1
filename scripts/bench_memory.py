"""The memory a training step needs at the Qwen3.5-2B shape, per weight type and batch shape,
with and without layer-wise recompute: written to bench_results/memory.md (+ .json).

Nothing is allocated and no GPU is needed: the graphs pytrain builds for a training step are
measured by the scheduler (``ggml_backend_sched_reserve_size``) on weights that are metadata
only (``pytrain.step.graph_memory.shape_model``).  What a CUDA run holds is

    weights (in the GGUF's type) + persistent step tensors (layer inputs, gradients handed
    down, the batch's inputs) + the largest compute buffer of one graph + LoRA and AdamW

and the compute buffer of a graph is the same on any backend (ggml-alloc plans it the same
way; the CUDA pool's own slack, the CUDA context and cuBLAS workspaces come on top).
The one-graph step (``train.recompute = "off"``) keeps every activation the backward needs.

Reference: HF transformers + PEFT on one H200 at this shape, batch 4 x 1024, bf16, LoRA r 16
on q/k/v/o of the 6 attention layers, half the labels masked: 32.9 GiB peak for the whole
process.

``pytrain plan CONFIG`` reports the same figures for one config's run (run_memory.plan_run).

Usage:  python -m scripts.bench_memory [--batch 4] [--lengths 1024,2048,4096]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

from pytrain import ggml
from pytrain.models import lora
from pytrain.models.lora_targets import select_targets
from pytrain.models.qwen35_config import QWEN35_2B
from pytrain.step import loss as loss_mod
from pytrain.step.graphs import GradGraph
from pytrain.step.optimizer import OptimizerState
from pytrain.step.graph_memory import compute_bytes, shape_model
from pytrain.step.step_memory import step_buffers
from scripts.bench_common import REPO, git_commit

GiB = 2 ** 30
# HF + PEFT's peak on an H200 at the same shape and batch (the file says how it was measured)
PEFT_ANCHOR_GIB = json.loads((REPO / "bench_results"
                              / "anchor_hf_peft_h200.json").read_text())["peak_gib"]
TYPES = ("bf16", "f16", "q8_0", "q4_K")


def weight_bytes(file_type: str) -> int:
    """The weights as a CUDA run loads them (matrices in the file's type, the rest F32)."""
    m = shape_model("qwen35", QWEN35_2B, file_type, device="cuda")
    n = m.weights.loaded_bytes
    m.close()
    return n


def acc_traffic(graph) -> dict:
    """Elements the one-graph step's ACC nodes write (the backward adds each view's gradient
    into its source's with an ACC; patch 0010 makes most of them in place, writing only the
    view's region), and what the same nodes would write if each copied its whole gradient,
    as an ACC does without the patch."""
    lib, ffi = ggml.lib, ggml.ffi
    n = in_place = written = whole = 0
    for i in range(lib.ggml_graph_n_nodes(graph)):
        t = lib.ggml_graph_node(graph, i)
        if t.op != lib.GGML_OP_ACC:
            continue
        ip = bool(ffi.cast("int32_t *", t.op_params)[4])
        n += 1
        in_place += ip
        written += int(lib.ggml_nelements(t.src[1] if ip else t))
        whole += int(lib.ggml_nelements(t))
    return {"nodes": n, "in_place": in_place, "written": written, "if_copied": whole}


def cpu_one_graph(B: int, T: int) -> int:
    """The one-graph step's compute buffer as the CPU builds it: its DeltaNet layers run
    GATED_DELTA_NET and its backward (patch 0020), which no GPU backend has, instead of the
    chunked rule whose per-chunk tensors the GPU's graph keeps."""
    m = shape_model("qwen35", QWEN35_2B, "f16", device="cpu")
    try:
        ad = lora.create(m.runtime, m.config, select_targets(m.config), 16, 32.0)
        g = GradGraph(m, ad, B, T, rows=loss_mod.rows_bucket(B * T // 2, B * T))
        try:
            return compute_bytes(m.runtime, g.graph)
        finally:
            g.close()
    finally:
        m.close()


def step_memory(B: int, T: int) -> dict:
    """Compute buffers of the one-graph step and of the layer-wise step (largest graph), plus
    the layer-wise step's persistent tensors and the adapter with its AdamW state (the figures
    of ``pytrain plan``: step_memory.step_buffers)."""
    m = shape_model("qwen35", QWEN35_2B, "f16", device="cuda")   # sizes do not depend on the type
    try:
        ad = lora.create(m.runtime, m.config, select_targets(m.config), 16, 32.0)
        adapter = sum(int(ggml.lib.ggml_nbytes(p)) for p in ad.params()) * 4   # +grad, m, v
        opt_state = OptimizerState(m.runtime, ad.params())
        t0 = time.perf_counter()
        one, lw = step_buffers(m, ad, opt_state, B, T, n_targets=B * T // 2)   # half are targets
        g = GradGraph(m, ad, B, T, opt_state=opt_state, rows=loss_mod.rows_bucket(B * T // 2, B * T))
        acc_t = acc_traffic(g.graph)
        g.close()
        return {"B": B, "T": T, "one_graph": one, "one_graph_cpu": cpu_one_graph(B, T),
                "layerwise_peak": lw["largest"],
                "layerwise_graphs": lw["graphs"], "layerwise_persistent": lw["persistent"],
                "head_chunk_rows": lw["head_chunk_rows"], "adapter_and_adamw": adapter,
                "acc": acc_t, "seconds": round(time.perf_counter() - t0, 1)}
    finally:
        m.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--out", type=Path, default=REPO / "bench_results")
    a = ap.parse_args()
    weights = {t: weight_bytes(t) for t in TYPES}
    rows = [step_memory(a.batch, int(T)) for T in a.lengths.split(",")]
    commit = git_commit()
    info = ggml.build_info()
    result = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "commit": commit, "ggml": info["ggml_version"], "patches": info.get("patches"),
              "weights": weights, "steps": rows, "peft_anchor_gib": PEFT_ANCHOR_GIB}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "memory.json").write_text(json.dumps(result, indent=2) + "\n")
    g = lambda n: f"{n / GiB:.2f}"   # noqa: E731
    lines = [
        "# Training-step memory at the Qwen3.5-2B shape",
        "",
        f"Made by `python -m scripts.bench_memory` (commit {commit}, {result['date']}; ggml "
        f"{info['ggml_version']}). Measured by the scheduler on the graphs pytrain builds, "
        "nothing allocated (see the script's docstring). Shape: hidden 2048, 24 layers "
        "(attention every 4th), vocabulary 248320, tied; LoRA r 16 on q/k/v/o of the 6 "
        "attention layers; half of the tokens are targets.",
        "",
        "## Weights as a CUDA run loads them (matrices keep the GGUF's type, patch 0003)",
        "",
        "| GGUF type | weights (GiB) |",
        "|---|---|",
        *[f"| {t.upper()} | {g(n)} |" for t, n in weights.items()],
        "",
        f"## Step memory, batch {a.batch} (GiB)",
        "",
        "The graphs a CUDA (or Vulkan) run builds: their DeltaNet layers use the chunked "
        "recurrence. `one graph` = the compute buffer of `train.recompute = \"off\"` (every "
        "activation kept for the backward); `one graph, CPU` = the same step as the CPU builds "
        "it, the recurrence through GATED_DELTA_NET and its backward (patch 0020). `layer-wise` = `train.recompute = \"layers\"`: the largest compute "
        "buffer of its graphs, plus its persistent tensors (each layer's input, the gradient "
        "handed down, the batch's inputs). Total = BF16 weights + layer-wise + adapter and "
        f"AdamW state; HF + PEFT's whole process: {PEFT_ANCHOR_GIB} GiB at T = 1024.",
        "",
        "| T | tokens | one graph | one graph, CPU | layer-wise: largest graph | of which (pre / "
        "layer fwd / head+loss chunk / layer bwd) | persistent | total with BF16 weights "
        "(layer-wise) | total with Q4_K weights |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pg = r["layerwise_graphs"]
        base = r["layerwise_peak"] + r["layerwise_persistent"] + r["adapter_and_adamw"]
        lines.append(
            f"| {r['T']} | {r['B'] * r['T']} | {g(r['one_graph'])} | {g(r['one_graph_cpu'])} | "
            f"{g(r['layerwise_peak'])} | "
            f"{g(pg['pre'])} / {g(pg['layer forward'])} / {g(pg['head + loss chunk'])} "
            f"({r['head_chunk_rows']} rows) / {g(pg['layer backward'])} | "
            f"{g(r['layerwise_persistent'])} | {g(base + weights['bf16'])} | "
            f"{g(base + weights['q4_K'])} |")
    lines += ["", f"## ACC traffic of the one-graph step (a GPU's graph), batch {a.batch}", "",
              "The backward adds each view's gradient into its source's gradient with an ACC; "
              "the chunked DeltaNet reads six tensors per layer through one view per chunk. "
              "`written`: elements the ACC nodes write (patch 0010: in place, only the view's "
              "region, where the gradient is the chain's own); `if copied`: what the same "
              "nodes would write if each copied its whole gradient, as ggml's ACC does "
              "without the patch.", "",
              "| T | ACC nodes | in place | written (G elements) | if copied (G elements) |",
              "|---|---|---|---|---|"]
    for r in rows:
        c = r["acc"]
        lines.append(f"| {r['T']} | {c['nodes']} | {c['in_place']} | {c['written'] / 1e9:.2f} | "
                     f"{c['if_copied'] / 1e9:.2f} |")
    (a.out / "memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
