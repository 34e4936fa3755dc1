#!/usr/bin/env python3
"""Hunt flaky tests instead of waiting for CI to meet them: run pytest targets N times, each
run a fresh pytest process, optionally while K busy processes load the CPUs, and count per
test how often it failed.

Why: a timing-dependent failure (a message a launcher drops, a deadline a loaded CPU misses)
shows once in dozens of runs; one green run says little.  The counts, the CPU, the commit and
the command go into ``OUT.md`` and ``OUT.json`` so that "passes 50 of 50 under load" is a
measured, committed figure.

The load is ``stress-ng --cpu K`` where installed, else K Python busy loops.  It is stopped
however this script ends (normal end, an error, Ctrl-C, SIGTERM); each load process also
dies with this one (PR_SET_PDEATHSIG) and a busy loop checks its parent, so even a SIGKILL
of this script leaves no load running.

Usage:  python -m scripts.flake_hunt tests/test_distributed.py -n 50 --load 2 \\
            --out bench_results/flakes_distributed [-k EXPR] [--timeout 1800] [--note TEXT]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# a busy loop that ends when its parent (this script) is gone
BUSY = ("import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n"
        "    for _ in range(2_000_000):\n        pass\n")


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent dies (Linux prctl)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Load:
    """K processes keeping K cores busy, as a context manager: stopped on every way out."""

    def __init__(self, k: int):
        self.k = k
        self.procs: list[subprocess.Popen] = []
        self.kind = "none"

    def __enter__(self) -> "Load":
        if self.k <= 0:
            return self
        stress = shutil.which("stress-ng")
        cmds = ([[stress, "--cpu", str(self.k), "--quiet"]] if stress else
                [[sys.executable, "-c", BUSY]] * self.k)
        self.kind = f"stress-ng --cpu {self.k}" if stress else f"{self.k} Python busy loops"
        for cmd in cmds:       # own session: the whole group (stress-ng's workers) is stopped
            self.procs.append(subprocess.Popen(cmd, start_new_session=True,
                                               stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL,
                                               preexec_fn=_die_with_parent))
        return self

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.wait()
        self.procs = []


def cpu_model() -> str:
    """The CPU's name, family and vector extensions (the bounds depend on which kernels ran)."""
    from scripts.test_cpu_matrix import cpu_description
    return cpu_description()


def commit() -> str:
    try:
        head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       text=True, stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"],
                                        cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+uncommitted changes" if dirty else "")


def test_id(classname: str, name: str, rootdir: Path) -> str:
    """A junit testcase as pytest's node id (``tests/test_x.py::Class::test``): the longest
    dotted prefix of the class name that is a file under ``rootdir``."""
    parts = classname.split(".") if classname else []
    for i in range(len(parts), 0, -1):
        f = Path(*parts[:i]).with_suffix(".py")
        if (rootdir / f).exists():
            return "::".join([f.as_posix(), *parts[i:], name])
    return "::".join([classname, name]) if classname else name


def read_junit(path: Path, rootdir: Path) -> dict[str, tuple[str, str]]:
    """{test id: (outcome, message)} from one pytest junit xml; outcome passed, failed (a
    failure or an error, e.g. in a fixture) or skipped."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        tid = test_id(case.get("classname", ""), case.get("name", ""), rootdir)
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            text = (bad.get("message") or "") + "\n" + (bad.text or "")
            outcome = "failed"
            if tid in out and out[tid][0] == "failed":    # call failed and teardown errored
                text = out[tid][1] + "\n" + text
            out[tid] = (outcome, text.strip())
        elif tid not in out:
            out[tid] = ("skipped" if case.find("skipped") is not None else "passed", "")
    return out


def one_run(i: int, targets: list[str], extra: list[str], tmp: Path, timeout: float,
            cwd: Path) -> dict:
    xml = tmp / f"run-{i}.xml"
    cmd = [sys.executable, "-m", "pytest", *targets, *extra, "-q", "-p", "no:cacheprovider",
           f"--junitxml={xml}"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, preexec_fn=_die_with_parent)
    try:
        log, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:         # a hang: the whole group (mpiexec, ranks) goes
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        timed_out = True
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    run = {"run": i + 1, "rc": proc.returncode, "seconds": round(time.monotonic() - t0, 1),
           "timed_out": timed_out, "tests": {}}
    if xml.exists():
        run["tests"] = {k: list(v) for k, v in read_junit(xml, cwd).items()}
    if timed_out or not xml.exists() or proc.returncode not in (0, 1, 5):
        run["log_tail"] = log[-3000:]     # pytest itself did not finish normally
    return run


def tally(runs: list[dict]) -> dict[str, dict]:
    """Per test id: runs seen, passed, failed, skipped, and the first failure's message."""
    out: dict[str, dict] = {}
    for r in runs:
        for tid, (outcome, msg) in r["tests"].items():
            t = out.setdefault(tid, {"runs": 0, "passed": 0, "failed": 0, "skipped": 0,
                                     "first_failure": None})
            t["runs"] += 1
            t[outcome] += 1
            if outcome == "failed" and t["first_failure"] is None:
                t["first_failure"] = {"run": r["run"], "message": msg[:4000]}
    return dict(sorted(out.items()))


