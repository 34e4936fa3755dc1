"""The markdown report of scripts/bench_train.py (bench_results/train.md) from its results:
the header, the throughput table, where a pytrain step goes, the profiles, the details."""
from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time

from scripts import bench_common as bc
from scripts.bench_common import ALPHA, LR, MAX_NORM, RANK, REPO
from scripts.bench_limits import limits_section

BATCH = (2, 256)
# Extra pytrain runs of a row, beside the default one (key in the row, label in the report):
# BLAS off = PYTRAIN_BLAS=0 (--blas-off), one graph = recompute="off" where auto chose layer-wise
# recompute (--one-graph).
VARIANTS = {"pytrain_noblas": "BLAS off", "pytrain_onegraph": "one graph, recompute=off"}
# The bf16 runs of a row (--bf16): pytrain with compute_type "bf16", and the HF + PEFT reference
# in the other dtype than the main "hf" one (--hf-dtype), under the key its dtype names.
HF_OTHER = {"bfloat16": "hf_bf16", "float32": "hf_f32"}
BF16_KEYS = ("pytrain_bf16", *HF_OTHER.values())


def machine_info(a, wall_s: float | None = None) -> list[str]:
    """Machine, versions, the command and how the workers ran (the report's header lines)."""
    m = bc.machine_facts()
    th = ", ".join(map(str, a.thread_list))
    mt = "".join(f"; {x.partition('=')[0]}: {x.partition('=')[2]}" for x in a.model_threads)
    dirty = bc.dirty("pytrain", "native", "scripts/bench_train.py", "scripts/bench_common.py",
                     "scripts/bench_limits.py")
    return [f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}; pytrain commit {m['commit']}"
            + (f" (uncommitted changes in: {', '.join(dirty)})" if dirty else "")
            + (f"; the whole run took {wall_s / 60:.0f} min" if wall_s else ""),
            f"- command: `python -m scripts.bench_train {shlex.join(sys.argv[1:])}`",
            f"- CPU: {m['cpu']}, {os.cpu_count()} cores visible, {m['mem']} RAM; threads per "
            f"side: **{th}**{mt} (pytrain `threads=N`, torch `set_num_threads(N)`, "
            f"OMP/MKL/OPENBLAS_NUM_THREADS=N)",
            f"- ggml {m['ggml']}",
            f"- {_blas_info()}",
            _bf16_info(a),
            f"- python {platform.python_version()} (pytrain side); worker processes at niceness "
            f"{a.nice:+d}" + (" in a session (scheduler autogroup) of their own, so that other "
                              "jobs on this shared machine yield the cores while they run"
                              if a.nice < 0 else "")]


def _bf16_info(a) -> str:
    """The CPU's bf16 units (the flags bf16 compute runs on) and whether the bf16 rows ran."""
    try:
        from pytrain import ggml
        from pytrain.models.precision import cpu_bf16_units
        units, kernel = cpu_bf16_units(), ggml.bf16_kernel()
    except ImportError:      # a report rendered by an interpreter without pytrain
        units, kernel = None, ""
    ran = getattr(a, "bf16_rows", None)
    return (f"- CPU bf16 units (avx512_bf16 / amx_bf16 in /proc/cpuinfo): "
            f"{'?' if units is None else ', '.join(units) or 'none'}; bf16 rows (`--bf16 "
            f"{getattr(a, 'bf16', 'auto')}`): {'?' if ran is None else 'run' if ran else 'not run'}"
            + (f"; pytrain's bf16 matmul: oneDNN {kernel}" if kernel else ""))


def _blas_info() -> str:
    """The BLAS backend line of the header (from the native build's record)."""
    try:
        info = json.loads((REPO / "pytrain" / "_native" / "build_info.json").read_text())
    except (OSError, ValueError):
        return "BLAS backend: unknown (no build_info.json)"
    if not info.get("blas"):
        return "BLAS backend: none in this build (pytrain = ggml's CPU backend alone)"
    dnnl = (f"; BF16 weights (compute_type bf16) through {info['onednn']}'s bf16 matmul, "
            f"MUL_MAT and OUT_PROD (patch 0018)" if info.get("onednn") else "")
    return (f"BLAS backend: ggml-blas on {info['blas']} (contiguous F32 MUL_MATs with every "
            "dimension >= 32, and contiguous matrix OUT_PRODs with a weight of any type, "
            f"converted to F32 in slabs{dnnl}; ggml-cpu the rest), listed before the CPU "
            "backend; \"BLAS off\" = the same build with PYTRAIN_BLAS=0 (CPU backend alone)")


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 0.01 else f"{s * 1e3:.1f} ms"


