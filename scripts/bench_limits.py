"""Where the limit is, for scripts/bench_train.py: a step's matrix-product FLOPs, the rate the
same library reaches on one product of the step's largest shapes (and a large square), the
utilization that gives, and the step's time outside the products.

Why: tokens/s against the other stack says which is faster, not how much faster either could
get.  A step at a small share of the machine's matmul peak with most of its time in the
products is limited by the product kernels' speed at its shapes; one whose time goes to the
other nodes is limited by those.  Everything is measured in the benchmark's own worker
processes, after their timed steps (so it disturbs none of them), at their thread counts:

* pytrain: the products counted on the first warm-up step as it runs them
  (``pytrain.plan.products.counting``: every graph the runtime computes, recompute and head
  chunks included); one step computed node by node (``pytrain profile``'s code) for the time
  in the product nodes and in every other node; the ggml probe
  (``pytrain.plan.matmul_probe``) at the ``--probe-top`` shapes holding the most FLOPs and at
  ``--probe-square``, on the worker's own runtime: OpenBLAS for F32 weights, oneDNN's bf16
  matmul for BF16 weights (``compute_type bf16``), ggml-cpu where neither takes the node.
* HF + PEFT: its FLOPs counted by ``torch.utils.flop_counter.FlopCounterMode`` on its first
  warm-up step (mm / addmm / bmm / attention, forward and backward, as autograd runs them);
  the torch probe: ``torch.matmul`` in the model's dtype at the same (M, N, K) shapes and the
  square, with ``torch.set_num_threads`` as the step.

Peak = the fastest probe (best of its timed products: contention only adds time).
Utilization = FLOPs / median step / that side's own peak.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path

from scripts.bench_common import LR, REPO

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


# --------------------------------------------------------------------------------------------
# machine and kernels
# --------------------------------------------------------------------------------------------

def cpu_facts() -> dict:
    """The CPU's model name and which of CPU_FLAGS /proc/cpuinfo lists."""
    name, flags = "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            if k.strip() == "model name" and name == "?":
                name = v.strip()
            elif k.strip() == "flags" and not flags:
                flags = set(v.split())
    except OSError:
        pass
    return dict(model=name, flags=[f for f in CPU_FLAGS if f in flags])


def pytrain_kernels() -> dict:
    """What pytrain's products ran on: the ggml-cpu variant, the BLAS library and oneDNN
    (from the native build's record) and oneDNN's bf16 matmul implementation on this CPU."""
    from pytrain import ggml
    try:
        info = ggml.build_info()
    except (OSError, ValueError):
        info = {}
    return dict(cpu_variant=ggml.CPU_VARIANT.name, blas=info.get("blas") or "none",
                onednn=info.get("onednn") or "none", bf16_kernel=ggml.bf16_kernel(),
                cpu=cpu_facts())


def onednn_isa(python: str) -> str:
    """oneDNN's version and ISA line as ONEDNN_VERBOSE reports them, from one tiny bf16
    product through pytrain in a process of its own ("" when it prints none: no oneDNN, or
    no bf16 matmul on this CPU)."""
    code = ("from pytrain import ggml\nfrom pytrain.plan.matmul_probe import probe, square\n"
            "if ggml.bf16_kernel():\n    probe(ggml.Runtime('cpu', threads=1), "
            "square(64, 'BF16'), reps=1)\n")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120,
                           cwd=str(REPO), env=dict(os.environ, ONEDNN_VERBOSE="1"))
    except (OSError, subprocess.TimeoutExpired):
        return ""
    ver = re.search(r"onednn_verbose,info,(oneDNN v[\d.]+)", r.stdout)
    isa = re.search(r"onednn_verbose,info,cpu,isa:(.*)", r.stdout)
    return f"{ver.group(1) if ver else 'oneDNN'}: {isa.group(1).strip()}" if isa else ""


def torch_kernels() -> dict:
    import torch
    cfg = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", cfg)
    dnn = re.search(r"MKL-DNN (v[\d.]+)", cfg)
    return dict(torch=torch.__version__, cpu_capability=torch.backends.cpu.get_cpu_capability(),
                blas=blas.group(1) if blas else "?", mkldnn=dnn.group(1) if dnn else "?")


# --------------------------------------------------------------------------------------------
# pytrain side (its worker)
# --------------------------------------------------------------------------------------------

def mnkb(shape: dict) -> list[int]:
    """(M, N, K, batch) of a product shape (Shape.to_dict()): M x K times K x N, batch times."""
    a, b, dst = shape["a"], shape["b"], shape["dst"]
    k = a[1] if shape["op"] == "OUT_PROD" else a[0]
    return [dst[0], dst[1], k, dst[2] * dst[3]]


