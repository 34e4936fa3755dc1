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

The references have the same problem: the committed goldens hold the float32 rounding of
torch (MKL's sgemm, oneDNN, ATen's vectorised loops) on the CPU that made them.  The reference
cells (``--ref``; scripts/cpu_matrix_reference.py says how) set library switches that make
torch take another kernel path on this machine (``MKL_CBWR``, ``MKL_ENABLE_INSTRUCTIONS``,
``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``) and each runs (a) the golden-reproduction tests
against the committed goldens and (b) the parity tests against the goldens regenerated under
that setting in a copy of the checkout.  Each row names the reference kernels that ran, as MKL
and oneDNN report them (scripts/reference_kernels.py), and pytrain's ggml-cpu variant and BLAS.

* ``--ref auto`` (the default): ``plain`` (no switch: the reference as this machine runs it)
  and every candidate switch that changes torch's float32 bits here (the others are listed as
  probed and dropped: on an AMD CPU MKL ignores its ISA switches);
* ``--ref plain,MKL_CBWR=COMPATIBLE,ONEDNN_MAX_CPU_ISA=AVX2+ATEN_CPU_CAPABILITY=avx2``: these
  cells (variables of one cell joined by ``+``); ``--ref none``: no reference cell;
* ``--ref-goldens pref_golden,peft_golden``: regenerate only these goldens (default: all the
  parity tests read; the names are cpu_matrix_reference.GOLDENS');
* ``--variants none``: no pytrain-side cell (the reference cells alone).

Every cell is a fresh pytest process; the summary (pass/fail per cell, the failures' names,
the CPU, the commit) is written as markdown, and every cell as JSON beside it.
``make test-cpu-matrix`` runs it (it needs the reference interpreter, ``make refenv``); it is
not part of the default test run (about an hour on 2 cores for the pytrain side, 4-7 minutes
per reference cell).

Usage: python -m scripts.test_cpu_matrix [--out bench_results/cpu_matrix-amd.md]
                                        [--variants best,haswell,native|none] [--threads 1,2]
                                        [--blas 1,0] [--ref auto|none|SETTING,...]
                                        [--ref-goldens NAME,...] [-k EXPR]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from scripts import cpu_matrix_reference as ref
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
    "tests/test_cross_entropy_op.py", "tests/test_compute_bf16_quantized.py",
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
    cell = {"kind": "pytrain", "variant": variant, "loaded": loaded or "?", "blas": blas,
            "threads": threads, "exit": r.returncode, "seconds": round(took),
            "tail": r.stdout[-1500:] + r.stderr[-1500:], **junit_results(xml)}
    return cell


def junit_results(xml: Path) -> dict:
    """passed, failed (the names), skipped of a pytest run's JUnit XML, and each failure's
    message (its first line: the assertion that failed)."""
    out: dict = {"passed": 0, "failed": [], "skipped": 0, "messages": {}}
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
            bad = case.find("failure") if case.find("failure") is not None else \
                case.find("error")
            if bad is not None:
                out["failed"].append(name)
                out["messages"][name] = (bad.get("message") or "").strip().split("\n")[0][:300]
            elif case.find("skipped") is not None:
                out["skipped"] += 1
            else:
                out["passed"] += 1
    return out


def pytest_run(tests: list[str], cwd: Path, env: dict, k: str | None, xml: Path) -> dict:
    xml.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
           *tests] + (["-k", k] if k else [])
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    # exit 5: -k selected none of these tests, which is no failure
    return {"exit": 0 if r.returncode == 5 else r.returncode,
            "tail": r.stdout[-1500:] + r.stderr[-1500:], **junit_results(xml)}


