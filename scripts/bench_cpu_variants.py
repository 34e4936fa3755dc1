"""Benchmark: training steps of one build under each ggml-cpu variant, side by side.

Why: pytrain ships ggml-cpu for every x86-64 level and loads the best one the CPU runs (as
llama.cpp's portable releases do); a ``-march=native`` build (``PYTRAIN_GGML_NATIVE=1``) is
kept only if it is measurably faster.  This measures that, and what the portable AVX2 level
costs on an AVX-512 machine, on the project's CPU benchmark shape ("mid": hidden 512, 8
layers with attention at 3 and 7, 8/2 heads x 64, FFN 1536, DeltaNet 4/4 heads x 64, vocabulary
151936, tied; random weights written by scripts/gguf_models.py), batch 2 x 256 with half of
each row's labels masked, LoRA r 16 on the attention q/k/v/o.

Each (weights, BLAS) setting is timed under every variant by ``python -m scripts.bench_train``'s own
pytrain worker (warm-up steps, then timed steps counted only while the rest of the machine is
quiet), in rounds that alternate the variants so that drift on a shared machine spreads over
all of them.  F32 weights with BLAS on is the default configuration (OpenBLAS, which picks its
own kernels at run time, takes the matmuls; ggml-cpu the rest); F16 weights with BLAS off puts
every matmul on ggml-cpu, where the variant matters most.

Usage: python -m scripts.bench_cpu_variants [--variants best,native,haswell] [--rounds 2]
                                           [--out bench_results/cpu_variants.md]
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

import numpy as np

from scripts import bench_common as bc, native_build
from scripts.bench_common import REPO as ROOT
from scripts.test_cpu_matrix import cpu_description, native_module

MID = dict(n_layer=8, n_embd=512, n_ff=1536, n_head=8, n_head_kv=2, head_dim=64, n_vocab=151936,
           ssm_state=64, ssm_k_heads=4, ssm_v_heads=4, ssm_v_dim=64, full_attention_interval=4)
# --shape toy: the smallest model of the same layout, for the smoke test (tests/test_scripts_bench.py)
TOY = dict(n_layer=4, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, head_dim=16, n_vocab=512,
           ssm_state=16, ssm_k_heads=2, ssm_v_heads=4, ssm_v_dim=16, full_attention_interval=2)
SHAPES = {"mid": MID, "toy": TOY}
BATCH = (2, 256)
SETTINGS = [("f32", "1"), ("f16", "0")]      # (weights, PYTRAIN_BLAS)


def _values(name: str, shape: tuple, rng):
    """Random values a trained model's would resemble: a decaying DeltaNet state (ssm_a < 0),
    norms near 1, matrices scaled by their fan-in."""
    if name.endswith("ssm_a"):
        return -np.exp(rng.normal(0.0, 0.5, shape))
    if len(shape) == 1:
        return 1.0 + 0.1 * rng.standard_normal(shape)
    return rng.standard_normal(shape) / np.sqrt(shape[-1])


def random_model(dtype: str, shape: str = "mid") -> Path:
    from scripts.gguf_models import write_qwen35
    out = native_build.load().cache_dir() / "bench" / f"{shape}-random-{dtype}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        write_qwen35(tmp, dtype, seed=0, values_fn=_values, **SHAPES[shape])
        os.replace(tmp, out)
    return out


def time_steps(gguf: Path, variant: str, blas: str, threads: int, steps: int,
               vocab: int = MID["n_vocab"]) -> dict:
    env = {**os.environ, "PYTRAIN_BLAS": blas}
    env.pop("PYTRAIN_CPU_VARIANT", None)
    if variant != "best":
        env["PYTRAIN_CPU_VARIANT"] = variant
    cmd = [sys.executable, "-m", "scripts.bench_train", "--worker", "pytrain",
           "--threads", str(threads), "--runs", str(steps), "--warmup", "2",
           "--batch", str(BATCH[0]), str(BATCH[1]), "--vocab", str(vocab),
           "--recompute", "auto", "--gguf", str(gguf)]
    res, r = bc.run_result(cmd, env)
    if res is not None:
        return res
    raise SystemExit(f"worker failed ({variant}, {gguf.name}):\n{r.stdout[-2000:]}{r.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="best,native,haswell")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="clean timed steps per worker")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mid")
    a = ap.parse_args(argv)
    names = a.variants.split(",")
    paths = {n: (str(native_module()) if n == "native" else n) for n in names}
    t0 = time.monotonic()
    rows = []
    for dtype, blas in SETTINGS:
        gguf = random_model(dtype, a.shape)
        got: dict[str, list[float]] = {n: [] for n in names}
        loaded: dict[str, str] = {}
        for _ in range(a.rounds):
            for n in names:
                res = time_steps(gguf, paths[n], blas, a.threads, a.steps,
                                 SHAPES[a.shape]["n_vocab"])
                got[n].append(res["median_s"])
                print(f"[{dtype} blas={blas}] {n}: {res['median_s']:.3f} s/step "
                      f"({res['n_clean']} clean of {len(res['times'])})", file=sys.stderr, flush=True)
        for n in names:
            loaded[n] = subprocess.run(
                [sys.executable, "-c", "from pytrain import ggml; print(ggml.CPU_VARIANT.name)"],
                cwd=ROOT, capture_output=True, text=True,
                env={**os.environ, **({"PYTRAIN_CPU_VARIANT": paths[n]} if n != "best" else {})},
            ).stdout.strip()
        rows.append(dict(dtype=dtype, blas=blas, seconds={n: statistics.median(v) for n, v in got.items()},
                         all=got, loaded=loaded))
    base = names[0]
    lines = ["# ggml-cpu variants: training step time, one build",
             "",
             f"Made by `python -m scripts.bench_cpu_variants"
             f"{' --out ' + str(a.out) if a.out else ''}` on {cpu_description()}, "
             f"{a.threads} threads, {a.rounds} rounds of {a.steps} clean timed steps per "
             f"variant ({time.monotonic() - t0:.0f} s in all).",
             "",
             f"{a.shape.capitalize()} shape (random weights), batch {BATCH[0]} x {BATCH[1]}, half of each row's "
             f"labels masked, LoRA r 16 on attention q/k/v/o.  Median step seconds over the "
             f"rounds; the ratio is tokens/s against `{base}`.",
             "",
             "| weights | BLAS | " + " | ".join(f"{n} (loads {rows[0]['loaded'][n]})" for n in names) + " |",
             "|---|---|" + "---|" * len(names)]
    for r in rows:
        cells = [f"{r['seconds'][n]:.3f} s ({r['seconds'][base] / r['seconds'][n]:.3f}x)" for n in names]
        lines.append(f"| {r['dtype'].upper()} | {'on' if r['blas'] == '1' else 'off'} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Every round's median step seconds:", ""]
    for r in rows:
        lines.append(f"- {r['dtype'].upper()}, BLAS {'on' if r['blas'] == '1' else 'off'}: "
                     + "; ".join(f"{n} " + ", ".join(f"{s:.3f}" for s in r["all"][n]) for n in names))
    text = "\n".join(lines) + "\n"
    if a.out:
        a.out.write_text(text)
        a.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
