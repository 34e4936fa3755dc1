"""Benchmark: ggml-cpu's CROSS_ENTROPY_LOSS and CROSS_ENTROPY_LOSS_BACK alone, at the loss's shape.

Why: at vocabulary 150k-250k the loss over logits [V, N] is a sizeable share of a CPU step
(native patch 0019 rewrote both ops to read each row once per pass).  Each op is timed as a
graph of its own on the CPU backend, computed ``--reps`` times per worker process, over
logits N(0, 3) and one-hot labels.  ``--variants`` lists the ggml-cpu modules to compare: a
variant name of this build (``best``, ``haswell``, ...) or the path of a ggml-cpu module, such
as another build's (another checkout's ``pytrain/_native/lib/libggml-cpu-zen4.so``: its
CROSS_ENTROPY ops against this build's, on the same ggml-base).  Rounds alternate the
variants, one fresh worker each, so that drift on a shared machine spreads over all of them;
the medians are over every rep of every round.

Usage: python -m scripts.bench_cross_entropy [--vocab 151936] [--rows 256] [--threads 2]
                                            [--rounds 10] [--reps 3] [--variants best,PATH]
                                            [--out bench_results/cross_entropy.md]
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

from scripts.test_cpu_matrix import cpu_description

ROOT = Path(__file__).resolve().parent.parent


def worker(vocab: int, rows: int, threads: int, reps: int) -> dict:
    """Time the two ops ``reps`` times each in this process (the ggml-cpu module the loader
    picked: ``PYTRAIN_CPU_VARIANT``)."""
    import numpy as np

    from pytrain import ggml
    from pytrain.ggml import lib

    rt = ggml.Runtime("cpu", threads=threads, blas=False)
    f32 = lib.GGML_TYPE_F32
    data = ggml.Context(n_tensors=3)
    x = lib.ggml_new_tensor_2d(data.ptr, f32, vocab, rows)
    y = lib.ggml_new_tensor_2d(data.ptr, f32, vocab, rows)
    d = lib.ggml_new_tensor_1d(data.ptr, f32, 1)
    rt.alloc(data, on_cpu=True)
    rng = np.random.default_rng(0)
    ggml.from_numpy(x, (rng.standard_normal((rows, vocab)) * 3).astype(np.float32))
    labels = np.zeros((rows, vocab), np.float32)
    labels[np.arange(rows), rng.integers(0, vocab, rows)] = 1.0
    ggml.from_numpy(y, labels)
    ggml.from_numpy(d, np.ones(1, np.float32))
    ops = {}
    ctxs = []
    for name, make in (("forward", lambda c: lib.ggml_cross_entropy_loss(c, x, y)),
                       ("backward", lambda c: lib.ggml_cross_entropy_loss_back(c, d, x, y))):
        ctx = ggml.Context(n_tensors=4, graph_size=16)
        graph = ggml.new_graph_for(ctx.ptr, make(ctx.ptr))
        rt.alloc_resident(graph)
        ctxs.append(ctx)
        ops[name] = graph
    times: dict[str, list[float]] = {name: [] for name in ops}
    for name, graph in ops.items():
        rt.compute_resident(graph)                  # warm-up: pages touched, threads started
    for _ in range(reps):
        for name, graph in ops.items():
            t0 = time.perf_counter()
            rt.compute_resident(graph)
            times[name].append((time.perf_counter() - t0) * 1e3)
    loss = float(ggml.to_numpy(lib.ggml_graph_node(ops["forward"], -1)).reshape(-1)[0])
    rt.close()
    for ctx in ctxs + [data]:
        ctx.close()
    return {"ms": times, "loss": loss, "variant": ggml.CPU_VARIANT.name}


def run_worker(variant: str, a) -> dict:
    env = {**os.environ}
    env.pop("PYTRAIN_CPU_VARIANT", None)
    if variant != "best":
        env["PYTRAIN_CPU_VARIANT"] = variant
    cmd = [sys.executable, "-m", "scripts.bench_cross_entropy", "--worker", "--vocab",
           str(a.vocab), "--rows", str(a.rows), "--threads", str(a.threads), "--reps", str(a.reps)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"worker for {variant} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default="best",
                    help="comma-separated ggml-cpu variant names or module paths")
    ap.add_argument("--out", type=Path, default=None, help="a markdown table (and .json beside it)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.vocab, a.rows, a.threads, a.reps)))
        return 0
    variants = a.variants.split(",")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    load_before = os.getloadavg()[0]
    for _ in range(a.rounds):
        for v in variants:
            runs[v].append(run_worker(v, a))
    rows = []
    for v in variants:
        row = {"variant": v, "loaded": runs[v][0]["variant"], "loss": runs[v][0]["loss"]}
        for op in ("forward", "backward"):
            ms = [t for r in runs[v] for t in r["ms"][op]]
            row[op] = {"median_ms": statistics.median(ms), "min_ms": min(ms), "n": len(ms)}
        rows.append(row)
    lines = [f"# CROSS_ENTROPY_LOSS at [{a.vocab}, {a.rows}], {a.threads} threads",
             "", f"`python -m scripts.bench_cross_entropy --vocab {a.vocab} --rows {a.rows} "
             f"--threads {a.threads} --rounds {a.rounds} --reps {a.reps}`; medians (min) over "
             f"{a.rounds} x {a.reps} computes per op, variants in alternating rounds.", "",
             f"CPU: {cpu_description()}; load average {load_before:.1f} before, "
             f"{os.getloadavg()[0]:.1f} after (other processes share the cores: compare rows "
             f"of one table, not tables).", "",
             "| ggml-cpu module | loaded | forward ms | backward ms | loss |", "|---|---|---|---|---|"]
    for r in rows:
        f, b = r["forward"], r["backward"]
        lines.append(f"| {r['variant']} | {r['loaded']} | {f['median_ms']:.2f} ({f['min_ms']:.2f}) "
                     f"| {b['median_ms']:.2f} ({b['min_ms']:.2f}) | {r['loss']:.6f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
        a.out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