def pytrain_side(env: dict, cwd: Path) -> str:
    """The ggml-cpu variant pytrain loads and whether ggml's BLAS backend is on, in ``env``."""
    r = subprocess.run([sys.executable, "-c", "from pytrain import ggml; "
                        "from pytrain.ggml.backends import blas_enabled; "
                        "print(ggml.CPU_VARIANT.name, 'on' if blas_enabled() else 'off')"],
                       cwd=cwd, env=env, capture_output=True, text=True)
    variant, _, blas = (r.stdout.strip() or "? ?").partition(" ")
    return f"{variant}, BLAS {blas}"


def run_ref_cell(spec: str, ref_python: str, plain: dict, k: str | None, goldens: list[str],
                 work: Path) -> dict:
    """One reference cell (module docstring): the kernels the setting gives, (a) the
    reproduction tests here, (b) the goldens regenerated in a copy and the parity tests there."""
    t0 = time.monotonic()
    setting = ref.parse_setting(spec)
    env = ref.cell_env(setting, ref_python)
    rec = ref.probe(ref_python, setting) if setting else plain
    work.mkdir(parents=True, exist_ok=True)
    repro = pytest_run(ref.REPRODUCTION, ROOT, env, k, work / "reproduction.xml")
    tree = ref.copy_checkout(work / "checkout")
    gen = ref.regenerate(tree, goldens, env, ref_python, work)
    tree_env = {**env, "PYTHONPATH": str(tree)}
    parity = pytest_run(ref.PARITY, tree, tree_env, k, work / "parity.xml")
    failed = ([f"generator {n} exited {g['exit']}" for n, g in gen["generators"].items()
               if g["exit"]] + [f"(a) {n}" for n in repro["failed"]]
              + [f"(b) {n}" for n in parity["failed"]])
    exit_code = max([repro["exit"], parity["exit"]] + [g["exit"] for g in
                                                       gen["generators"].values()])
    tails = [g["tail"] for g in gen["generators"].values() if g["tail"]]
    tails += [t["tail"] for t in (repro, parity) if t["exit"] and not t["failed"]]
    messages = {f"({x}) {n}": m for x, t in (("a", repro), ("b", parity))
                for n, m in t["messages"].items()}
    return {"kind": "reference", "setting": spec, "kernels": rec["kernels"],
            "changes": ref.changes(rec, plain), "rng_changed": rec["rng"] != plain["rng"],
            "pytrain": pytrain_side(tree_env, tree), "reproduction": counts(repro),
            "parity": counts(parity), **gen, "failed": failed, "messages": messages,
            "exit": exit_code,
            "seconds": round(time.monotonic() - t0), "tail": "\n".join(tails)[-3000:]}


def counts(run: dict) -> dict:
    return {k: v for k, v in run.items() if k not in ("tail", "messages")}


def markdown(cells: list[dict], cpu: str, commit: str, cmd: str) -> str:
    ours = [c for c in cells if c["kind"] == "pytrain"]
    refs = [c for c in cells if c["kind"] == "reference"]
    lines = ["# Numerically sensitive tests under several CPU configurations",
             "",
             f"Made by `{cmd}` at commit {commit}, on {cpu}.",
             ""]
    if ours:
        lines += pytrain_markdown(ours)
    if refs or any(c["kind"] == "probed" for c in cells):
        lines += reference_markdown(cells)
    done = ours + refs
    failed = [c for c in done if c["failed"] or c["exit"] != 0]
    lines += ["", f"**{len(done) - len(failed)} of {len(done)} cells passed.**"]
    return "\n".join(lines) + "\n"


