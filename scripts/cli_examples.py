"""Write bench_results/cli_examples.md: what `pytrain plan` and `pytrain profile` print for the
shipped demo config (config/demo.toml, the embedded default model), the outputs docs/training.md
shows.

Why a file: every figure in the README and docs/ comes from a committed file made by a committed
command; the profile's times are this machine's, the plan's sizes are the config's.

    python -m scripts.cli_examples                  # -> bench_results/cli_examples.md
"""
from __future__ import annotations

import argparse
import datetime as dt
import subprocess
import sys
from pathlib import Path

from scripts.bench_common import REPO, git_commit
from scripts.report_measured import cpu_name

COMMANDS = (["plan", "config/demo.toml"],
            ["profile", "config/demo.toml", "--top", "6"])


def run(args: list[str]) -> str:
    r = subprocess.run([sys.executable, "-m", "pytrain", *args], cwd=REPO, capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"pytrain {' '.join(args)} failed ({r.returncode}):\n{r.stderr}")
    return r.stdout.replace(f"{REPO}/", "")         # paths as the checkout names them


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench_results" / "cli_examples.md")
    a = ap.parse_args()
    lines = ["# `pytrain plan` and `pytrain profile` on the demo config", "",
             f"Made by `python -m scripts.cli_examples` ({dt.datetime.now(dt.timezone.utc):%Y-%m-%d}, "
             f"pytrain {git_commit()}, {cpu_name()}).", ""]
    for args in COMMANDS:
        lines += ["```", f"$ pytrain {' '.join(args)}", run(args).rstrip("\n"), "```", ""]
    a.out.write_text("\n".join(lines))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