def pytrain_limits(runtime, trainer, batch, products, compute_type: str, top: int,
                   square_n: int) -> dict:
    """After the timed steps: one profiled step (the node time in and outside the products)
    and the ggml probes at the ``top`` largest product shapes and the square."""
    from pytrain.plan.matmul_probe import probe_all, square
    from pytrain.plan.profile import profile_step
    t0 = time.perf_counter()
    prof = profile_step(trainer, [batch], LR)
    prod_s, other_s = prof.split()
    others = sorted(((k, v) for k, v in prof.by_op.items() if k not in
                     ("MUL_MAT", "OUT_PROD", "MUL_MAT_ID")), key=lambda kv: -kv[1])
    t1 = time.perf_counter()
    shapes = [s for s, _ in products.top(top)]
    if square_n:
        shapes.append(square(square_n, "BF16" if compute_type == "bf16" else "F32"))
    probes = []
    for s, p in zip(shapes, probe_all(runtime, shapes)):
        probes.append(dict(p.to_dict(), shape=s.to_dict(), mnkb=mnkb(s.to_dict()),
                           square=s == shapes[-1] and bool(square_n)))
    return dict(products=products.to_dict(top=max(top, 8)), profile=prof.to_dict(),
                profile_wall=prof.wall, node_s=prof.total, product_node_s=prod_s,
                other_node_s=other_s, top_other_ops=others[:4], probes=probes,
                peak_gflops=max((p["best_gflops"] for p in probes), default=None),
                profile_s=t1 - t0, probe_s=time.perf_counter() - t1, kernels=pytrain_kernels())


# --------------------------------------------------------------------------------------------
# HF side (its worker, in the reference interpreter)
# --------------------------------------------------------------------------------------------