def pytrain_markdown(cells: list[dict]) -> list[str]:
    lines = ["Each row is a fresh pytest run of the sensitive test files "
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
    for c in cells:
        if c["failed"] or c["exit"] != 0:
            lines += ["", f"Failures with variant {c['variant']}, BLAS {c['blas']}, "
                          f"{c['threads']} threads:", ""]
            lines += [f"- `{n}`" for n in c["failed"]] or ["```", c["tail"], "```"]
    return lines


def reference_markdown(cells: list[dict]) -> list[str]:
    refs = [c for c in cells if c["kind"] == "reference"]
    probed = [c for c in cells if c["kind"] == "probed"]
    lines = ["## The reference side",
             "",
             "Each row regenerates the goldens with torch on the kernel path the setting "
             "selects (`plain`: none set) and runs (a) the golden-reproduction tests "
             f"({', '.join(ref.REPRODUCTION)}) against the committed goldens and (b) the parity "
             "tests against the goldens regenerated under that setting, in a copy of the "
             "checkout (scripts/cpu_matrix_reference.py). *Changed ops*: of the operations "
             "scripts/reference_kernels.py probes, those whose float32 bits differ from the "
             "plain run's; the kernels are as MKL (`MKL_VERBOSE`), oneDNN (`ONEDNN_VERBOSE`) "
             "and torch report them. *Goldens differing*: of the goldens regenerated, those "
             "not bit-equal to the committed file (made on another machine, or on other "
             "kernels: a golden a cell reproduces bit for bit was made on that cell's "
             "kernels).",
             ""]
    if probed:
        lines += ["Settings probed (`--ref auto`):", "",
                  "| setting | float32 ops changed | cell |", "|---|---|---|"]
        for c in probed:
            lines.append(f"| `{c['setting']}` | {', '.join(c['changes']) or 'none'} | "
                         f"{c['dropped'] or 'yes'} |")
        lines.append("")
    lines += ["| setting | reference kernels | pytrain | changed ops | goldens differing | "
              "(a) reproduction passed/failed/skipped | (b) parity passed/failed/skipped | "
              "exit | seconds |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in refs:
        diff = [f for f, d in c["goldens"].items() if not d.startswith("0 of")]
        a, b = c["reproduction"], c["parity"]
        lines.append(f"| `{c['setting']}` | {ref.kernels_text(c['kernels'])} | {c['pytrain']} "
                     f"| {len(c['changes'])} | {len(diff)} of {len(c['goldens'])} "
                     f"| {a['passed']}/{len(a['failed'])}/{a['skipped']} "
                     f"| {b['passed']}/{len(b['failed'])}/{b['skipped']} | {c['exit']} "
                     f"| {c['seconds']} |")
    for c in refs:
        lines += ["", f"### `{c['setting']}`", ""]
        if c["changes"]:
            lines.append(f"- float32 ops changed: {', '.join(c['changes'])}")
        if c["rng_changed"]:
            lines.append("- torch's seeded draws changed: the generators build other models")
        if c["goldens"]:
            lines.append("- arrays differing from the committed golden: " + "; ".join(
                f"{f} {d}" for f, d in c["goldens"].items()))
        lines.append("- generators (seconds): " + ", ".join(
            f"{n} {g['seconds']}" + (f" (exit {g['exit']})" if g["exit"] else "")
            for n, g in c["generators"].items()))
        for f, why in c["not_reproduced"].items():
            lines.append(f"- not reproduced byte for byte, the committed file kept: {f} ({why})")
        lines += [f"- failed: `{n}`" + (f": `{c['messages'][n]}`" if c["messages"].get(n)
                                        else "") for n in c["failed"]]
        if c["tail"]:               # a generator that failed, a pytest run that named no test
            lines += ["", "```", c["tail"], "```"]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="markdown summary (default: print)")
    ap.add_argument("--variants", default="best,haswell,native", help="or none")
    ap.add_argument("--blas", default="1,0")
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--ref", default="auto", help="reference cells: auto, none, or settings")
    ap.add_argument("--ref-goldens", default=",".join(ref.GOLDENS),
                    help="the goldens the reference cells regenerate")
    ap.add_argument("-k", default=None, help="pytest -k expression (a subset of the tests)")
    ap.add_argument("tests", nargs="*", default=SENSITIVE)
    a = ap.parse_args(argv)
    goldens = [g for g in a.ref_goldens.split(",") if g]
    if set(goldens) - set(ref.GOLDENS):
        ap.error(f"--ref-goldens: unknown {sorted(set(goldens) - set(ref.GOLDENS))}; "
                 f"known {', '.join(ref.GOLDENS)}")
    try:
        specs = [] if a.ref == "none" else [x for x in a.ref.split(",") if x]
        for x in specs:
            if x != "auto":
                ref.parse_setting(x)
    except ValueError as e:
        ap.error(str(e))
    # the commit under test is the one the cells start from
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip() or "?"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    work = native_build.load().cache_dir() / "cpu-matrix"
    work.mkdir(parents=True, exist_ok=True)
    cells = [] if a.variants == "none" else pytrain_cells(a, work)
    if specs:
        cells += reference_cells(specs, a.k, goldens, work)
    cmd = "python -m scripts.test_cpu_matrix" + "".join(
        f" --{k} {shlex.quote(v)}" for k, v, d in (
            ("variants", a.variants, "best,haswell,native"), ("blas", a.blas, "1,0"),
            ("threads", a.threads, "2,1"), ("ref", a.ref, "auto"),
            ("ref-goldens", a.ref_goldens, ",".join(ref.GOLDENS))) if v != d) + (
        f" -k {shlex.quote(a.k)}" if a.k else "") + (f" --out {a.out}" if a.out else "")
    text = markdown(cells, cpu_description(), commit + (" (with uncommitted changes)" if dirty
                                                        else ""), cmd)
    if a.out:
        a.out.write_text(text)
        (a.out.with_suffix(".json")).write_text(json.dumps(cells, indent=1) + "\n")
    print(text)
    return 0 if all(not c["failed"] and c["exit"] == 0 for c in cells
                    if c["kind"] != "probed") else 1


def pytrain_cells(a: argparse.Namespace, work: Path) -> list[dict]:
    variants = a.variants.split(",")
    if "native" in variants:
        variants[variants.index("native")] = str(native_module())
    cells = []
    for variant, blas, threads in itertools.product(variants, a.blas.split(","),
                                                    a.threads.split(",")):
        cell = run_cell(variant, blas, threads, a.tests, a.k, work / f"cell-{len(cells)}.xml")
        if os.sep in variant:
            cell["variant"] = "native"
        cells.append(cell)
        print(f"[matrix] {cell['variant']} ({cell['loaded']}) blas={blas} threads={threads}: "
              f"{cell['passed']} passed, {len(cell['failed'])} failed, exit {cell['exit']}, "
              f"{cell['seconds']} s", file=sys.stderr, flush=True)
    return cells


def reference_cells(specs: list[str], k: str | None, goldens: list[str],
                    work: Path) -> list[dict]:
    """The probe records (for ``auto``) and the reference cells, in the order asked."""
    from tests import reference_env
    ref_python = reference_env.find()
    if ref_python is None:
        raise SystemExit("the reference cells need the reference interpreter (torch, "
                         "transformers, PEFT, TRL): `make refenv` creates .refenv/, or "
                         "PYTRAIN_REF_PYTHON names one; --ref none runs without them")
    ref_python = str(ref_python.absolute())
    plain = ref.probe(ref_python, {})
    cells: list[dict] = []
    run: list[str] = []
    for x in specs:
        if x == "auto":
            kept, probed = ref.choose(ref_python, plain)
            cells += probed
            run += ["plain"] + kept
        else:
            run.append(x)
    for spec in dict.fromkeys(run):
        cell = run_ref_cell(spec, ref_python, plain, k, goldens, work / f"ref-{len(cells)}")
        cells.append(cell)
        print(f"[matrix] reference {spec}: (a) {cell['reproduction']['passed']} passed, "
              f"(b) {cell['parity']['passed']} passed, {len(cell['failed'])} failed, "
              f"exit {cell['exit']}, {cell['seconds']} s", file=sys.stderr, flush=True)
    return cells


if __name__ == "__main__":
    sys.exit(main())