# --------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------

def _header(rows: list[dict], a, loads: list, info: list[str] | None) -> list[str]:
    la = ", ".join(f"{x:.2f}" for x in loads[0]) if loads else "?"
    lb = ", ".join(f"{x:.2f}" for x in loads[-1]) if loads else "?"
    bf16 = any(r.get(k) for r in rows for k in BF16_KEYS)
    lines = ["# LoRA training throughput: pytrain vs HF transformers + PEFT"
             + (", float32 and bfloat16" if bf16 else "") + " (CPU)", "",
             "Made by `python -m scripts.bench_train` (see its docstring for the exact step on "
             "each side). Tokens/s = tokens / median wall time of one optimizer step (forward, "
             "masked CE, backward, grad norm + clipping, AdamW) after warm-up, over the *clean* "
             "timed steps (other processes kept < 0.3 cores busy beyond the cores a side leaves "
             "free; the machine is shared; when no step was clean, over all of them), and from "
             "the fastest step (contention only adds time). Steps = clean / all timed. Each side "
             "runs in its own process; peak RSS = VmHWM of that process. Own CPU-s per step = "
             "CPU time the process used per step (mean cores used x median step; includes the "
             "spin-waiting of both sides' thread pools).", ""]
    lines += info or machine_info(a)
    one = [x[0] for x in loads] + [y["loadavg_before"][0] for r in rows
                                   for y in (r.get("pytrain"), r.get("hf"))
                                   if y and "loadavg_before" in y]
    rng_ = f"; 1-min load average over the run {min(one):.2f} to {max(one):.2f}" if one else ""
    lines.append(f"- load average (1, 5, 15 min) at start: {la}; at end: {lb}{rng_} (2 cores: a "
                 f"load above 2 means other processes were running)")
    hf = next((r["hf"] for r in rows if r.get("hf")), None)
    if hf:
        dts: dict[str, list] = {}
        for r in rows:
            for k in ("hf", *HF_OTHER.values()):
                if r.get(k):
                    dts.setdefault(r[k].get("dtype", "float32"), []).append(r["name"])
        dt = ("; ".join(f"{d} ({', '.join(dict.fromkeys(ns))})" for d, ns in dts.items())
              if len(dts) > 1 else next(iter(dts)))
        lines.append(f"- HF: torch {hf['torch']}, transformers {hf['transformers']}, peft "
                     f"{hf['peft']}, attn_implementation={hf['attn']}, {dt}, train mode; torch "
                     f"DeltaNet fallback (no flash-linear-attention)")
    batches: dict[tuple, list] = {}
    for r in rows:
        batches.setdefault(tuple(r.get("batch") or BATCH), []).append(r["name"])
    bdesc = "; ".join(f"batch {b[0]} x {b[1]}"
                      + (f" ({', '.join(dict.fromkeys(ns))})" if len(batches) > 1 else "")
                      + f", {b[0] * (b[1] // 2)} target tokens" for b, ns in batches.items())
    lines.append(f"- LoRA r={RANK}, alpha={ALPHA:g}, dropout 0, q/k/v/o of the full-attention "
                 f"layers; AdamW lr {LR:g}, wd 0, clip {MAX_NORM:g}; {bdesc}; no padding, the "
                 f"first half of each row masked")
    return lines


def _both(f, p, h, sep=" / ") -> str:
    return sep.join(f(y) if y else "-" for y in (p, h))


