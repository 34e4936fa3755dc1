"""Write bench_results/parity.md (Qwen3.5) or llama_parity.md (the Llama family), + .json: the
parity figures as the tests measured them against their bounds (scripts/report_measured.py
over the test files below, one section each).

Why: docs/models.md quotes these errors, and every figure there must come from a committed file
made by a committed command; recorded by the tests themselves (the ``measured`` fixture), a
figure here is what the test saw, not a second computation that could drift from it.  The
references are committed .npz files (no torch) and llama.cpp (scripts/llama_logits, built by
scripts/build_llama_cpp.py; its tests skip without it, and their section says so).  About a
minute each; the Llama report's last sections need the fetched SmolLM2 (``make test`` does it).

    python -m scripts.report_parity                      # -> bench_results/parity.{md,json}
    python -m scripts.report_parity --family llama       # -> bench_results/llama_parity.{md,json}
    python -m scripts.report_parity --out /tmp/parity.md
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scripts import report_measured

REPORTS = {  # family: (title, default output, test files)
    "qwen35": ("Qwen3.5 parity: pytrain against float64, HF, PEFT and llama.cpp", "parity.md",
               ["tests/test_qwen35_parity.py", "tests/test_delta_net.py",
                "tests/test_peft_parity.py", "tests/test_llama_cpp_adapter.py"]),
    "llama": ("Llama parity: pytrain against HF, float64, PEFT and llama.cpp",
              "llama_parity.md", ["tests/test_llama_parity.py",
                                  "tests/test_llama_weight_types.py", "tests/test_smollm2.py"]),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=REPORTS, default="qwen35")
    ap.add_argument("--out", type=Path, help="default: bench_results/<the family's file>")
    ap.add_argument("-k", dest="select", default=None,
                    help="only the tests pytest -k selects (tests/test_scripts_run.py's smoke run)")
    a = ap.parse_args()
    title, name, tests = REPORTS[a.family]
    out = a.out or report_measured.ROOT / "bench_results" / name
    cmd = " ".join(["python -m scripts.report_parity"]
                   + ([f"--family {a.family}"] if a.family != "qwen35" else [])
                   + ([f"--out {a.out.as_posix()}"] if a.out else [])
                   + ([f"-k {a.select}"] if a.select else []))
    return report_measured.report(title, out, tests, cmd, sections=True,
                                  extra=["-k", a.select] if a.select else [])


if __name__ == "__main__":
    sys.exit(main())
