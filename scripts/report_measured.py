#!/usr/bin/env python3
"""Run test files and write the figures they compared with their bounds as a markdown table
(+ .json): the parity tables in bench_results/ are what the tests measured, not a second
computation that could drift from them.

The tests record each figure through the ``measured`` fixture (tests/conftest.py), which
writes them to ``PYTRAIN_MEASURED_JSON`` at the end of the session.  Nothing is written
unless every test passed.

Usage:  .venv/bin/python scripts/report_measured.py --title TITLE --out bench_results/X.md
            tests/test_A.py [tests/test_B.py ...]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, (int, float)) else str(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tests", nargs="+")
    ap.add_argument("--title", required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "measured.json"
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            *a.tests], cwd=ROOT, env={**os.environ,
                                                      "PYTRAIN_MEASURED_JSON": str(path)},
                           capture_output=True, text=True)
        summary = (r.stdout.strip().splitlines() or ["?"])[-1]
        if r.returncode != 0 or not path.exists():
            sys.stderr.write(r.stdout[-4000:] + r.stderr[-2000:])
            print(f"not written: the tests did not all pass ({summary})", file=sys.stderr)
            return 1
        rows = json.loads(path.read_text())["measured"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip() or "?"
    cmd = "python scripts/report_measured.py " + " ".join(
        [f"--title {json.dumps(a.title)}", f"--out {a.out.as_posix()}", *a.tests])
    lines = [f"# {a.title}", "",
             f"Made by `{cmd}` ({dt.datetime.now(dt.timezone.utc):%Y-%m-%d}, pytrain {commit}, "
             f"{cpu_name()}, {os.cpu_count()} CPUs): the figures the tests compared with their "
             f"bounds, recorded by the tests themselves; pytest: {summary}.", "",
             "| test | check | measured | bound |", "|---|---|---:|---|"]
    for m in rows:
        check = m["check"].replace("|", "\\|")          # a table cell
        lines.append(f"| `{m['test'].split('::', 1)[1]}` | {check} | {fmt(m['value'])} | "
                     f"{fmt(m['bound'])} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(lines) + "\n")
    a.out.with_suffix(".json").write_text(json.dumps(dict(command=cmd, commit=commit,
                                                          summary=summary, measured=rows),
                                                     indent=1) + "\n")
    print(f"wrote {a.out} ({len(rows)} figures; {summary})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
