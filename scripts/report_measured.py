"""Run test files and write the figures they compared with their bounds as a markdown table
(+ .json): the parity tables in bench_results/ are what the tests measured, not a second
computation that could drift from them.

The tests record each figure through the ``measured`` fixture (tests/conftest.py), which
writes them to ``PYTRAIN_MEASURED_JSON`` at the end of the session.  Nothing is written
unless every test passed.  scripts/report_parity.py is this report over fixed test files, one
section per file, introduced by the first paragraph of the file's docstring.

Usage:  python -m scripts.report_measured --title TITLE --out bench_results/X.md
            tests/test_A.py [tests/test_B.py ...]
"""
from __future__ import annotations

import argparse
import ast
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.bench_common import REPO as ROOT, git_commit


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, (int, float)) else str(v)


def run_tests(tests: list[str], extra: list[str] = ()) -> tuple[list[dict] | None, str]:
    """(the figures the tests recorded, pytest's summary line); None when not all passed."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "measured.json"
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            *extra, *tests], cwd=ROOT,
                           env={**os.environ, "PYTRAIN_MEASURED_JSON": str(path)},
                           capture_output=True, text=True)
        summary = (r.stdout.strip().splitlines() or ["?"])[-1]
        if r.returncode != 0 or not path.exists():
            sys.stderr.write(r.stdout[-4000:] + r.stderr[-2000:])
            print(f"not written: the tests did not all pass ({summary})", file=sys.stderr)
            return None, summary
        return json.loads(path.read_text())["measured"], summary


def table(rows: list[dict]) -> list[str]:
    lines = ["| test | check | measured | bound |", "|---|---|---:|---|"]
    for m in rows:
        check = m["check"].replace("|", "\\|")          # a table cell
        lines.append(f"| `{m['test'].split('::', 1)[1]}` | {check} | {fmt(m['value'])} | "
                     f"{fmt(m['bound'])} |")
    return lines


def what_it_compares(test_file: str) -> str:
    """The first paragraph of a test file's docstring, on one line."""
    doc = ast.get_docstring(ast.parse((ROOT / test_file).read_text(encoding="utf-8"))) or ""
    return " ".join(doc.split("\n\n")[0].split())


def report(title: str, out: Path, tests: list[str], cmd: str, sections: bool = False,
           intro: str = "", extra: list[str] = ()) -> int:
    """Run ``tests``, then write ``out`` (+ .json): one table, or with ``sections`` one section
    per test file, introduced by what its docstring says it compares."""
    rows, summary = run_tests(tests, extra)
    if rows is None:
        return 1
    commit = git_commit()
    lines = [f"# {title}", "",
             f"Made by `{cmd}` ({dt.datetime.now(dt.timezone.utc):%Y-%m-%d}, pytrain {commit}, "
             f"{cpu_name()}, {os.cpu_count()} CPUs): the figures the tests compared with their "
             f"bounds, recorded by the tests themselves; pytest: {summary}." + intro, ""]
    if sections:
        for f in tests:
            mine = [m for m in rows if m["test"].split("::", 1)[0] == f]
            lines += [f"## {f}", "", what_it_compares(f), ""] + (table(mine) if mine else
                                                   ["(nothing recorded: skipped)"]) + [""]
    else:
        lines += table(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines).rstrip("\n") + "\n")
    out.with_suffix(".json").write_text(json.dumps(dict(command=cmd, commit=commit,
                                                        summary=summary, measured=rows),
                                                   indent=1) + "\n")
    print(f"wrote {out} ({len(rows)} figures; {summary})")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tests", nargs="+")
    ap.add_argument("--title", required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    cmd = "python -m scripts.report_measured " + " ".join(
        [f"--title {json.dumps(a.title)}", f"--out {a.out.as_posix()}", *a.tests])
    return report(a.title, a.out, a.tests, cmd)


if __name__ == "__main__":
    sys.exit(main())