def hf_flops_step(hf) -> tuple[float, dict]:
    """One HF step (it trains: a warm-up step) under FlopCounterMode: (its loss, the FLOPs in
    all and by aten op)."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as fc:
        loss = hf.one()
    by_op = {str(k).split(".")[-2] if str(k).count(".") >= 2 else str(k): int(v)
             for k, v in fc.get_flop_counts().get("Global", {}).items()}
    return loss, dict(flops=int(fc.get_total_flops()), by_op=by_op)


def torch_probe(m: int, n: int, k: int, batch: int, dtype: str, reps: int = 3,
                budget_s: float = 1.0) -> dict:
    """torch.matmul of (batch x) M x K by K x N in ``dtype``: GFLOP/s of the best and median
    of the timed products after one warm-up (as the ggml probe counts them)."""
    import torch
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(1)
    a = (torch.rand((batch, m, k) if batch > 1 else (m, k), generator=g) / 64 + 1 / 128).to(dt)
    b = (torch.rand((k, n), generator=g) / 64 + 1 / 128).to(dt)
    t0 = time.perf_counter()
    torch.matmul(a, b)
    warm = time.perf_counter() - t0
    times = []
    for _ in range(max(1, min(reps, int(budget_s / max(warm, 1e-9))))):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        times.append(time.perf_counter() - t0)
    f = 2 * m * n * k * batch
    return dict(mnkb=[m, n, k, batch], flops=f, dtype=dtype, times=times,
                best_gflops=f / min(times) / 1e9, median_gflops=f / statistics.median(times) / 1e9)


def parse_shapes(text: str) -> list[list[int]]:
    """"M,N,K,B;M,N,K,B" -> [[M, N, K, B], ...]."""
    return [[int(v) for v in part.split(",")] for part in text.split(";") if part.strip()]


def format_shapes(shapes: list[list[int]]) -> str:
    return ";".join(",".join(map(str, s)) for s in shapes)


def hf_limits(dtype: str, shapes: list[list[int]], flops: dict | None) -> dict:
    t0 = time.perf_counter()
    probes = [torch_probe(*s, dtype) for s in shapes]
    return dict(flops=flops, probes=probes, kernels=torch_kernels(),
                peak_gflops=max((p["best_gflops"] for p in probes), default=None),
                probe_s=time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# the report section
# --------------------------------------------------------------------------------------------

SIDES = (("pytrain", "pytrain f32"), ("pytrain_bf16", "pytrain bf16"),
         ("hf", None), ("hf_bf16", "HF bfloat16"), ("hf_f32", "HF float32"))


def _side_name(key: str, x: dict) -> str:
    if key == "hf":
        return f"HF {x.get('dtype', 'float32')}"
    return dict((k, v) for k, v in SIDES)[key]


def _gf(v) -> str:
    return f"{v:.1f}" if v is not None else "-"


def gflop(flops: float | None) -> str:
    """GFLOP with 3 significant digits at least one decimal (a toy step has 0.04)."""
    if not flops:
        return "-"
    g = flops / 1e9
    return f"{g:.1f}" if g >= 10 else f"{g:.3g}"


def limits_section(rows: list[dict]) -> list[str]:
    """The "Where the limit is" tables, for the rows whose workers measured it (nothing for
    results made before it existed)."""
    have = [(r, k, r[k]) for r in rows for k, _ in SIDES if (r.get(k) or {}).get("limits")]
    if not have:
        return []
    lines = ["", "## Where the limit is", "",
             "Matrix-product FLOPs of one step (pytrain: counted from the MUL_MAT / OUT_PROD "
             "nodes of the graphs the step computed, multiply-add = 2; HF: torch's "
             "FlopCounterMode on one step, its own count: its LM head runs on every row, and "
             "it has no formula for the CPU's fused attention (sdpa), left out), "
             "achieved = FLOPs / median step, "
             "peak = the fastest single product this side's library reached on this machine at "
             "the same thread count (the probes below: the step's largest product shapes and a "
             "square), utilization = achieved / peak. Product / other node time: pytrain's "
             "step computed node by node (`pytrain profile`), the node times in the matrix "
             "products and in every other node (share of the node time); the products' own "
             "rate there is FLOPs / their node time. See docs/performance.md.", "",
             "| model | threads | side | median step (s) | product GFLOP per step | achieved "
             "GFLOP/s | peak GFLOP/s (probe) | utilization | products in the profile: s "
             "(GFLOP/s) | other nodes: s (share of node time) | top other ops |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r, k, x in have:
        lim = x["limits"]
        flops = (lim.get("products") or {}).get("flops") if k.startswith("pytrain") else \
            (lim.get("flops") or {}).get("flops")
        step = x["median_s"]
        peak = lim.get("peak_gflops")
        ach = flops / step / 1e9 if flops else None
        util = f"**{100 * ach / peak:.0f}%**" if ach and peak else "-"
        if k.startswith("pytrain"):
            ps, os_, ns = lim["product_node_s"], lim["other_node_s"], lim["node_s"]
            prod = f"{ps:.3f} ({flops / ps / 1e9:.1f})" if ps > 0 and flops else "-"
            other = f"{os_:.3f} ({100 * os_ / ns:.0f}%)" if ns else "-"
            top = ", ".join(f"{o} {v:.3f}" for o, v in lim.get("top_other_ops") or [])
        else:
            prod = other = top = "-"
        lines.append(f"| {r['name']} | {r.get('threads', '?')} | {_side_name(k, x)} | "
                     f"{step:.3f} | {gflop(flops)} | {_gf(ach)} | {_gf(peak)} | "
                     f"{util} | {prod} | {other} | {top} |")
    lines += ["", "Probes (GFLOP/s, best of the timed products, median in brackets; M x N x K "
              "= an M x K operand times a K x N one; share = of the step's product FLOPs):", "",
              "| model | threads | side | product | M x N x K (x batch) | per step | share | "
              "ran on | GFLOP/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r, k, x in have:
        lim = x["limits"]
        if k.startswith("pytrain"):
            tot = lim["products"]["flops"] or 1
            times = {json.dumps(t["label"]): t["times"] for t in lim["products"]["top"]}
            for p in lim["probes"]:
                n = times.get(json.dumps(p["label"]))
                per = "-" if p.get("square") else f"{n}x" if n else "?"
                share = "-" if p.get("square") or not n else f"{100 * n * p['flops'] / tot:.0f}%"
                lines.append(f"| {r['name']} | {r.get('threads')} | {_side_name(k, x)} | "
                             f"{'square ' if p.get('square') else ''}{p['label']} | "
                             f"{_mnk(p['mnkb'])} | {per} | {share} | {p['backend']} | "
                             f"{p['best_gflops']:.1f} ({p['median_gflops']:.1f}) |")
        else:
            for p in lim["probes"]:
                lines.append(f"| {r['name']} | {r.get('threads')} | {_side_name(k, x)} | "
                             f"torch.matmul {p['dtype']} | {_mnk(p['mnkb'])} | - | - | torch | "
                             f"{p['best_gflops']:.1f} ({p['median_gflops']:.1f}) |")
    lines += ["", "Kernels:", ""] + kernel_lines(rows)
    return lines


def _mnk(v: list[int]) -> str:
    m, n, k, b = v
    return f"{m} x {n} x {k}" + (f" (x {b})" if b > 1 else "")


def kernel_lines(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        pk = next(((r.get(k) or {}).get("limits", {}).get("kernels") for k in
                   ("pytrain", "pytrain_bf16") if (r.get(k) or {}).get("limits")), None)
        if pk:
            cpu = pk["cpu"]
            line = (f"- CPU: {cpu['model']}; flags: {', '.join(cpu['flags']) or 'none of '}"
                    f"{'' if cpu['flags'] else ', '.join(CPU_FLAGS)}; pytrain: ggml-cpu "
                    f"variant {pk['cpu_variant']}, BLAS {pk['blas']}, oneDNN {pk['onednn']}"
                    + (f" (bf16 matmul {pk['bf16_kernel']})" if pk.get("bf16_kernel") else "")
                    + (f"; ONEDNN_VERBOSE: {r['onednn_isa']}" if r.get("onednn_isa") else ""))
            if line not in out:
                out.append(line)
        for k in ("hf", "hf_bf16", "hf_f32"):
            tk = ((r.get(k) or {}).get("limits") or {}).get("kernels")
            if tk:
                line = (f"- HF: torch {tk['torch']}, CPU capability {tk['cpu_capability']}, "
                        f"BLAS {tk['blas']}, oneDNN (mkldnn) {tk['mkldnn']}")
                if line not in out:
                    out.append(line)
    return out
