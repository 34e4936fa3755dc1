#!/usr/bin/env python3
"""A new user's first run, timed: clone the repository's HEAD into an empty folder, point
``PYTRAIN_CACHE`` (and Mesa's shader cache, where lavapipe keeps the Vulkan pipelines it
compiled) at an empty cache, run ``bash .ci/run`` (what CI runs: the README's test
command), then ``make demo``.  Writes ``bench_results/fresh_clone-<cpu>.md`` (one file per CPU
vendor, since CI runs on AMD and Intel machines) with the wall times, the test summary, the
libllama build time its stamp recorded and the demo's result.

Why: the README and docs/install.md quote these times, and every figure there must come
from a committed file.
The pip cache (~/.cache/pip) is not emptied: a fresh machine downloads the same wheels, which
this machine's registry mirror serves in seconds.

Usage:  python3 -m scripts.fresh_clone [--keep]     (about 27 minutes on 2 cores)
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cpu() -> tuple[str, str, list[str]]:
    text = Path("/proc/cpuinfo").read_text()
    model = re.search(r"model name\s*:\s*(.*)", text).group(1).strip()
    flags = set(re.search(r"flags\s*:\s*(.*)", text).group(1).split())
    shown = [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8") if f in flags]
    vendor = "intel" if "Intel" in model else "amd" if "AMD" in model else "other"
    return vendor, model, shown


def timed(cmd: list[str], cwd: Path, env: dict, log: Path) -> tuple[int, float, str]:
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    return rc, time.monotonic() - t0, log.read_text()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", action="store_true", help="keep the temporary clone and cache")
    a = ap.parse_args()
    commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                     text=True).strip()
    work = Path(tempfile.mkdtemp(prefix="pytrain-fresh-"))
    clone, cache = work / "pytrain", work / "cache"
    subprocess.check_call(["git", "clone", "-q", str(ROOT), str(clone)])
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PYTRAIN_CACHE"] = str(cache)
    # and an empty Mesa shader cache: lavapipe compiles every Vulkan pipeline on a new machine
    env["MESA_SHADER_CACHE_DIR"] = str(work / "mesa-shader-cache")
    print(f"clone {commit} in {clone}; running .ci/run", flush=True)
    ci_rc, ci_s, ci_log = timed(["bash", ".ci/run"], clone, env, work / "ci.log")
    summary = [ln for ln in ci_log.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    failed = [ln.strip() for ln in ci_log.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    if ci_rc != 0:                       # the clone is deleted below: show why here
        print(ci_log[-6000:], flush=True)
    demo_rc, demo_s, demo_log = (None, None, "")
    if ci_rc == 0:
        print("running make demo", flush=True)
        demo_rc, demo_s, demo_log = timed(["make", "demo"], clone, env, work / "demo.log")
    native = json.loads((clone / "pytrain" / "_native" / "build_info.json").read_text()) \
        if (clone / "pytrain" / "_native" / "build_info.json").exists() else {}
    llama = cache / "llama.cpp-build" / "build_info.json"
    llama = json.loads(llama.read_text()) if llama.exists() else {}
    vendor, model, flags = cpu()
    demo_lines = [ln for ln in demo_log.splitlines()
                  if re.search(r"validation|says|answer|accuracy", ln, re.I)][-12:]
    out = ROOT / "bench_results" / f"fresh_clone-{vendor}.md"
    lines = [
        f"# A fresh clone, as a new user runs it ({vendor.upper()})",
        "",
        f"Made by `python3 -m scripts.fresh_clone`: `git clone` of commit {commit} into an empty "
        f"folder, an empty `PYTRAIN_CACHE` and Mesa shader cache, no `.venv`; then "
        f"`bash .ci/run` and `make demo`.",
        "",
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- CPU: {model}, {os.cpu_count()} cores; flags: {' '.join(flags) or 'none of avx2/avx512/amx'}",
        f"- `bash .ci/run`: exit {ci_rc}, {ci_s:.0f} s wall",
        f"  - tests: {summary[-1].strip() if summary else 'no pytest summary line'}",
        *[f"    - `{ln}`" for ln in failed],
        f"  - of which llama.cpp's libllama build: {llama.get('libllama_seconds', '?')} s "
        f"(ggml {native.get('ggml_version', '?')}, options {' '.join(native.get('options', []))})",
    ]
    if demo_rc is not None:
        lines.append(f"- `make demo`: exit {demo_rc}, {demo_s:.0f} s wall")
        lines += [f"  - `{ln.strip()}`" for ln in demo_lines]
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"kept {work}")
    return 0 if ci_rc == 0 and demo_rc in (0, None) else 1


if __name__ == "__main__":
    sys.exit(main())
