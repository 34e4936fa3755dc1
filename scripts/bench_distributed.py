"""Benchmark: data-parallel training over MPI, 1 process against 2, one thread each.

The project's CPU benchmark shape ("mid": hidden 512, 8 layers, vocabulary 151936; the model
scripts/bench_common.py makes from a random HF checkpoint with the pinned converter, cached in
~/.cache/pytrain/bench), trained by `pytrain train` on the same global batch both ways:
1 process with grad_accum 2 against `mpiexec -n 2` with grad_accum 1 (2 micro-batches of
2 x 256 tokens per step, half of each row's labels masked, LoRA r 16 on the attention
q/k/v/o).  Tokens/s per step are rank 0's (every rank's step ends with the same all-reduce),
the median over the steps after the first two; all-reduce time is the part of a step spent
in its collectives (summing the loss, the token count and the LoRA gradients), which
includes waiting for the slower rank.

Usage: python -m scripts.bench_distributed [--steps 12] [--out bench_results/distributed.md]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from scripts import bench_common as bc
from scripts.test_cpu_matrix import cpu_description

MPIEXEC = Path(sys.executable).parent / "mpiexec"
T = 256


def bench_model(cache: Path, ref_python: str = "/opt/refenv/bin/python",
                shape: str = "mid") -> Path:
    d = bc.ensure_model(shape, cache, ref_python, "bench_train")
    if d is None:
        raise SystemExit(f"could not make the {shape} model "
                         f"(python -m scripts.bench_train --make {shape})")
    return d / json.loads((d / "done.json").read_text())["gguf"]


def write_data(folder: Path, gguf: Path, n: int) -> None:
    """``n`` prompt/completion records of T tokens (random ids of the model's vocabulary,
    decoded: half prompt, half completion)."""
    from pytrain.data.tokenizer import TOKEN_NORMAL, Tokenizer
    from pytrain.formats.gguf_meta import read_metadata
    tok = Tokenizer.from_metadata(read_metadata(gguf))
    rng = np.random.default_rng(0)
    normal = [i for i in range(tok.vocab_size) if tok.token_type(i) == TOKEN_NORMAL]
    recs = []
    for _ in range(n):
        ids = rng.choice(normal, T)
        recs.append({"prompt": tok.decode(ids[:T // 2].tolist()),
                     "completion": tok.decode(ids[T // 2:].tolist())})
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def run(folder: Path, gguf: Path, ranks: int, accum: int, steps: int) -> dict:
    out = folder / f"n{ranks}"
    (folder / f"n{ranks}.toml").write_text(
        f'[model]\npath = "{gguf}"\ndevice = "cpu"\nthreads = 1\n'
        f'[data]\ntrain = "train.jsonl"\nformat = "completion"\nmax_seq_len = {2 * T}\n'
        f'[lora]\nrank = 16\nalpha = 32.0\n'
        f'[train]\nmax_steps = {steps}\nbatch_size = 2\ngrad_accum = {accum}\nlr = 1e-4\n'
        f'eval_every = 0\nsave_every = 0\n[output]\ndir = "{out}"\n')
    cmd = ([str(MPIEXEC), "-n", str(ranks)] if ranks > 1 else []) + [
        sys.executable, "-m", "pytrain", "train", str(folder / f"n{ranks}.toml"), "--no-progress"]
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=folder, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    st = [x for x in recs if "loss" in x and x.get("split") != "valid"][2:]
    return {"ranks": ranks, "grad_accum": accum, "wall_s": time.monotonic() - t0,
            "tokens_per_step": st[0]["tokens"],
            "tokens_per_s": statistics.median(x["tokens_per_s"] for x in st),
            "allreduce_s": statistics.median(x.get("allreduce_s", 0.0) for x in st),
            "step_s": statistics.median(x["tokens"] / x["tokens_per_s"] for x in st),
            "losses": [x["loss"] for x in st]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pytrain" / "bench")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--shape", choices=["mid", "toy"], default="mid",
                    help="toy: the smoke test's model (tests/test_scripts_bench.py)")
    ap.add_argument("--ref-python", default="/opt/refenv/bin/python",
                    help="the reference interpreter that makes the model once")
    a = ap.parse_args(argv)
    gguf = bench_model(a.cache, a.ref_python, a.shape)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_data(folder, gguf, 4 * a.steps)
        one = run(folder, gguf, 1, 2, a.steps)
        two = run(folder, gguf, 2, 1, a.steps)
    speedup = two["tokens_per_s"] / one["tokens_per_s"]
    assert one["losses"] == two["losses"], "the two runs trained differently"
    lines = ["# Data-parallel training over MPI: 1 process against 2, one thread each", "",
             f"Made by `python -m scripts.bench_distributed` on {cpu_description()}; MPICH's "
             f"mpiexec from the `mpi` extra.  {a.shape.capitalize()} shape ({gguf.parent.name}), `pytrain train` "
             f"with batch 2 x {T} per micro-batch, 2 micro-batches per step both ways, half "
             f"of each row's labels masked, LoRA r 16 on q/k/v/o; the median over steps 3-"
             f"{a.steps} (the same losses both ways, checked).", "",
             "| processes x threads | grad_accum | tokens per step | step (s) | tokens/s | "
             "all-reduce per step (ms) |", "|---|---|---|---|---|---|"]
    for r in (one, two):
        lines.append(f"| {r['ranks']} x 1 | {r['grad_accum']} | {r['tokens_per_step']} | "
                     f"{r['step_s']:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{1000 * r['allreduce_s']:.2f} |")
    lines += ["", f"Speed-up with 2 processes: **{speedup:.2f}x**, scaling efficiency "
                  f"{100 * speedup / 2:.0f}%."]
    text = "\n".join(lines) + "\n"
    if a.out:
        a.out.write_text(text)
        a.out.with_suffix(".json").write_text(json.dumps({"one": one, "two": two,
                                                          "speedup": speedup}, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
