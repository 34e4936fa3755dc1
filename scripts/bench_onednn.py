"""The matrix-product libraries pytrain can use, side by side at the training step's shapes:
the pinned oneDNN 3.2 (bf16 weights, patch 0018) against a newer oneDNN (the candidate), and
oneDNN's f32 matmul against the pinned OpenBLAS sgemm that ggml-blas runs for F32 weights.
This is how a change of pin, or a per-CPU choice of f32 library, is decided: by these rows on
the CPU at hand, not by release notes.

Each product is one call of ``scripts/matmul_probe.c`` (built here with the C compiler against
the pinned oneDNN headers; the C API is the same across oneDNN 3.x, so one binary runs either
library, the candidate found first on the loader's path).  Every library runs in its own
process, in turns (A B C ... then again), so other work on a shared machine slows all alike;
each row is the median over rounds of each process's median over ``--reps`` products after
two warm-up calls.

The candidate is PyPI's ``onednn`` wheel (pinned by version and sha256 below).  Intel builds
it for the SYCL runtime only: its CPU engine is a SYCL CPU device, so it needs the SYCL and
OpenCL CPU runtimes and Intel's compiler runtime (five more pinned wheels, ~450 MB, downloaded
once into the cache).  That cost is part of what this script measures a candidate against.

Shapes (M x N x K; ``fwd`` = a ggml weight in MUL_MAT, stored as N rows of K; ``bwd`` = the
same weight in the backward's OUT_PROD, grad_x = grad . W, stored as K rows of N):
  mid head fwd/bwd   256 x 151936 x 512     (the mid benchmark shape's tied LM head, 256 loss rows)
  mid ffn fwd        512 x 1536 x 512
  2b head fwd/bwd    256 x 248320 x 2048    (the 2b shape's)
  2b ffn fwd/bwd     512 x 6144 x 2048
  square             4096 x 4096 x 4096

Usage:
    python -m scripts.bench_onednn [--candidate|--no-candidate] [--threads 2] [--rounds 3]
        [--reps 5] [--shapes all|smoke] [--results bench_results] [--note TEXT]

``--shapes smoke --no-candidate --rounds 1`` is what tests/test_bench_onednn.py runs.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from scripts import bench_common as bc
from scripts import native_build

ROOT = Path(__file__).resolve().parent.parent
PROBE_SRC = ROOT / "scripts" / "matmul_probe.c"

# (project, version, wheel file, sha256): the candidate oneDNN, then its runtime
CANDIDATE = ("onednn", "2026.1.0", "onednn-2026.1.0-py2.py3-none-manylinux_2_28_x86_64.whl",
             "b04a8ffa6ebcd011f1091902d59d9707c2f620cce626fba2961520c671f3247f")
CANDIDATE_RUNTIME = [
    ("tbb", "2023.2.0", "tbb-2023.2.0-py2.py3-none-manylinux_2_28_x86_64.whl",
     "7d80615b6e970f11671fa05b6eaa9483ac864fbfe525ac280271a78b37870b7c"),
    ("umf", "1.2.0", "umf-1.2.0-py2.py3-none-manylinux_2_28_x86_64.whl",
     "238d186fdd9e9c0fe1489da95b19b0b79045fe26c4aa98bd0a022a2a3603c195"),
    ("intel-cmplr-lib-rt", "2026.2.0",
     "intel_cmplr_lib_rt-2026.2.0-py2.py3-none-manylinux_2_28_x86_64.whl",
     "9f713083073a820d2496a6da8e8d4f3482aba6640f74521d25ea48dcebe72748"),
    ("intel-sycl-rt", "2026.2.0", "intel_sycl_rt-2026.2.0-py2.py3-none-manylinux_2_28_x86_64.whl",
     "ad920da1ffcb43edbc03422a7c85094997e6d578f9ab534743442af70bcbfaa1"),
    ("intel-opencl-rt", "2026.2.0",
     "intel_opencl_rt-2026.2.0-py2.py3-none-manylinux_2_28_x86_64.whl",
     "6b6215a420598b4999ee01caca6d5cbe106aa4155c46c52377619c5aafce9f67"),
]

SHAPES = {
    "all": [("mid head fwd", 256, 151936, 512, 1), ("mid head bwd", 256, 512, 151936, 0),
            ("mid ffn fwd", 512, 1536, 512, 1),
            ("2b head fwd", 256, 248320, 2048, 1), ("2b head bwd", 256, 2048, 248320, 0),
            ("2b ffn fwd", 512, 6144, 2048, 1), ("2b ffn bwd", 512, 2048, 6144, 0),
            ("square", 4096, 4096, 4096, 1)],
    "smoke": [("small fwd", 64, 256, 128, 1), ("small bwd", 64, 128, 256, 0)],
}


def wheel_lib_dir(project: str, version: str, wheel: str, sha: str) -> Path:
    """The ``lib`` folder of a pinned wheel, fetched and unpacked once into the cache."""
    nb = native_build.load()
    path = nb.fetch_pinned(project, version, wheel, sha, source=False)
    root = nb._extract_wheel(path, nb.cache_dir() / f"{project}-{version}", sha)
    return root / f"{project.replace('-', '_')}-{version}.data" / "data" / "lib"


def build_probe() -> Path:
    """matmul_probe, compiled once per source and pinned oneDNN into the cache."""
    nb = native_build.load()
    lib, include = nb.onednn()
    out = nb.cache_dir() / "matmul_probe" / f"probe-{nb.sha256_of(PROBE_SRC)[:12]}"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        subprocess.run(["cc", "-O2", "-o", str(tmp), str(PROBE_SRC), f"-I{include}",
                        str(lib), f"-Wl,-rpath,{lib.parent}", "-ldl"], check=True)
        os.replace(tmp, out)
    return out


def sides(candidate: bool) -> dict[str, tuple[str, dict]]:
    """name -> (the probe's library argument, extra environment)."""
    nb = native_build.load()
    openblas, _ = nb.openblas()
    out = {"onednn-pinned": ("onednn", {}), "openblas": (f"openblas:{openblas}", {})}
    if candidate:
        dirs = [wheel_lib_dir(*CANDIDATE)] + [wheel_lib_dir(*w) for w in CANDIDATE_RUNTIME]
        env = {"LD_LIBRARY_PATH": ":".join(str(d) for d in dirs),
               # the SYCL runtime's CPU device is Intel's OpenCL CPU runtime
               "OCL_ICD_FILENAMES": str(dirs[-1] / "libintelocl.so")}
        out["onednn-candidate"] = ("onednn", env)
    return out


def probe(exe: Path, lib: str, env: dict, threads: int, dtype: str, shape, reps: int) -> dict:
    _, m, n, k, transb = shape
    e = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads), **env)
    r = subprocess.run([str(exe), lib, dtype, str(m), str(n), str(k), str(transb), str(reps)],
                       capture_output=True, text=True, env=e, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]}
    return json.loads(lines[-1])