def _row_cells(r: dict, variants: list[str]) -> list[str]:
    p, h = r.get("pytrain"), r.get("hf")
    B, T = r.get("batch") or BATCH
    bt = [B * T / y["best_s"] if y else None for y in (p, h)]
    best = " / ".join(f"{v:.1f}" if v else "-" for v in bt) + (
        f" ({bt[0] / bt[1]:.2f})" if p and h else "")
    x = p or h
    cells = [r["name"], str(r.get("threads", "?")), f"{B} x {T}",
             f"{x['tokens']} ({x['n_targets']})" if x else "-",
             _both(lambda y: f"{y['n_clean']}/{len(y['times'])}", p, h),
             f"{p['tokens_per_s']:.1f} ({p['target_tokens_per_s']:.1f})" if p else "-",
             f"{h['tokens_per_s']:.1f} ({h['target_tokens_per_s']:.1f})" if h else "-",
             f"**{p['tokens_per_s'] / h['tokens_per_s']:.2f}**" if p and h else "-", best,
             bc.fmt_gib(p["peak_rss"]) if p else "-", bc.fmt_gib(h["peak_rss"]) if h else "-"]
    for k in variants:
        q = r.get(k)
        cells += [f"{q['tokens_per_s']:.1f}, {q['n_clean']}/{len(q['times'])}, "
                  f"{bc.fmt_gib(q['peak_rss'])}" if q else "-",
                  f"**{p['tokens_per_s'] / q['tokens_per_s']:.2f}**" if p and q else "-"]
    return cells + [_both(lambda y: f"{y['own_cores'] * y['median_s']:.2f}", p, h),
                    _both(lambda y: f"{y['first_loss']:.5f}", p, h),
                    _both(lambda y: f"{y['lora_params']:,} ({y['lora_names']})", p, h),
                    _both(lambda y: f"{y['others_cores']:.2f}", p, h)]


def _main_table(rows: list[dict]) -> list[str]:
    variants = [k for k in VARIANTS if any(r.get(k) for r in rows)]
    vhead = "".join(f"pytrain {VARIANTS[k]}: tokens/s, steps, peak RSS | pytrain / {VARIANTS[k]} | "
                    for k in variants)
    lines = ["", "| model | threads | batch | tokens (targets) | steps pytrain / HF | pytrain "
             "tokens/s (targets/s) | HF tokens/s (targets/s) | ratio pytrain/HF | best-step "
             "tokens/s pytrain / HF (ratio) | pytrain peak RSS | HF peak RSS | " + vhead
             + "own CPU-s per step pytrain / HF | first-step loss pytrain / HF | LoRA params "
             "pytrain / HF | other load (cores) pytrain / HF |",
             "|---|---|---|---|---|---|---|---|---|---|---|" + "---|---|" * len(variants)
             + "---|---|---|---|"]
    lines += ["| " + " | ".join(_row_cells(r, variants)) + " |" for r in rows]
    lines += ["", "Shapes:", ""]
    seen = set()
    for r in rows:
        if r["name"] in seen:
            continue
        seen.add(r["name"])
        n = f"; {r['n_params'] / 1e6:.1f} M parameters" if r.get("n_params") else ""
        hfnote = ("" if r.get("hf") else " (HF side not run: --no-hf)" if r.get("no_hf")
                  else " (HF side not run: no HF checkpoint)")
        p = r.get("pytrain") or {}
        wt = ", ".join(f"{k} x {v}" for k, v in (p.get("weight_types") or {}).items())
        how = (f"; pytrain loads its weight tensors as {wt} and trains it with "
               f"{p['step_graph']} (Trainer recompute={p.get('recompute', 'auto')})"
               if p.get("step_graph") else "")
        lines.append(f"- **{r['name']}**: {r['desc']}{n}; weights {r['weights']}{hfnote}{how}")
        lines += _real_loads(r) if r.get("file_type") else []
    return lines


def _real_loads(r: dict) -> list[str]:
    """Why pytrain loaded a real model's matrices as it did (its training type choice) and,
    when the bf16 side ran, what it loaded them as there: a quantized file is trained at
    types a synthetic F32 one never meets, so the row means little without them."""
    p, b = r.get("pytrain") or {}, r.get("pytrain_bf16") or {}
    out = [f"  - pytrain's type choice, compute f32: {p['type_choice']}"] \
        if p.get("type_choice") else []
    if b:
        wt = ", ".join(f"{t} x {c}" for t, c in (b.get("weight_types") or {}).items())
        out.append(f"  - pytrain, compute bf16: loaded as {wt}"
                   + (f" ({b['type_choice']})" if b.get("type_choice") else ""))
    return out


