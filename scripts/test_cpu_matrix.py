#!/usr/bin/env python3
"""Run the numerically sensitive tests under several CPU configurations on this one machine.

Why: CI runs on whichever CPU it gets (AMD Zen 4 / Zen 5, Intel with or without AMX), and each
sums float32 values in its own order.  A bound tuned on one machine breaks on the next, so the
tests that compare numbers are run here under every configuration a user's machine may give
them, in one go:

* the ggml-cpu variant: the best one for this CPU (what a user gets), ``haswell`` (AVX2, no
  AVX-512: the portable level of most x86-64 machines), and ``native`` (a ggml-cpu compiled
  with -march=native for this machine, built here once into the cache: what
  ``PYTRAIN_GGML_NATIVE=1`` installs);
* the BLAS backend on and off (``PYTRAIN_BLAS``): OpenBLAS's sgemm or ggml-cpu's kernels for
  the F32 matmuls;
* 1 and 2 threads (``PYTRAIN_THREADS`` overrides every runtime's count).

Every cell is a fresh pytest process; the summary (pass/fail per cell, the failures' names,
the CPU, the commit) is written as markdown.  ``make test-cpu-matrix`` runs it; it is not part
of the default test run (about 15-25 minutes on 2 cores).

Usage: python -m scripts.test_cpu_matrix [--out bench_results/cpu_matrix-amd.md]
                                        [--variants best,haswell,native] [--threads 1,2]
                                        [--blas 1,0] [-k EXPR]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from scripts import native_build  # native/build.py as a module

ROOT = Path(__file__).resolve().parent.parent

# the tests that compare numbers: parity with HF, PEFT, float64 and llama.cpp; padding,
# accumulation, recompute and resume equalities; the real model; the ops pytrain patches
SENSITIVE = [
    "tests/test_qwen35_parity.py", "tests/test_llama_parity.py", "tests/test_peft_parity.py",
    "tests/test_peft_adapter.py", "tests/test_masked_loss.py", "tests/test_recompute.py",
    "tests/test_train_cli.py", "tests/test_train_run.py", "tests/test_smollm2.py",
    "tests/test_llama_cpp_adapter.py", "tests/test_llama_weight_types.py", "tests/test_merge.py",
    "tests/test_masking_experiments.py", "tests/test_delta_net.py",
    "tests/test_attention_backward.py", "tests/test_cross_entropy_simd.py",
    "tests/test_blas_out_prod.py", "tests/test_out_prod_zero_rows.py",
    "tests/test_acc_in_place.py", "tests/test_optimizer.py", "tests/test_buffer_types.py",
    "tests/test_family_parity.py", "tests/test_gemma3_270m.py", "tests/test_distributed.py",
    "tests/test_compute_bf16.py", "tests/test_preference.py", "tests/test_preference_trl.py",
    "tests/test_lora_variants.py", "tests/test_best_checkpoint.py",
]


def native_module() -> Path:
    """A ggml-cpu compiled with -march=native for this machine, from the same source and
    patches (built once into the cache: ``PYTRAIN_GGML_NATIVE=1 native/build.py``)."""
    out = native_build.load().cache_dir() / "native-variant"
    env = {**os.environ, "PYTRAIN_GGML_NATIVE": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "native" / "build.py"), "--out", str(out)],
                       env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"building the native ggml-cpu failed:\n{r.stderr[-3000:]}")
    return out / "lib" / "libggml-cpu.so"


def cpu_description() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                  if ln.startswith("model name")), platform.processor() or "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                  if ln.startswith("flags")), [])
    family = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                   if ln.startswith("cpu family")), "?")
    shown = [f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "avx_vnni")]
    return f"{model} (family {family}, {os.cpu_count()} cores): {' '.join(shown)}"


def run_cell(variant: str, blas: str, threads: str, tests: list[str], k: str | None,
             xml: Path) -> dict:
    env = {**os.environ, "PYTRAIN_BLAS": blas, "PYTRAIN_THREADS": threads}
    env.pop("PYTRAIN_CPU_VARIANT", None)
    if variant != "best":
        env["PYTRAIN_CPU_VARIANT"] = variant
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
           *tests] + (["-k", k] if k else [])
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    took = time.monotonic() - t0
    loaded = subprocess.run([sys.executable, "-c", "from pytrain import ggml; "
                             "print(ggml.CPU_VARIANT.name)"], cwd=ROOT, env=env,
                            capture_output=True, text=True).stdout.strip()
    cell = {"variant": variant, "loaded": loaded or "?", "blas": blas, "threads": threads,
            "exit": r.returncode, "seconds": round(took), "passed": 0, "failed": [],
            "skipped": 0, "tail": r.stdout[-1500:] + r.stderr[-1500:]}
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
            if case.find("failure") is not None or case.find("error") is not None:
                cell["failed"].append(name)
            elif case.find("skipped") is not None:
                cell["skipped"] += 1
            else:
                cell["passed"] += 1
    return cell


def markdown(cells: list[dict], cpu: str, commit: str, cmd: str) -> str:
    lines = ["# Numerically sensitive tests under several CPU configurations",
             "",
             f"Made by `{cmd}` at commit {commit}, on {cpu}.",
             "",
             "Each row is a fresh pytest run of the sensitive test files "
             "(scripts/test_cpu_matrix.py lists them) with the ggml-cpu variant "
             "(`PYTRAIN_CPU_VARIANT`; `best` is the one pytrain picks for this CPU, `native` a "
             "-march=native build of the same source), the BLAS backend (`PYTRAIN_BLAS`) and "
             "the thread count (`PYTRAIN_THREADS`) shown.",
             "",
             "| variant (loaded) | BLAS | threads | passed | failed | skipped | exit | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c['variant']} ({c['loaded']}) | {'on' if c['blas'] == '1' else 'off'} "
                     f"| {c['threads']} | {c['passed']} | {len(c['failed'])} | {c['skipped']} "
                     f"| {c['exit']} | {c['seconds']} |")
    failed = [c for c in cells if c["failed"] or c["exit"] != 0]
    lines += ["", f"**{len(cells) - len(failed)} of {len(cells)} cells passed.**"]
    for c in failed:
        lines += ["", f"Failures with variant {c['variant']}, BLAS {c['blas']}, "
                      f"{c['threads']} threads:", ""]
        lines += [f"- `{n}`" for n in c["failed"]] or ["```", c["tail"], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="markdown summary (default: print)")
    ap.add_argument("--variants", default="best,haswell,native")
    ap.add_argument("--blas", default="1,0")
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("-k", default=None, help="pytest -k expression (a subset of the tests)")
    ap.add_argument("tests", nargs="*", default=SENSITIVE)
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    if "native" in variants:
        variants[variants.index("native")] = str(native_module())
    xml_dir = native_build.load().cache_dir() / "cpu-matrix"
    xml_dir.mkdir(parents=True, exist_ok=True)
    cells = []
    for variant, blas, threads in itertools.product(variants, a.blas.split(","),
                                                    a.threads.split(",")):
        xml = xml_dir / f"cell-{len(cells)}.xml"
        xml.unlink(missing_ok=True)
        cell = run_cell(variant, blas, threads, a.tests, a.k, xml)
        if os.sep in variant:
            cell["variant"] = "native"
        cells.append(cell)
        print(f"[matrix] {cell['variant']} ({cell['loaded']}) blas={blas} threads={threads}: "
              f"{cell['passed']} passed, {len(cell['failed'])} failed, exit {cell['exit']}, "
              f"{cell['seconds']} s", file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip() or "?"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    cmd = "python -m scripts.test_cpu_matrix" + "".join(
        f" --{k} {v}" for k, v, d in (("variants", a.variants, "best,haswell,native"),
                                      ("blas", a.blas, "1,0"), ("threads", a.threads, "2,1"))
        if v != d) + (f" --out {a.out}" if a.out else "")
    text = markdown(cells, cpu_description(), commit + (" (with uncommitted changes)" if dirty
                                                        else ""), cmd)
    if a.out:
        a.out.write_text(text)
        (a.out.with_suffix(".json")).write_text(json.dumps(cells, indent=1) + "\n")
    print(text)
    return 0 if all(not c["failed"] and c["exit"] == 0 for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