def has_bf16(exe: Path) -> bool:
    """Whether the pinned oneDNN has a bf16 matmul on this CPU (3.2 has none on an AVX2-only
    one): without it the bf16 rows are left out, not reported as errors."""
    return "error" not in probe(exe, "onednn", {}, 1, "bf16", ("probe", 16, 16, 16, 1), 1)


def measure(exe: Path, libs: dict, threads: int, shapes, rounds: int, reps: int,
            types: tuple[str, ...] = ("bf16", "f32")) -> list[dict]:
    """One row per (shape, type, library): medians over rounds, libraries in turns."""
    runs = [(s, t, name) for s in shapes for t in types for name in libs
            if not (t == "bf16" and name == "openblas")]
    got: dict[tuple, list[dict]] = {}
    for _ in range(rounds):
        for s, t, name in runs:
            lib, env = libs[name]
            got.setdefault((s[0], t, name), []).append(probe(exe, lib, env, threads, t, s, reps))
    rows = []
    for (shape, t, name), rs in got.items():
        ok = [r for r in rs if "error" not in r]
        row = {"shape": shape, "type": t, "side": name, "threads": threads}
        if not ok:
            row["error"] = rs[0]["error"]
        else:
            med = statistics.median(r["median_s"] for r in ok)
            s = next(x for x in shapes if x[0] == shape)
            row.update(library=ok[0]["library"], impl=ok[0]["impl"], median_s=med,
                       gflops=2.0 * s[1] * s[2] * s[3] / med * 1e-9,
                       M=s[1], N=s[2], K=s[3], transb=s[4], c00=ok[0]["c00"], rounds=len(ok))
        rows.append(row)
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Per shape and type: candidate / pinned oneDNN, and oneDNN f32 / OpenBLAS (time ratios
    below 1 mean the first is faster)."""
    by = {(r["shape"], r["type"], r["side"]): r for r in rows if "median_s" in r}
    out = []
    for (shape, t, side), r in by.items():
        if side != "onednn-pinned":
            continue
        c = by.get((shape, t, "onednn-candidate"))
        o = by.get((shape, t, "openblas"))
        out.append({"shape": shape, "type": t,
                    "candidate_over_pinned": c["median_s"] / r["median_s"] if c else None,
                    "onednn_over_openblas": r["median_s"] / o["median_s"] if o else None})
    return out


def markdown(res: dict) -> str:
    m = res["machine"]
    out = ["# Matrix-product libraries at the training step's shapes (CPU)", "",
           f"Made by `{res['command']}` (see its docstring). Time per product: median over "
           f"rounds of each process's median of {res['reps']} products after two warm-up "
           f"calls; the libraries ran in turns, each in its own process.", "",
           f"- date: {res['date']}; pytrain commit {m['commit']}",
           f"- CPU: {m['cpu']}; bf16 units: {', '.join(res['bf16_units']) or 'none'}; "
           f"threads {res['threads']}",
           f"- load average at start / end: {res['load_start']} / {res['load_end']}",
           f"- pinned: oneDNN {res['pinned']}; OpenBLAS: the pinned scipy-openblas32 "
           f"(`cblas_sgemm`); candidate: {res['candidate'] or 'not run'}"]
    if res.get("note"):
        out += ["", res["note"]]
    out += ["", "| shape | M x N x K | type | library | kernel | ms | GFLOP/s |",
            "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if "error" in r:
            out.append(f"| {r['shape']} | | {r['type']} | {r['side']} | error: {r['error']} | | |")
            continue
        out.append(f"| {r['shape']} | {r['M']} x {r['N']} x {r['K']} | {r['type']} | "
                   f"{r['library']} | {r['impl']} | {r['median_s'] * 1e3:.2f} | "
                   f"{r['gflops']:.1f} |")
    out += ["", "| shape | type | candidate / pinned oneDNN (time) | pinned oneDNN / OpenBLAS "
            "(time) |", "|---|---|---|---|"]
    for q in res["ratios"]:
        c, o = q["candidate_over_pinned"], q["onednn_over_openblas"]
        out.append(f"| {q['shape']} | {q['type']} | {'-' if c is None else f'**{c:.2f}**'} | "
                   f"{'-' if o is None else f'**{o:.2f}**'} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--candidate", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="all")
    ap.add_argument("--results", type=Path, default=ROOT / "bench_results")
    ap.add_argument("--note", default="")
    a = ap.parse_args(argv)
    from pytrain.models.precision import cpu_bf16_units
    exe = build_probe()
    libs = sides(a.candidate)
    load0 = os.getloadavg()
    bf16 = has_bf16(exe)
    rows = measure(exe, libs, a.threads, SHAPES[a.shapes], a.rounds, a.reps,
                   ("bf16", "f32") if bf16 else ("f32",))
    nb = native_build.load()
    res = {"command": bc.command_line("bench_onednn", argv),
           "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": bc.machine_facts(), "bf16_units": cpu_bf16_units(),
           "bf16_matmul": bf16,
           "threads": a.threads, "reps": a.reps, "shapes": a.shapes,
           "pinned": nb.ONEDNN_VERSION + " (oneDNN 3.2)",
           "candidate": f"{CANDIDATE[0]}=={CANDIDATE[1]}" if a.candidate else None,
           "load_start": ", ".join(f"{x:.2f}" for x in load0),
           "load_end": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
           "note": a.note, "rows": rows, "ratios": ratios(rows)}
    a.results.mkdir(parents=True, exist_ok=True)
    (a.results / "onednn.json").write_text(json.dumps(res, indent=1) + "\n")
    (a.results / "onednn.md").write_text(markdown(res))
    print(markdown(res))
    return 0 if all("median_s" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