def markdown(res: dict) -> str:
    tests = res["tests"]
    bad = {k: v for k, v in tests.items() if v["failed"]}
    broken = [r for r in res["runs"] if r["timed_out"] or "log_tail" in r]
    lines = [f"# Flake hunt: {' '.join(res['targets'])}", "",
             f"- command: `{res['command']}`",
             f"- commit: {res['commit']}; {res['date']}",
             f"- CPU: {res['cpu']}; {res['cores']} cores ({res['cores_usable']} usable)",
             f"- load: {res['load']}; load average at start {res['loadavg_start']}, "
             f"at end {res['loadavg_end']}",
             f"- runs: {len(res['runs'])} fresh pytest processes"
             + (f" (stopped: {res['planned']} were planned)" if res.get("stopped") else "")
             + f", {res['seconds']:.0f} s in all; runs that did not finish normally: "
             f"{len(broken)}",
             f"- tests: {len(tests)}; with a failure: {len(bad)}", ""]
    if res.get("notes"):
        lines += ["Notes: " + " ".join(res["notes"]), ""]
    lines += ["| test | runs | passed | failed | skipped |", "|---|---:|---:|---:|---:|"]
    lines += [f"| `{k}` | {v['runs']} | {v['passed']} | {v['failed']} | {v['skipped']} |"
              for k, v in tests.items()]
    for k, v in bad.items():
        msg = v["first_failure"]["message"]
        lines += ["", f"## `{k}`: first failure (run {v['first_failure']['run']})", "", "```",
                  *(msg.splitlines()[:30] or [""]), "```"]
    for r in broken:
        lines += ["", f"## run {r['run']}: pytest {'timed out' if r['timed_out'] else 'rc ' + str(r['rc'])}",
                  "", "```", *r.get("log_tail", "").splitlines()[-30:], "```"]
    return "\n".join(lines) + "\n"


def write_results(res: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(res, indent=1) + "\n")
    Path(f"{out}.md").write_text(markdown(res))


def _stop_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)            # unwinds through Load.__exit__


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("targets", nargs="+", help="pytest targets (files, node ids)")
    ap.add_argument("-n", "--runs", type=int, default=10, help="pytest runs (default 10)")
    ap.add_argument("--load", type=int, default=0, metavar="K",
                    help="busy processes loading the CPUs during the runs (default 0)")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression")
    ap.add_argument("--pytest-arg", action="append", default=[], metavar="ARG",
                    help="another argument for pytest (repeatable)")
    ap.add_argument("--timeout", type=float, default=1800,
                    help="seconds one pytest run may take before it is killed (default 1800)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench_results" / "flakes",
                    help="result files OUT.md and OUT.json (default bench_results/flakes)")
    ap.add_argument("--note", action="append", default=[], help="a note for the result file")
    a = ap.parse_args(argv)
    extra = (["-k", a.keyword] if a.keyword else []) + a.pytest_arg
    cwd = Path.cwd()
    res = {"targets": a.targets, "command": "python -m scripts.flake_hunt " + " ".join(
               map(shlex.quote, sys.argv[1:] if argv is None else argv)),
           "commit": commit(), "date": dt.datetime.now().isoformat(timespec="seconds"),
           "cpu": cpu_model(), "cores": os.cpu_count(),
           "cores_usable": len(os.sched_getaffinity(0)), "notes": a.note,
           "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    t0, runs = time.monotonic(), []
    res["planned"] = a.runs

    def record(stopped: bool) -> None:
        """Results so far, rewritten after every run: a hunt stopped after hours keeps the
        counts of the runs it finished (``stopped`` says it did not do them all)."""
        res.update(loadavg_end=[round(x, 2) for x in os.getloadavg()], runs=runs,
                   seconds=time.monotonic() - t0, tests=tally(runs), stopped=stopped)
        write_results(res, a.out)

    with tempfile.TemporaryDirectory(prefix="flake-hunt-") as tmp, Load(a.load) as load:
        res["load"], res["load_pids"] = load.kind, load.pids
        for i in range(a.runs):
            r = one_run(i, a.targets, extra, Path(tmp), a.timeout, cwd)
            runs.append(r)
            failed = [k for k, (o, _) in r["tests"].items() if o == "failed"]
            print(f"run {i + 1}/{a.runs}: rc {r['rc']}, {r['seconds']} s, "
                  f"{len(r['tests'])} tests, failed: {', '.join(failed) or 'none'}"
                  + (" (TIMED OUT)" if r["timed_out"] else ""), flush=True)
            record(stopped=i + 1 < a.runs)
    if not runs:
        record(stopped=True)
    bad = {k: v["failed"] for k, v in res["tests"].items() if v["failed"]}
    print(f"{len(res['tests'])} tests, {a.runs} runs; failures: "
          f"{', '.join(f'{k} {n}/{a.runs}' for k, n in bad.items()) or 'none'}; "
          f"results in {a.out}.md")
    return 1 if bad or any(r["timed_out"] or "log_tail" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