def _phase_table(rows: list[dict], extra_steps: list) -> list[str]:
    lines = ["", "## Where a pytrain step goes (median per step)", "",
             "Host phases are timed by wrapping pytrain functions at runtime. `labels` = "
             "`MaskedCE.prepare` of each micro-batch, the one-hot labels built on the device: "
             "`set_targets` (host + the O(N) upload of the flat one-positions and the row mask), "
             "`build_labels` (the fill + SET_ROWS graph computed on the backend) and the "
             "pad-column `read_column` (inside `check_labels`), measured inside the real step; "
             "N = the loss rows of the step's graph (the micro-batch's target rows, "
             "`loss.rows_bucket`).", "",
             "| model | threads | batch | step (s) | compute fwd+bwd | compute optimizer | "
             "alloc_graph | inputs | labels (N) | of which set_targets / build_labels / "
             "pad-column read | rest |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    steps = []
    for r in rows:
        steps += [(r["name"], r, r.get("pytrain"))] + [
            (f"{r['name']} ({v})", r, r.get(k)) for k, v in VARIANTS.items()] + [
            (f"{r['name']} (bf16 compute)", r, r.get("pytrain_bf16"))]
    steps += [(x["name"], x, x.get("pytrain")) for x in extra_steps]
    for name, r, p in steps:
        if not p:
            continue
        ph, st = p["phases"], p["step_seconds"]
        cells = [name, str(r.get("threads", "?")), "x".join(map(str, p.get("batch", BATCH))),
                 f"{st:.3f}"]
        for k in ("compute fwd+bwd", "compute optimizer", "alloc_graph", "inputs", "labels"):
            cells.append(f"{_ms(ph.get(k, 0.0))} ({100 * ph.get(k, 0.0) / st:.1f}%)")
        cells[-1] += f" (N = {', '.join(map(str, p['loss_rows']))})" if p.get("loss_rows") else ""
        rc = ph.get("labels.read_column", 0.0)
        cells.append(" / ".join(_ms(ph.get("labels." + k, 0.0))
                                for k in ("set_targets", "build_labels"))
                     + f" / {_ms(rc)} ({100 * rc / st:.4f}%)")
        cells.append(f"{_ms(ph.get('rest', 0.0))} ({100 * ph.get('rest', 0.0) / st:.1f}%)")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _shares(d: dict, tot: float, n: int | None = None) -> str:
    items = sorted(d.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {v:.3f} s ({100 * v / tot:.0f}%)" for k, v in items)


def _profile_section(rows: list[dict]) -> list[str]:
    profs = [(f"{r['name']} ({r.get('threads')} threads)", r.get("pytrain_profile"),
              r.get("hf_profile")) for r in rows if r.get("pytrain_profile") or r.get("hf_profile")]
    if not profs:
        return []
    lines = ["", "## Profile of one step", "",
             "pytrain: one step computed node by node under a ggml scheduler eval callback, "
             "each node timed and summed by part of the model "
             "(forward, and (bwd) for the backward nodes that compute that part's gradients; "
             "(recompute) for a layer-wise step's second forward of a layer) and by op, with the "
             "backend the scheduler ran it on in brackets (BLAS = ggml-blas on OpenBLAS, CPU = "
             "ggml-cpu); compare the profiled step with the unprofiled one above for the dispatch "
             "overhead. HF: torch.profiler, top ops by self CPU time.", ""]
    for name, pp, hp in profs:
        if pp:
            tot = sum(pp["by_op"].values())
            lines.append(f"- **{name}** pytrain (profiled step {pp['wall']:.2f} s, "
                         f"{pp['n_nodes']} nodes computed, node times sum {tot:.2f} s"
                         + (f"; {pp['step_graph']}" if pp.get("step_graph") else "")
                         + f"): by part: {_shares(pp['by_part'], tot)}")
            if pp.get("by_backend"):
                lines.append(f"  - by backend: {_shares(pp['by_backend'], tot)}")
            lines += [f"  - top ops: {_shares(pp.get('by_op_backend') or pp['by_op'], tot, 10)}",
                      "  - top part x op: "
                      + _shares(pp.get("by_part_op_backend") or pp["by_part_op"], tot, 12)]
        if hp:
            top = ", ".join(f"{k} {v:.3f} s" for k, v, *_ in hp["top"][:10])
            lines.append(f"- **{name}** HF (profiled step {hp['wall']:.2f} s): top self-CPU ops: "
                         f"{top}")
    return lines


def _details(rows: list[dict]) -> list[str]:
    lines = ["", "Details:", ""]
    for r in rows:
        for side in ("pytrain", *VARIANTS, "pytrain_bf16", "hf", *HF_OTHER.values()):
            x = r.get(side)
            if not x:
                continue
            sname = (f"pytrain {VARIANTS[side]}" if side in VARIANTS else "pytrain bf16 compute"
                     if side == "pytrain_bf16" else f"hf {x.get('dtype')}" if side in BF16_KEYS
                     else side)
            own = (f"; {x['graph_nodes']} graph nodes; pad id {x['pad_id']}"
                   + (f"; backends {', '.join(x['backends'])}" if x.get("backends") else "")
                   + (f"; {x['compute']}" if x.get("compute_type") == "bf16" else "")
                   if not side.startswith("hf") else
                   (f"; LoRA weights {', '.join(x['lora_dtypes'])}" if x.get("lora_dtypes")
                    else "")
                   + (f"; kernels: {bc.kernel_summary(x['kernels'])}" if x.get("kernels")
                      else ""))
            lines.append(
                f"- {r['name']} {sname}, {r.get('threads')} threads: load {x['load_s']:.2f} s, "
                f"warm-up {', '.join(f'{t:.3f}' for t in x['warmup_s'])} s, steps "
                f"{', '.join(f'{t:.3f} ({o:.2f})' for t, o in zip(x['times'], x['others']))} s "
                f"(other cores in brackets); losses {', '.join(f'{v:.4f}' for v in x['losses'])}; "
                f"RSS after load {bc.fmt_gib(x['rss_after_load'])}, at end anon "
                f"{bc.fmt_gib(x['rss_end_anon'])} + file {bc.fmt_gib(x['rss_end_file'])}; cores "
                f"used {x['own_cores']:.2f}; machine busy {x['busy_before']:.2f} cores before{own}")
    return lines


# --------------------------------------------------------------------------------------------
# the bf16 comparison (--bf16): pytrain f32 / bf16 against HF + PEFT float32 / bfloat16
# --------------------------------------------------------------------------------------------

def references(r: dict) -> dict[str, dict]:
    """A row's HF + PEFT results by dtype ("float32", "bfloat16")."""
    out: dict[str, dict] = {}
    for k in ("hf", *HF_OTHER.values()):
        if r.get(k):
            out.setdefault(r[k].get("dtype", "float32"), r[k])
    return out


def bf16_ratios(r: dict) -> dict:
    """The four sides of a row (pytrain f32 / bf16, HF float32 / bfloat16), the faster HF
    reference's dtype, and pytrain's ratios against each reference (None where a side is
    missing)."""
    refs = references(r)
    sides = {"pytrain f32": r.get("pytrain"), "pytrain bf16": r.get("pytrain_bf16"),
             "HF f32": refs.get("float32"), "HF bf16": refs.get("bfloat16")}
    tps = {k: v["tokens_per_s"] if v else None for k, v in sides.items()}
    ref = {k: tps[k] for k in ("HF f32", "HF bf16") if tps[k]}
    faster = max(ref, key=ref.get) if ref else None
    ratio = lambda p, h: tps[p] / tps[h] if tps[p] and h and tps[h] else None  # noqa: E731
    return dict(sides=sides, faster=faster, f32=ratio("pytrain f32", "HF f32"),
                bf16=ratio("pytrain bf16", "HF bf16"), f32_fast=ratio("pytrain f32", faster),
                bf16_fast=ratio("pytrain bf16", faster))


def bf16_ratio_lines(r: dict) -> list[str]:
    """The bf16 comparison's ratios of a row, for the benchmark's progress output."""
    if not any(r.get(k) for k in BF16_KEYS):
        return []
    x = bf16_ratios(r)
    names = dict(f32="pytrain f32 / HF f32", bf16="pytrain bf16 / HF bf16",
                 f32_fast=f"pytrain f32 / {x['faster']} (faster)",
                 bf16_fast=f"pytrain bf16 / {x['faster']} (faster)")
    return [f"{v} = {x[k]:.2f}" for k, v in names.items() if x[k]]


def _ratio(v: float | None) -> str:
    return f"**{v:.2f}**" if v else "-"


def _bf16_cells(r: dict) -> list[str]:
    x = bf16_ratios(r)
    sides = list(x["sides"].values())
    four = lambda f, sep=" / ": sep.join(f(y) if y else "-" for y in sides)  # noqa: E731
    p16, h32, h16 = sides[1], sides[2], sides[3]
    kern = [f"pytrain: {p16.get('bf16_kernel') or '?'}" if p16 else "pytrain: -",
            f"HF bf16: {bc.kernel_summary(h16.get('kernels')) if h16 else '-'}",
            f"HF f32: {bc.kernel_summary(h32.get('kernels')) if h32 else '-'}"]
    return [r["name"], str(r.get("threads", "?")), four(lambda y: f"{y['tokens_per_s']:.1f}"),
            four(lambda y: f"{y['n_clean']}/{len(y['times'])}", ", "), _ratio(x["f32"]),
            _ratio(x["bf16"]), x["faster"] or "-", _ratio(x["f32_fast"]), _ratio(x["bf16_fast"]), four(lambda y: f"{y['peak_rss'] / 2**30:.2f}"),
            four(lambda y: f"{y['first_loss']:.5f}"), "; ".join(kern)]


def bf16_section(rows: list[dict]) -> list[str]:
    """The compact table of the bf16 comparison (bench_results/train-bf16.md), for the rows
    that ran it; nothing for results without it."""
    rows = [r for r in rows if any(r.get(k) for k in BF16_KEYS)]
    if not rows:
        return []
    lines = ["", "## float32 and bfloat16: pytrain against both HF + PEFT references", "",
             "pytrain f32 = the default run (below); pytrain bf16 = the same step with "
             "`compute_type=\"bf16\"`: the frozen weight matrices loaded as BF16 and multiplied "
             "(forward MUL_MAT, backward OUT_PROD) by oneDNN's bf16 matmul in ggml-blas, the "
             "other operand rounded to bf16 there; LoRA, the rest of the graph and AdamW in "
             "float32. HF f32 / HF bf16 = HF + PEFT with the model loaded in torch.float32 / "
             "torch.bfloat16 (PEFT's LoRA weights: see Details). The faster HF reference is the "
             "one with more tokens/s in that row. Kernels: pytrain's bf16 matmul "
             "(`pytrain.ggml.bf16_kernel()`); HF's from one extra, untimed step after the timed "
             "ones, under oneDNN verbose (matmul / inner_product implementations x executions) "
             "and torch.profiler (calls of the aten matmul ops: torch's float32 products go to "
             "its CPU BLAS, not oneDNN).", "",
             "| model | threads | tokens/s pytrain f32 / pytrain bf16 / HF f32 / HF bf16 | "
             "clean/timed steps (same order) | pytrain f32 / HF f32 | pytrain bf16 / HF bf16 | "
             "faster HF | pytrain f32 / faster HF | pytrain bf16 / faster HF | peak RSS (GiB) pytrain f32 / pytrain bf16 / HF f32 "
             "/ HF bf16 | first-step loss pytrain f32 / pytrain bf16 / HF f32 / HF bf16 | "
             "kernels |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(_bf16_cells(r)) + " |" for r in rows]
    computes = dict.fromkeys(r["pytrain_bf16"]["compute"] for r in rows
                             if (r.get("pytrain_bf16") or {}).get("compute"))
    lines += [""] + [f"- pytrain bf16: {c}" for c in computes]
    return lines


def report(rows: list[dict], a, loads: list, info: list[str] | None = None,
           extra_steps: list | None = None) -> str:
    lines = (_header(rows, a, loads, info) + bf16_section(rows) + _main_table(rows)
             + limits_section(rows) + _phase_table(rows, extra_steps or [])
             + _profile_section(rows) + _details(rows))
    if a.notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in a.notes]
    return "\n".join(lines) + "\n"
